"""What one replica's writer keeps between batches never hides another replica's write.

The PostgreSQL writer keeps call states, worker, budget, policy and rate-window rows
from batch to batch (:mod:`effectguard.ledger.pgkept`). Each test here has replica B
change one of those between two of replica A's batches, by a path A does not see
(B's own writer), and checks that A's next decision is taken on B's change: a kept row
that was not brought up to date would let A record a fenced attempt, admit past a
budget or a rate limit, or refuse a renewed lease.

Runs against the real server at ``EFFECTGUARD_TEST_PG_DSN``; each test gets its own
schema (the ``pg_url`` fixture of ``pgkit``).
"""

from __future__ import annotations

import math

import pytest
from pgkit import NEEDS_PG, pg_url  # noqa: F401 (fixture)
from test_postgres import _admit_request, _register

from effectguard.errors import FencedError
from effectguard.ledger import Ledger, operations, pgkept
from effectguard.ledger.base import OPERATOR
from effectguard.ledger.postgres import PostgresSession, Target
from effectguard.ops.verify import verify_ledger
from effectguard.rules.budget import BudgetPolicy
from effectguard.testing.pgclock import ledger_clock, set_ledger_clock
from effectguard_bench.ledgerbench import outcome_events

pytestmark = NEEDS_PG


@pytest.fixture
def url(pg_url: str) -> str:  # noqa: F811 (pgkit's fixture: a fresh schema)
    """A ledger URL in a fresh schema, dropped after the test."""
    return pg_url


async def test_a_call_another_replica_interrupted_is_not_recorded(url: str) -> None:
    """A admits a call (its writer keeps the call's state); B interrupts it; A's late
    outcome for the attempt is refused, as if A had read the call afresh."""
    async with Ledger.open(url) as a, Ledger.open(url) as b:
        wa, wb = await _register(a, "a"), await _register(b, "b")
        admitted = await a.admit(wa, _admit_request(None, 10))
        assert admitted.action == "admit" and admitted.state is not None
        state = admitted.state
        await b.store.write(wb, lambda tx: operations.interrupt(tx, wb, state, "test"))
        events = outcome_events(admitted.call_id, admitted.attempt, "fleet", 10)
        with pytest.raises(FencedError, match="no longer in flight"):
            await a.record(wa, admitted.call_id, admitted.attempt, events)
        assert (await a.call(admitted.call_id)).stage == "effect_unknown"
        report = await verify_ledger(a)
        assert report.ok, report.problems


async def test_another_replicas_spending_counts_in_the_budget(url: str) -> None:
    """Room for two calls: A admits one, B one; A's next is refused (A's kept counters
    would still show room for one more)."""
    async with Ledger.open(url) as a, Ledger.open(url) as b:
        await a.set_limit("fleet", 20)
        wa, wb = await _register(a, "a"), await _register(b, "b")
        assert (await a.admit(wa, _admit_request(None, 10))).action == "admit"
        assert (await b.admit(wb, _admit_request(None, 10))).action == "admit"
        third = await a.admit(wa, _admit_request(None, 10))
        assert third.action == "refuse" and third.refusal is not None
        assert third.refusal.type == "budget_exceeded"


async def test_a_limit_another_replica_set_applies_at_once(url: str) -> None:
    """A admits under a generous limit (keeping the policy); B lowers it; A refuses."""
    async with Ledger.open(url) as a, Ledger.open(url) as b:
        await a.set_limit("fleet", 1_000)
        wa = await _register(a, "a")
        assert (await a.admit(wa, _admit_request(None, 10))).action == "admit"
        await b.set_limit("fleet", 15)
        refused = await a.admit(wa, _admit_request(None, 10))
        assert refused.refusal is not None and refused.refusal.type == "budget_exceeded"


async def test_a_rate_window_counts_another_replicas_requests(url: str) -> None:
    """rpm 2: A admits one, B one, A's next is refused 429 within the same minute."""
    set_ledger_clock(url, None)  # creates the ledger, so its clock can be read
    minute_start = math.floor(ledger_clock(url) / 60 + 1) * 60
    set_ledger_clock(url, minute_start + 1)  # a minute of room: no boundary mid-test
    try:
        async with Ledger.open(url) as a, Ledger.open(url) as b:
            await a.set_policy(BudgetPolicy("fleet", rpm=2))
            wa, wb = await _register(a, "a"), await _register(b, "b")
            assert (await a.admit(wa, _admit_request(None, 10))).action == "admit"
            assert (await b.admit(wb, _admit_request(None, 10))).action == "admit"
            third = await a.admit(wa, _admit_request(None, 10))
            assert third.refusal is not None and third.refusal.type == "rate_limited"
    finally:
        set_ledger_clock(url, None)


async def test_a_lease_renewed_through_another_replica_is_seen(url: str) -> None:
    """A renewal writes no event: A's writer still sees it. Worker ``w``'s lease has
    lapsed when A refuses it; renewed through B, A admits for it again."""
    async with Ledger.open(url) as a, Ledger.open(url) as b:
        w = await _register(a, "w", lease_s=0.0)
        with pytest.raises(FencedError, match="lease lapsed"):
            await a.admit(w, _admit_request(None, 10))
        await b.store.write(w, lambda tx: operations.heartbeat(tx, w, 30.0))
        assert (await a.admit(w, _admit_request(None, 10))).action == "admit"


def test_a_batch_that_did_not_commit_leaves_nothing_kept(url: str) -> None:
    """What a rolled-back batch wrote is not answered from the kept rows afterwards."""
    session = PostgresSession(Target.parse(url))
    try:
        session.begin()
        session.savepoint()
        operations.set_limit(session, OPERATOR, "lost", 5)
        session.release()
        session.rollback()
        session.begin()
        assert session.get_policies(["lost"]) == {}
        session.commit()
    finally:
        session.close()


async def test_too_many_foreign_events_to_list_drop_every_kept_call(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B appends more events than A's writer lists (here 2, not 4096), the interruption of
    A's call among the unlisted: A starts over and refuses the late outcome."""
    monkeypatch.setattr(pgkept, "EVENTS_SCANNED", 2)
    monkeypatch.setattr(pgkept, "CALLS_SINCE", pgkept.CALLS_SINCE.replace("LIMIT 4096", "LIMIT 2"))
    async with Ledger.open(url) as a, Ledger.open(url) as b:
        wa, wb = await _register(a, "a"), await _register(b, "b")
        admitted = await a.admit(wa, _admit_request(None, 10))
        assert admitted.state is not None
        state = admitted.state
        assert (await b.admit(wb, _admit_request(None, 10))).action == "admit"  # 3 events
        await b.store.write(wb, lambda tx: operations.interrupt(tx, wb, state, "test"))
        events = outcome_events(admitted.call_id, admitted.attempt, "fleet", 10)
        with pytest.raises(FencedError, match="no longer in flight"):
            await a.record(wa, admitted.call_id, admitted.attempt, events)


def test_a_batch_that_could_not_begin_leaves_the_writer_usable(url: str) -> None:
    """The batch lock cannot be had (another session holds it past ``lock_timeout``): that
    batch fails, the transaction it opened is rolled back, and the next batch runs."""
    import psycopg

    from effectguard.ledger.pgschema import lock_key

    session = PostgresSession(Target.parse(url))
    holder = Target.parse(url).connect()
    try:
        session.conn.execute("SET lock_timeout = '50ms'")
        with holder.transaction():
            holder.execute("SELECT pg_advisory_xact_lock(%s)", (lock_key(holder, "batch"),))
            with pytest.raises(psycopg.errors.LockNotAvailable):
                session.begin()
        session.begin()
        session.savepoint()
        operations.set_limit(session, OPERATOR, "kept", 5)
        session.release()
        session.commit()
    finally:
        holder.close()
        session.close()
