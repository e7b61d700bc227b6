"""The contract every ledger store passes: memory, SQLite and (when configured) PostgreSQL.

Each test gets a fresh namespace (budget root, worker ids) so it also runs against a shared
PostgreSQL database. Every ledger is verified (hash chain, budget fold, projections) at the
end of every test.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import importlib
import io
import os
import sqlite3
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from admitkit import admit_request
from eventkit import late_200

from effectguard.errors import BodyMismatch, ConfigError, FencedError, ReconcileError
from effectguard.ingress.admin.spend import spend_by_day, spend_table
from effectguard.ledger import (
    OPERATOR,
    AdmitRequest,
    Admitted,
    Ledger,
    Writer,
    attempts,
    bodystore,
    endedsessions,
    open_store,
    operations,
)
from effectguard.ledger.base import CallSpend, SpendSums, Tx, sum_spend
from effectguard.ops.verify import verify_ledger
from effectguard.rules.admission import Sending
from effectguard.rules.bodyref import CHUNK_BYTES, REF_ENCODING, SpooledBody
from effectguard.rules.bodytext import decode_body
from effectguard.rules.budget import BudgetNode, is_under
from effectguard.rules.digest import credential_digest
from effectguard.rules.events import (
    GENESIS_DIGEST,
    AttemptNotSent,
    AttemptObserved,
    AttemptStarted,
    BudgetReleased,
    BudgetSettled,
    CallCompleted,
    Event,
    StoredEvent,
    canonical_json,
    event_digest,
    seal,
    stored_digest,
)
from effectguard.rules.workstate import WorkState
from effectguard.testing.clock import ManualClock

R = 1_000  # nano-dollars reserved per call
PG_ENV = "EFFECTGUARD_TEST_PG_DSN"


def _pg_dsn() -> str:
    dsn = os.environ.get(PG_ENV)
    if not dsn:
        pytest.skip(f"PostgreSQL contract run needs {PG_ENV} set to a DSN")
    try:
        importlib.import_module("effectguard.ledger.postgres")
    except ModuleNotFoundError:
        pytest.skip("effectguard.ledger.postgres does not exist yet")
    return dsn


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def store_kind(request: pytest.FixtureRequest) -> str:
    """Which store this run of the contract is for."""
    return str(request.param)


@pytest.fixture
def ledger_url(store_kind: str, tmp_path: Path, ns: str) -> Iterator[str]:
    """A fresh, empty ledger location (PostgreSQL: a schema of its own, dropped afterwards)."""
    if store_kind == "memory":
        yield "memory://"
    elif store_kind == "sqlite":
        yield str(tmp_path / "ledger.db")
    else:
        dsn = _pg_dsn()
        yield f"{dsn}{'&' if '?' in dsn else '?'}schema={ns}"
        import psycopg

        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {ns} CASCADE")


@pytest.fixture
def clock(store_kind: str) -> ManualClock | None:
    """The ledger's clock: a manual one where the store takes one (PostgreSQL: the database's)."""
    return None if store_kind == "postgres" else ManualClock()


@pytest.fixture
def lapse(clock: ManualClock | None) -> Callable[[float], Awaitable[None]]:
    """Let ``seconds`` of ledger time pass: advance the manual clock, or wait on PostgreSQL."""

    async def let_pass(seconds: float) -> None:
        if clock is None:
            await asyncio.sleep(seconds)
        else:
            clock.advance(seconds)

    return let_pass


@pytest.fixture
async def ledger(ledger_url: str, clock: ManualClock | None) -> AsyncIterator[Ledger]:
    """An open ledger that must still verify cleanly when the test is done."""
    async with Ledger.open(ledger_url, clock=clock) as led:
        yield led
        report = await verify_ledger(led)
        assert report.ok, report.problems


@pytest.fixture
def ns() -> str:
    """A fresh budget root / name prefix for this test."""
    return "t" + uuid.uuid4().hex[:12]


async def register(ledger: Ledger, worker: str, lease_s: float = 30.0) -> Writer:
    """Register ``worker`` and return its writer identity."""
    return await ledger.store.write(
        Writer("boot", 0),
        lambda tx: operations.register_worker(tx, worker=worker, host="h", pid=1, lease_s=lease_s),
    )


@pytest.fixture
async def w1(ledger: Ledger, ns: str) -> Writer:
    """A live worker with a 30 s lease."""
    return await register(ledger, f"{ns}-w1")


def req(
    ns: str,
    *,
    key: str | None = None,
    request_hash: str = "hash-1",
    reserve: int = R,
    budget: str | None = None,
    **kw: object,
) -> AdmitRequest:
    """An admit request charged to ``{ns}/run`` unless ``budget`` says otherwise."""
    return admit_request(
        budget or f"{ns}/run",
        budget_root=ns,
        request_hash=request_hash,
        key=key,
        body='{"messages": []}',
        reserve=reserve,
        **kw,
    )


def observed(call_id: str, attempt: int = 1, status: int = 200) -> AttemptObserved:
    """A stored upstream answer."""
    return AttemptObserved(
        call=call_id,
        attempt=attempt,
        status=status,
        not_processed=False,
        usage={"input_tokens": 10, "output_tokens": 20},
        usage_problem=None,
        headers={"content-type": "application/json"},
        body='{"id": "resp-1", "choices": []}',
    )


def completion(call_id: str, budget: str, actual: int, attempt: int = 1) -> list[Event]:
    """observed + settled + completed for one attempt."""
    return [
        observed(call_id, attempt),
        BudgetSettled(call=call_id, budget=budget, reserved=R, actual=actual),
        CallCompleted(call=call_id, outcome="completed"),
    ]


async def node(ledger: Ledger, path: str) -> tuple[int | None, int, int, int]:
    """``(limit, reserved, spent, held)`` of one budget node."""
    for n in await ledger.budgets():
        if n.path == path:
            return n.limit, n.reserved, n.spent, n.held
    raise AssertionError(f"no budget node {path!r}")


async def all_events(ledger: Ledger) -> list[StoredEvent]:
    """Every event in the ledger, in order."""
    return await ledger.store.events_after(0, 1 << 30)


def assert_chained(events: Sequence[StoredEvent]) -> None:
    """Sequence numbers are gap-free and every digest covers its content and predecessor."""
    prev = GENESIS_DIGEST if events and events[0].seq == 1 else events[0].prev_digest
    for i, e in enumerate(events):
        assert e.seq == events[0].seq + i
        assert e.prev_digest == prev
        assert e.digest == stored_digest(e)
        prev = e.digest


async def admit_ok(ledger: Ledger, writer: Writer, request: AdmitRequest) -> Admitted:
    """Admit ``request`` and insist that it was admitted."""
    admitted = await ledger.admit(writer, request)
    assert admitted.action == "admit", admitted.refusal
    return admitted


# -- admission and the event chain -------------------------------------------------------


async def test_admit_writes_manifest_reservation_and_attempt(
    ledger: Ledger, w1: Writer, ns: str
) -> None:
    """Admission appends call.manifest, budget.reserved, attempt.started, gap-free and chained."""
    admitted = await admit_ok(ledger, w1, req(ns, key="k1"))
    assert admitted.attempt == 1
    assert admitted.call_id.startswith("call_")
    events = await ledger.events(admitted.call_id)
    assert [e.kind for e in events] == ["call.manifest", "budget.reserved", "attempt.started"]
    assert [e.seq for e in events] == [events[0].seq, events[0].seq + 1, events[0].seq + 2]
    assert_chained(events)
    assert_chained(await all_events(ledger))
    started = events[2]
    assert (started.data["worker"], started.data["generation"]) == (w1.worker, w1.generation)
    assert all((e.worker, e.generation) == (w1.worker, w1.generation) for e in events)
    state = await ledger.call(admitted.call_id)
    assert state == admitted.state
    assert (state.stage, state.attempts, state.reserved, state.idempotency_key) == (
        "in_flight",
        1,
        R,
        "k1",
    )
    assert await node(ledger, ns) == (None, R, 0, 0)
    assert await node(ledger, f"{ns}/run") == (None, R, 0, 0)


#: Where the bundled Stripe creates write their operation id (OpIdPlacement.label).
OP_ID_IN = "form metadata[effectguard_op]"
#: How such a create goes out: its op id's place, where it is sent, its key's digest.
SENT = Sending(OP_ID_IN, "https://api.stripe.com", credential_digest("Bearer sk_test_x"))
#: The data keys of every attempt.started written before op_id_in was kept.
STARTED_KEYS = {"at", "attempt", "call", "generation", "provider_idempotency_key", "worker"}


async def test_an_attempt_records_how_it_went_out(ledger: Ledger, w1: Writer, ns: str) -> None:
    """Where an attempt wrote the call's operation id, where it was sent and its
    credential's digest (``op_id_in``, ``sent_to``, ``key_digest``: the admission's and an
    automatic retry's alike) round-trip on every store: read by call and in order, typed,
    and covered by its digest."""
    admitted = await admit_ok(ledger, w1, req(ns, key="k1", sending=SENT))
    call_id = admitted.call_id
    not_sent = [
        AttemptNotSent(call=call_id, attempt=1, reason="connect error"),
        BudgetReleased(call=call_id, budget=f"{ns}/run", amount=R),
    ]
    await ledger.record(w1, call_id, 1, not_sent)
    retried = await ledger.store.write(
        w1, lambda tx: attempts.start_attempt(tx, w1, call_id, R, None, SENT)
    )
    assert (retried.action, retried.attempt) == ("attempt", 2)
    by_call = [e for e in await ledger.events(call_id) if e.kind == "attempt.started"]
    in_order = [
        e for e in await all_events(ledger) if e.kind == "attempt.started" and e.call_id == call_id
    ]
    assert by_call == in_order and len(by_call) == 2
    for number, started in enumerate(by_call, start=1):
        assert started.data == {
            "call": call_id,
            "attempt": number,
            "worker": w1.worker,
            "generation": w1.generation,
            "provider_idempotency_key": None,
            "at": started.data["at"],
            "op_id_in": OP_ID_IN,
            "sent_to": SENT.sent_to,
            "key_digest": SENT.key_digest,
        }
        assert started.event == AttemptStarted(
            call=call_id,
            attempt=number,
            worker=w1.worker,
            generation=w1.generation,
            at=started.data["at"],
            op_id_in=OP_ID_IN,
            sent_to=SENT.sent_to,
            key_digest=SENT.key_digest,
        )
        assert started.event.to_data() == started.data
        assert started.digest == stored_digest(started)
    assert_chained(await all_events(ledger))


async def test_an_attempt_without_an_operation_id_is_stored_as_before(
    ledger: Ledger, w1: Writer, ns: str
) -> None:
    """An attempt that writes no operation id stores the data every attempt.started had
    before ``op_id_in`` was kept (no such field, not even null), its digest over exactly
    that data, and it reads back as the same event."""
    admitted = await admit_ok(ledger, w1, req(ns, key="k1"))
    (started,) = [e for e in await ledger.events(admitted.call_id) if e.kind == "attempt.started"]
    assert started.data.keys() == STARTED_KEYS
    as_before = {name: started.data[name] for name in sorted(STARTED_KEYS)}
    assert started.digest == event_digest(
        seq=started.seq,
        kind="attempt.started",
        call_id=admitted.call_id,
        data_json=canonical_json(as_before),
        worker=w1.worker,
        generation=w1.generation,
        at=started.at,
        prev_digest=started.prev_digest,
    )
    assert started.event.op_id_in is started.event.sent_to is started.event.key_digest is None
    assert started.event.to_data() == started.data


def test_an_attempt_without_an_operation_id_seals_to_its_pinned_digest() -> None:
    """Sealed now, an attempt.started without ``op_id_in`` gives the data JSON and the
    digest pinned from the release before it was kept, so older ledgers verify as before."""
    call = "call_0123456789abcdef0123456789abcdef"
    event = AttemptStarted(call=call, attempt=2, worker="w-1", generation=7,
                           provider_idempotency_key=call, at=1767225600.25)  # fmt: skip
    stored, data_json = seal(
        event, seq=42, worker="w-1", generation=7, at=1767225600.25, prev_digest="ab" * 32
    )
    assert data_json == (
        '{"at":1767225600.25,"attempt":2,"call":"call_0123456789abcdef0123456789abcdef",'
        '"generation":7,"provider_idempotency_key":"call_0123456789abcdef0123456789abcdef",'
        '"worker":"w-1"}'
    )
    assert stored.digest == "ad7a62a61c20ea7535b6fc41deb02b07f35d55d4cd0f9b1a772d343da6efad4d"
    assert stored.event == event


async def test_record_settles_and_completes(ledger: Ledger, w1: Writer, ns: str) -> None:
    """Recording observed + settled + completed completes the call and moves reserved to spent."""
    admitted = await admit_ok(ledger, w1, req(ns))
    state = await ledger.record(
        w1, admitted.call_id, 1, completion(admitted.call_id, f"{ns}/run", actual=1_700)
    )
    assert (state.stage, state.status, state.cost, state.reserved) == ("completed", 200, 1_700, 0)
    assert await ledger.call(admitted.call_id) == state
    assert await node(ledger, ns) == (None, 0, 1_700, 0)
    kinds = [e.kind for e in await ledger.events(admitted.call_id)]
    assert kinds[-3:] == ["attempt.observed", "budget.settled", "call.completed"]
    assert_chained(await all_events(ledger))


async def test_keyed_repeat_of_a_completed_call_is_replayed(
    ledger: Ledger, w1: Writer, ns: str
) -> None:
    """Same key, same hash after completion: replay with the stored response, nothing written."""
    admitted = await admit_ok(ledger, w1, req(ns, key="k1"))
    await ledger.record(w1, admitted.call_id, 1, completion(admitted.call_id, f"{ns}/run", 900))
    before = len(await all_events(ledger))
    replay = await ledger.admit(w1, req(ns, key="k1"))
    assert replay.action == "replay"
    assert replay.call_id == admitted.call_id
    assert replay.observed == observed(admitted.call_id)
    assert len(await all_events(ledger)) == before
    assert await node(ledger, ns) == (None, 0, 900, 0)


async def test_key_reuse_with_another_request_is_refused_422(
    ledger: Ledger, w1: Writer, ns: str
) -> None:
    """Same key, different request hash: 422 idempotency_key_reused, nothing written."""
    admitted = await admit_ok(ledger, w1, req(ns, key="k1"))
    before = len(await all_events(ledger))
    refused = await ledger.admit(w1, req(ns, key="k1", request_hash="hash-2"))
    assert refused.action == "refuse"
    assert refused.refusal is not None
    assert (refused.refusal.status, refused.refusal.type) == (422, "idempotency_key_reused")
    assert refused.call_id == admitted.call_id
    assert len(await all_events(ledger)) == before


async def test_same_key_in_another_root_is_independent(ledger: Ledger, w1: Writer, ns: str) -> None:
    """An idempotency key is scoped to its budget root."""
    first = await admit_ok(ledger, w1, req(ns, key="k1"))
    other = ns + "x"
    second = await admit_ok(ledger, w1, req(other, key="k1", request_hash="hash-2"))
    assert first.call_id != second.call_id


async def test_keyed_repeat_while_in_flight_is_refused_409(
    ledger: Ledger, w1: Writer, ns: str
) -> None:
    """Same key while the call is in flight: 409 in_progress naming the call."""
    admitted = await admit_ok(ledger, w1, req(ns, key="k1"))
    refused = await ledger.admit(w1, req(ns, key="k1"))
    assert refused.refusal is not None
    assert (refused.refusal.status, refused.refusal.type) == (409, "in_progress")
    assert refused.refusal.call_id == admitted.call_id
    assert refused.refusal.stage == "in_flight"


async def test_concurrent_admissions_with_one_key_admit_exactly_one(
    ledger: Ledger, w1: Writer, ns: str
) -> None:
    """Twenty concurrent admissions under one key: one admitted, the others 409 in_progress."""
    results = await asyncio.gather(*(ledger.admit(w1, req(ns, key="k1")) for _ in range(20)))
    admitted = [r for r in results if r.action == "admit"]
    assert len(admitted) == 1
    refused = [r for r in results if r.action == "refuse"]
    assert len(refused) == 19
    assert all(r.refusal is not None and r.refusal.type == "in_progress" for r in refused)
    assert await node(ledger, ns) == (None, R, 0, 0)


async def test_not_sent_call_is_resumed_under_the_same_key(
    ledger: Ledger, w1: Writer, ns: str
) -> None:
    """After attempt.not_sent, the same key and hash start attempt 2 of the same call."""
    admitted = await admit_ok(ledger, w1, req(ns, key="k1"))
    state = await ledger.record(
        w1,
        admitted.call_id,
        1,
        [
            AttemptNotSent(call=admitted.call_id, attempt=1, reason="connect error"),
            BudgetReleased(call=admitted.call_id, budget=f"{ns}/run", amount=R),
        ],
    )
    assert state.stage == "not_sent"
    assert await node(ledger, ns) == (None, 0, 0, 0)
    again = await ledger.admit(w1, req(ns, key="k1"))
    assert (again.action, again.call_id, again.attempt) == ("attempt", admitted.call_id, 2)
    assert (await ledger.call(admitted.call_id)).stage == "in_flight"
    assert await node(ledger, ns) == (None, R, 0, 0)


async def test_resumed_call_is_charged_where_it_was_admitted(
    ledger: Ledger, w1: Writer, ns: str
) -> None:
    """A new attempt under the same key reserves on the call's budget, not the request's."""
    admitted = await admit_ok(ledger, w1, req(ns, key="k1", budget=f"{ns}/a"))
    await ledger.record(
        w1,
        admitted.call_id,
        1,
        [
            AttemptNotSent(call=admitted.call_id, attempt=1, reason="connect error"),
            BudgetReleased(call=admitted.call_id, budget=f"{ns}/a", amount=R),
        ],
    )
    again = await ledger.admit(w1, req(ns, key="k1", budget=f"{ns}/b"))
    assert (again.action, again.call_id) == ("attempt", admitted.call_id)
    assert await node(ledger, f"{ns}/a") == (None, R, 0, 0)
    assert f"{ns}/b" not in {n.path for n in await ledger.budgets()}


async def test_keyless_declared_retry_joins_then_refuses_effect_unknown(
    ledger: Ledger, w1: Writer, ns: str
) -> None:
    """A key-less declared retry joins an in-flight twin; once its effect is unknown, 409."""
    first = await admit_ok(ledger, w1, req(ns))
    twin = await admit_ok(ledger, w1, req(ns))  # not a retry: independent parallel work
    assert twin.call_id != first.call_id
    joined = await ledger.admit(w1, req(ns, is_retry=True, retry_of=first.call_id))
    assert (joined.action, joined.call_id) == ("join", first.call_id)
    await ledger.interrupt(w1, first.call_id, 1, "read timeout")
    refused = await ledger.admit(w1, req(ns, is_retry=True, retry_of=first.call_id))
    assert refused.refusal is not None
    assert (refused.refusal.status, refused.refusal.type) == (409, "effect_unknown")


async def test_keyless_declared_retry_by_hash_meets_the_call_decided_applied(
    ledger: Ledger, w1: Writer, ns: str
) -> None:
    """A key-less declared retry matched by hash (no call named) repeats an unknown call
    as long as it is unknown, and still once a person decided it applied: 409
    ``reconciled_applied``, not a new call. Once it is decided not applied, it is new work."""
    first = await admit_ok(ledger, w1, req(ns))
    await ledger.interrupt(w1, first.call_id, 1, "read timeout")
    unknown = await ledger.admit(w1, req(ns, is_retry=True))
    assert unknown.refusal is not None and unknown.refusal.type == "effect_unknown"
    await ledger.reconcile(first.call_id, applied=True, note="n", by="ann")
    decided = await ledger.admit(w1, req(ns, is_retry=True))
    assert decided.refusal is not None
    assert (decided.refusal.status, decided.refusal.type) == (409, "reconciled_applied")
    assert decided.call_id == first.call_id
    other = await admit_ok(ledger, w1, req(ns, request_hash="hash-2"))
    await ledger.interrupt(w1, other.call_id, 1, "read timeout")
    await ledger.reconcile(other.call_id, applied=False, note="n", by="ann")
    new = await ledger.admit(w1, req(ns, request_hash="hash-2", is_retry=True))
    assert new.action == "admit" and new.call_id not in (first.call_id, other.call_id)


async def test_keyless_declared_retry_of_a_contradicted_call_is_refused(
    ledger: Ledger, w1: Writer, ns: str
) -> None:
    """A call decided not applied whose late answer says the provider applied it: a
    key-less declared retry, by hash or naming it, is refused 409 ``late_answer_applied``
    (next_operation none), not admitted as new work; the retry of a call decided not
    applied that nothing contradicts still is new work."""
    first = await admit_ok(ledger, w1, req(ns))
    await ledger.interrupt(w1, first.call_id, 1, "read timeout")
    await ledger.reconcile(first.call_id, applied=False, note="n", by="ann")
    await ledger.record_late_answer(
        w1, late_200(first.call_id, observed_by=w1.worker, generation=w1.generation)
    )
    for retry_of in (None, first.call_id):
        refused = await ledger.admit(w1, req(ns, is_retry=True, retry_of=retry_of))
        assert refused.refusal is not None, refused
        assert (refused.refusal.status, refused.refusal.type) == (409, "late_answer_applied")
        assert (refused.call_id, refused.refusal.next_operation) == (first.call_id, "none")
    other = await admit_ok(ledger, w1, req(ns, request_hash="hash-2"))
    await ledger.interrupt(w1, other.call_id, 1, "read timeout")
    await ledger.reconcile(other.call_id, applied=False, note="n", by="ann")
    new = await ledger.admit(w1, req(ns, request_hash="hash-2", is_retry=True))
    assert new.action == "admit" and new.call_id != other.call_id


async def test_keyless_retry_by_hash_finds_a_contradicted_call_behind_a_newer_decision(
    ledger: Ledger, w1: Writer, ns: str
) -> None:
    """Two identical key-less calls decided not applied, the older one contradicted by a
    late 200: a retry by hash repeats the older one (the newest call it matches, §4) and
    is refused 409 ``late_answer_applied``; once a newer identical call is unknown, that
    one is the newest match (409 ``effect_unknown``)."""
    calls = []
    for _ in range(2):
        admitted = await admit_ok(ledger, w1, req(ns))
        await ledger.interrupt(w1, admitted.call_id, 1, "read timeout")
        await ledger.reconcile(admitted.call_id, applied=False, note="n", by="ann")
        calls.append(admitted.call_id)
    older, newer = calls
    await ledger.record_late_answer(
        w1, late_200(older, observed_by=w1.worker, generation=w1.generation)
    )
    refused = await ledger.admit(w1, req(ns, is_retry=True))
    assert refused.refusal is not None, refused
    assert (refused.refusal.type, refused.call_id) == ("late_answer_applied", older)
    assert newer != older
    unknown = await admit_ok(ledger, w1, req(ns))
    await ledger.interrupt(w1, unknown.call_id, 1, "read timeout")
    refused = await ledger.admit(w1, req(ns, is_retry=True))
    assert refused.refusal is not None, refused
    assert (refused.refusal.type, refused.call_id) == ("effect_unknown", unknown.call_id)


async def test_find_decided_reads_the_newest_decided_calls_by_hash_in_one_list(
    ledger: Ledger, w1: Writer, ns: str, clock: ManualClock | None
) -> None:
    """``Tx.find_decided`` lists, newest first and at most ``limit`` of them, the calls of
    a budget root with a request hash created since a time that were decided applied (or,
    ``applied`` False, not applied): what a retry matched by hash reads in one query."""
    decided: dict[bool, list[str]] = {True: [], False: []}
    for n, applied in enumerate((False, True, False, False)):
        if clock is not None:
            clock.advance(1)  # PostgreSQL's own clock moves between transactions
        admitted = await admit_ok(ledger, w1, req(ns))
        await ledger.interrupt(w1, admitted.call_id, 1, "read timeout")
        await ledger.reconcile(admitted.call_id, applied=applied, note=f"n{n}", by="ann")
        decided[applied].insert(0, admitted.call_id)
    other = await admit_ok(ledger, w1, req(ns, request_hash="hash-2"))
    await ledger.interrupt(w1, other.call_id, 1, "read timeout")
    await ledger.reconcile(other.call_id, applied=False, note="n", by="ann")

    async def read(
        request_hash: str, since: float, applied: bool, limit: int, root: str = ns
    ) -> list[str]:
        def find(tx: Tx) -> list[str]:
            return [c.call_id for c in tx.find_decided(root, request_hash, since, applied, limit)]

        return await ledger.store.write(w1, find)

    assert await read("hash-1", 0.0, False, 16) == decided[False]
    assert await read("hash-1", 0.0, False, 2) == decided[False][:2]
    assert await read("hash-1", 0.0, True, 16) == decided[True]
    assert await read("hash-2", 0.0, False, 16) == [other.call_id]
    assert await read("hash-3", 0.0, False, 16) == []
    newest = next(c for c in await ledger.calls() if c.call_id == decided[False][0])
    assert await read("hash-1", newest.created_at, False, 16) == decided[False][:1]
    assert await read("hash-1", 0.0, False, 16, root=f"{ns}x") == []


# -- budgets -----------------------------------------------------------------------------


async def test_budget_refusal_records_and_frees_the_key(
    ledger: Ledger, w1: Writer, ns: str
) -> None:
    """402 records call.manifest + call.refused, reserves nothing, and leaves the key usable."""
    await ledger.set_limit(ns, 500)
    refused = await ledger.admit(w1, req(ns, key="k1"))
    assert refused.action == "refuse"
    assert refused.refusal is not None
    assert (refused.refusal.status, refused.refusal.type) == (402, "budget_exceeded")
    assert repr(ns) in refused.refusal.message
    assert "0.000000500" in refused.refusal.message  # the room, in USD
    assert [e.kind for e in await ledger.events(refused.call_id)] == [
        "call.manifest",
        "call.refused",
    ]
    assert (await ledger.call(refused.call_id)).stage == "refused"
    assert await node(ledger, ns) == (500, 0, 0, 0)

    again = await ledger.admit(w1, req(ns, key="k1"))
    assert again.refusal is not None and again.refusal.type == "budget_exceeded"

    await ledger.set_limit(ns, 10_000)
    admitted = await admit_ok(ledger, w1, req(ns, key="k1"))
    assert admitted.call_id not in (refused.call_id, again.call_id)
    assert await node(ledger, ns) == (10_000, R, 0, 0)


async def test_limit_on_a_child_refuses_and_names_it(ledger: Ledger, w1: Writer, ns: str) -> None:
    """A limit on a/b refuses a charge to a/b/c while the root has room."""
    await ledger.set_limit(ns, 10**9)
    await ledger.set_limit(f"{ns}/b", R - 1)
    refused = await ledger.admit(w1, req(ns, budget=f"{ns}/b/c"))
    assert refused.refusal is not None
    assert repr(f"{ns}/b") in refused.refusal.message


async def test_concurrent_admissions_never_overshoot(ledger: Ledger, w1: Writer, ns: str) -> None:
    """200 concurrent admissions with room for exactly k admit exactly k, in shared commits."""
    k = 37
    await ledger.set_limit(ns, k * R)
    stats = ledger.store.committer.stats  # type: ignore[attr-defined]
    commits, operations_before = stats.commits, stats.operations
    results = await asyncio.gather(*(ledger.admit(w1, req(ns)) for _ in range(200)))
    admitted = [r for r in results if r.action == "admit"]
    refused = [r for r in results if r.action == "refuse"]
    assert len(admitted) == k
    assert len(refused) == 200 - k
    assert all(r.refusal is not None and r.refusal.status == 402 for r in refused)
    assert len({r.call_id for r in results}) == 200
    assert await node(ledger, ns) == (k * R, k * R, 0, 0)
    assert stats.operations - operations_before == 200
    assert stats.commits - commits < 200


# -- unknown effects and reconciling ---------------------------------------------------------


async def test_interrupt_moves_the_reservation_to_held(ledger: Ledger, w1: Writer, ns: str) -> None:
    """attempt.interrupted makes the call effect_unknown and its reservation held."""
    admitted = await admit_ok(ledger, w1, req(ns))
    state = await ledger.interrupt(w1, admitted.call_id, 1, "read timeout")
    assert (state.stage, state.effect, state.next_operation) == (
        "effect_unknown",
        "unknown",
        "reconcile",
    )
    assert (state.reserved, state.held) == (0, R)
    assert await node(ledger, f"{ns}/run") == (None, 0, 0, R)
    assert [e.kind for e in await ledger.events(admitted.call_id)][-2:] == [
        "attempt.interrupted",
        "budget.held",
    ]


async def test_in_flight_except_workers_lists_every_other_workers_calls_in_flight(
    ledger: Ledger, w1: Writer, ns: str, lapse: Callable[[float], Awaitable[None]]
) -> None:
    """``in_flight_except`` reads the calls in flight of every worker but those named, at
    most ``limit`` of them, in one read: a fenced worker's call left in flight (a sweep
    that could only fence) and a call of a worker with no live row are among them; the
    named workers' calls and calls that left ``in_flight`` are not."""
    other = await register(ledger, f"{ns}-other")
    fenced = await register(ledger, f"{ns}-fenced", lease_s=0.5)
    mine = [await admit_ok(ledger, w1, req(ns, request_hash=f"h-{n}")) for n in range(3)]
    theirs = await admit_ok(ledger, other, req(ns, request_hash="h-other"))
    stranded = await admit_ok(ledger, fenced, req(ns, request_hash="h-fenced"))
    await ledger.interrupt(w1, mine[2].call_id, 1, "read timeout")
    await lapse(1)  # the fenced worker's lease, not the others'
    # A sweep that could only fence (its one transaction failed): the call stays in flight.
    await ledger.store.write(w1, lambda tx: operations.sweep(tx, w1, interrupt_calls=False))
    assert (await ledger.call(stranded.call_id)).stage == "in_flight"
    names = [w1.worker, other.worker]
    assert [c.call_id for c in await ledger.in_flight_except(names)] == [stranded.call_id]
    found = await ledger.in_flight_except([other.worker, f"{ns}-never-registered"], limit=10)
    expected = [*(c.call_id for c in mine[:2]), stranded.call_id]
    assert sorted(c.call_id for c in found) == sorted(expected)
    assert all(c.stage == "in_flight" for c in found)
    assert len(await ledger.in_flight_except([other.worker], limit=1)) == 1
    everyone = await ledger.in_flight_except([])
    assert sorted(c.call_id for c in everyone) == sorted([*expected, theirs.call_id])
    assert await ledger.in_flight_except([*names, fenced.worker]) == []


async def test_unknown_calls_list_oldest_first_when_asked(
    ledger: Ledger, w1: Writer, ns: str, clock: ManualClock | None
) -> None:
    """``oldest_first`` lists unknown calls in admission order, and its limit keeps the
    oldest; the default is newest first."""
    ids = []
    for n in range(3):
        if clock is not None:
            clock.advance(1)  # PostgreSQL's own clock moves between transactions
        admitted = await admit_ok(ledger, w1, req(ns, request_hash=f"hash-{n}"))
        await ledger.interrupt(w1, admitted.call_id, 1, "read timeout")
        ids.append(admitted.call_id)
    budget = f"{ns}/run"
    oldest = await ledger.calls(stage="effect_unknown", budget=budget, oldest_first=True)
    newest = await ledger.calls(stage="effect_unknown", budget=budget)
    assert [c.call_id for c in oldest] == ids == [c.call_id for c in reversed(newest)]
    first = await ledger.calls(stage="effect_unknown", budget=budget, limit=1, oldest_first=True)
    assert [c.call_id for c in first] == ids[:1]


async def test_interrupt_of_a_stale_attempt_changes_nothing(
    ledger: Ledger, w1: Writer, ns: str
) -> None:
    """Interrupting an attempt number that is not the current one writes nothing."""
    admitted = await admit_ok(ledger, w1, req(ns))
    before = len(await all_events(ledger))
    state = await ledger.interrupt(w1, admitted.call_id, 7, "stale")
    assert state.stage == "in_flight"
    assert len(await all_events(ledger)) == before


async def test_keyed_repeat_of_effect_unknown_is_refused(
    ledger: Ledger, w1: Writer, ns: str
) -> None:
    """Same key after an interrupt, no provider idempotency: 409 effect_unknown."""
    admitted = await admit_ok(ledger, w1, req(ns, key="k1"))
    await ledger.interrupt(w1, admitted.call_id, 1, "read timeout")
    refused = await ledger.admit(w1, req(ns, key="k1"))
    assert refused.refusal is not None
    assert (refused.refusal.status, refused.refusal.type) == (409, "effect_unknown")


async def test_effect_unknown_inside_provider_window_is_resent(
    ledger: Ledger, w1: Writer, ns: str
) -> None:
    """With a declared provider window, an effect-unknown call is resent with the provider key
    (its call id, not the client's key)."""
    admitted = await admit_ok(ledger, w1, req(ns, key="k1", provider_idempotency_window_s=3600.0))
    assert admitted.provider_idempotency_key == admitted.call_id
    await ledger.interrupt(w1, admitted.call_id, 1, "read timeout")
    resent = await ledger.admit(w1, req(ns, key="k1", provider_idempotency_window_s=3600.0))
    assert (resent.action, resent.call_id, resent.attempt) == (
        "provider_resend",
        admitted.call_id,
        2,
    )
    assert resent.provider_idempotency_key == admitted.call_id
    state = await ledger.call(admitted.call_id)
    assert (state.stage, state.attempts, state.reserved, state.held) == ("in_flight", 2, R, 0)
    assert await node(ledger, ns) == (None, R, 0, 0)  # the old hold is replaced, not doubled


@pytest.mark.parametrize(("cost", "spent"), [(2_500, 2_500), (None, R), (0, 0)])
async def test_reconcile_applied_moves_held_to_spent(
    ledger: Ledger, w1: Writer, ns: str, cost: int | None, spent: int
) -> None:
    """Reconciled applied with cost C (default R): held -> 0, spent += C."""
    admitted = await admit_ok(ledger, w1, req(ns))
    await ledger.interrupt(w1, admitted.call_id, 1, "reset")
    state = await ledger.reconcile(admitted.call_id, applied=True, cost=cost, note="n", by="ann")
    assert (state.stage, state.effect, state.held, state.cost) == (
        "reconciled_applied",
        "applied",
        0,
        spent,
    )
    assert await node(ledger, ns) == (None, 0, spent, 0)
    reconciled = (await ledger.events(admitted.call_id))[-2]
    assert reconciled.kind == "call.reconciled"
    assert (reconciled.data["by"], reconciled.data["cost"]) == ("ann", spent)


@pytest.mark.parametrize("result", [b'{"id": "pi_1"}', b"\xff\x00 not utf-8"])
async def test_a_recovered_result_kept_with_its_decision_is_what_the_key_gets(
    ledger: Ledger, w1: Writer, ns: str, result: bytes
) -> None:
    """Reconciled applied with the result evidence recovered: the key's next admission is
    ``recover`` with that decision, its bytes intact (text or base64); without a result,
    or not applied, it cannot be kept (refused 409 / ReconcileError)."""
    admitted = await admit_ok(ledger, w1, req(ns, key="k1"))
    await ledger.interrupt(w1, admitted.call_id, 1, "reset")
    with pytest.raises(ReconcileError):
        await ledger.reconcile(admitted.call_id, applied=False, note="n", by="x", result=result)
    await ledger.reconcile(admitted.call_id, applied=True, note="n", by="hook", result=result)
    again = await ledger.admit(w1, req(ns, key="k1"))
    assert (again.action, again.call_id) == ("recover", admitted.call_id)
    assert again.recovered is not None and again.recovered.by == "hook"
    assert decode_body(again.recovered.result or "", again.recovered.result_encoding) == result
    plain = await admit_ok(ledger, w1, req(ns, key="k2"))
    await ledger.interrupt(w1, plain.call_id, 1, "reset")
    await ledger.reconcile(plain.call_id, applied=True, note="n", by="ann")
    refused = await ledger.admit(w1, req(ns, key="k2"))
    assert refused.refusal is not None and refused.refusal.type == "reconciled_applied"
    (data,) = [e.data for e in await ledger.events(plain.call_id) if e.kind == "call.reconciled"]
    assert "result" not in data and "result_encoding" not in data  # the older shape


async def test_reconcile_not_applied_releases_the_hold(ledger: Ledger, w1: Writer, ns: str) -> None:
    """Reconciled not applied: held -> 0, nothing spent, and the call may be resent."""
    admitted = await admit_ok(ledger, w1, req(ns, key="k1"))
    await ledger.interrupt(w1, admitted.call_id, 1, "reset")
    state = await ledger.reconcile(admitted.call_id, applied=False, note="n", by="ann")
    assert (state.stage, state.next_operation, state.held) == (
        "reconciled_not_applied",
        "resend",
        0,
    )
    assert await node(ledger, ns) == (None, 0, 0, 0)
    again = await ledger.admit(w1, req(ns, key="k1"))
    assert (again.action, again.attempt) == ("attempt", 2)


def failure(call_id: str, budget: str, status: int = 502) -> list[Event]:
    """An error answer the provider does not declare unprocessed: failed, settled at R."""
    return [
        dataclasses.replace(observed(call_id, status=status), usage=None, usage_problem="missing"),
        BudgetSettled(call=call_id, budget=budget, reserved=R, actual=R),
        CallCompleted(call=call_id, outcome="failed"),
    ]


@pytest.mark.parametrize(("cost", "spent"), [(250, 250), (None, R), (4_000, 4_000)])
async def test_reconcile_applied_of_a_failed_call_sets_its_cost(
    ledger: Ledger, w1: Writer, ns: str, cost: int | None, spent: int
) -> None:
    """A failed call reconciled applied with cost C (default: its charge): spent becomes C."""
    admitted = await admit_ok(ledger, w1, req(ns, key="k1"))
    await ledger.record(w1, admitted.call_id, 1, failure(admitted.call_id, f"{ns}/run"))
    assert await node(ledger, ns) == (None, 0, R, 0)
    state = await ledger.reconcile(admitted.call_id, applied=True, cost=cost, note="n", by="ann")
    assert (state.stage, state.effect, state.cost, state.status) == (
        "reconciled_applied",
        "applied",
        spent,
        502,
    )
    assert await node(ledger, ns) == (None, 0, spent, 0)
    assert await node(ledger, f"{ns}/run") == (None, 0, spent, 0)
    refused = await ledger.admit(w1, req(ns, key="k1"))
    assert refused.refusal is not None and refused.refusal.type == "reconciled_applied"


async def test_reconcile_not_applied_of_a_failed_call_refunds_it_and_frees_its_key(
    ledger: Ledger, w1: Writer, ns: str
) -> None:
    """A failed call reconciled not applied: its charge comes back, its key takes a new attempt."""
    admitted = await admit_ok(ledger, w1, req(ns, key="k1"))
    await ledger.record(w1, admitted.call_id, 1, failure(admitted.call_id, f"{ns}/run"))
    state = await ledger.reconcile(admitted.call_id, applied=False, note="n", by="ann")
    assert (state.stage, state.next_operation, state.cost) == (
        "reconciled_not_applied",
        "resend",
        0,
    )
    assert await node(ledger, ns) == (None, 0, 0, 0)
    kinds = [e.kind for e in await ledger.events(admitted.call_id)]
    assert kinds[-2:] == ["call.reconciled", "budget.corrected"]
    again = await ledger.admit(w1, req(ns, key="k1"))
    assert (again.action, again.call_id, again.attempt) == ("attempt", admitted.call_id, 2)
    await ledger.record(w1, admitted.call_id, 2, completion(admitted.call_id, f"{ns}/run", 30, 2))
    assert (await ledger.call(admitted.call_id)).stage == "completed"
    assert await node(ledger, ns) == (None, 0, 30, 0)


async def test_reconcile_refuses_calls_not_effect_unknown(
    ledger: Ledger, w1: Writer, ns: str
) -> None:
    """Reconciling an in-flight, completed, reconciled or missing call raises ReconcileError."""
    in_flight = await admit_ok(ledger, w1, req(ns))
    done = await admit_ok(ledger, w1, req(ns))
    await ledger.record(w1, done.call_id, 1, completion(done.call_id, f"{ns}/run", 10))
    twice = await admit_ok(ledger, w1, req(ns))
    await ledger.interrupt(w1, twice.call_id, 1, "reset")
    await ledger.reconcile(twice.call_id, applied=False, note="n", by="ann")
    before = len(await all_events(ledger))
    for call_id in (in_flight.call_id, done.call_id, twice.call_id):
        with pytest.raises(ReconcileError) as info:
            await ledger.reconcile(call_id, applied=True, note="n", by="ann")
        assert info.value.call_id == call_id
    with pytest.raises(ReconcileError):
        await ledger.reconcile("call_missing", applied=True, note="n", by="ann")
    assert len(await all_events(ledger)) == before


# -- workers, fencing, sweeping ----------------------------------------------------------------


async def test_sweep_by_lease_expiry_fences_and_interrupts(
    ledger: Ledger, ns: str, lapse: Callable[[float], Awaitable[None]]
) -> None:
    """A worker whose lease ran out is taken over: its calls are interrupted, its writes refused."""
    dead = await register(ledger, f"{ns}-dead", lease_s=0.3)
    call = await admit_ok(ledger, dead, req(ns))
    sweeper = await register(ledger, f"{ns}-sweeper")
    assert await ledger.store.write(sweeper, lambda tx: operations.sweep(tx, sweeper)) == []
    await lapse(0.4)
    swept = await ledger.store.write(sweeper, lambda tx: operations.sweep(tx, sweeper))
    assert swept == [call.call_id]
    state = await ledger.call(call.call_id)
    assert (state.stage, state.held) == ("effect_unknown", R)
    rows = {w.worker: w for w in await ledger.store.workers()}
    assert rows[dead.worker].fenced
    assert not rows[sweeper.worker].fenced
    with pytest.raises(FencedError):
        await ledger.admit(dead, req(ns))
    with pytest.raises(FencedError):
        await ledger.record(dead, call.call_id, 1, completion(call.call_id, f"{ns}/run", 5))
    assert (await ledger.call(call.call_id)).stage == "effect_unknown"


async def test_sweep_of_a_provably_dead_worker_does_not_wait_for_its_lease(
    ledger: Ledger, ns: str
) -> None:
    """A provably dead worker is taken over at once; any write of its generation is refused."""
    dead = await register(ledger, f"{ns}-dead", lease_s=3600)
    calls = [await admit_ok(ledger, dead, req(ns)) for _ in range(3)]
    sweeper = await register(ledger, f"{ns}-sweeper")
    gone = frozenset({dead.worker})
    swept = await ledger.store.write(sweeper, lambda tx: operations.sweep(tx, sweeper, gone))
    assert sorted(swept) == sorted(c.call_id for c in calls)
    for c in calls:
        assert (await ledger.call(c.call_id)).stage == "effect_unknown"
    kinds = [e.kind for e in await all_events(ledger)]
    assert "worker.taken_over" in kinds
    before = len(kinds)
    with pytest.raises(FencedError):
        await ledger.store.write(dead, lambda tx: operations.heartbeat(tx, dead, 30))
    with pytest.raises(FencedError):
        await ledger.set_limit(ns, 1, writer=dead)
    with pytest.raises(FencedError):
        await ledger.interrupt(dead, calls[0].call_id, 1, "x")
    assert len(await all_events(ledger)) == before


async def test_sweep_leaves_live_workers_alone(ledger: Ledger, w1: Writer, ns: str) -> None:
    """A worker with a live lease keeps its in-flight calls through a sweep."""
    call = await admit_ok(ledger, w1, req(ns))
    sweeper = await register(ledger, f"{ns}-sweeper")
    swept = await ledger.store.write(sweeper, lambda tx: operations.sweep(tx, sweeper))
    assert call.call_id not in swept
    assert (await ledger.call(call.call_id)).stage == "in_flight"
    state = await ledger.record(w1, call.call_id, 1, completion(call.call_id, f"{ns}/run", 5))
    assert state.stage == "completed"


async def test_record_of_an_interrupted_attempt_is_refused(
    ledger: Ledger, w1: Writer, ns: str
) -> None:
    """A late outcome for an attempt already interrupted raises FencedError and is not recorded."""
    call = await admit_ok(ledger, w1, req(ns))
    await ledger.interrupt(OPERATOR, call.call_id, 1, "operator")
    before = len(await all_events(ledger))
    with pytest.raises(FencedError):
        await ledger.record(w1, call.call_id, 1, completion(call.call_id, f"{ns}/run", 5))
    assert (await ledger.call(call.call_id)).stage == "effect_unknown"
    assert len(await all_events(ledger)) == before


async def test_reregistered_worker_fences_its_old_generation(ledger: Ledger, ns: str) -> None:
    """Generations strictly increase, and a re-registration fences the previous generation."""
    old = await register(ledger, f"{ns}-w")
    new = await register(ledger, f"{ns}-w")
    assert new.generation > old.generation
    with pytest.raises(FencedError):
        await ledger.admit(old, req(ns))
    await admit_ok(ledger, new, req(ns))


async def test_the_ledger_clock_is_the_one_injected(
    ledger: Ledger, ns: str, clock: ManualClock | None
) -> None:
    """Memory and SQLite time leases and events by the injected clock, not the wall clock."""
    if clock is None:
        pytest.skip("a PostgreSQL ledger keeps the database's clock")
    clock.advance(86_400.0)  # a day ahead of the wall clock
    worker = await register(ledger, f"{ns}-w", lease_s=30.0)
    (row,) = [w for w in await ledger.store.workers() if w.worker == worker.worker]
    assert row.lease_expires == clock() + 30.0
    assert (await all_events(ledger))[-1].at == clock()


def test_a_postgresql_ledger_refuses_an_injected_clock() -> None:
    """PostgreSQL leases run on the database's clock, one for every replica: no clock is taken."""
    with pytest.raises(ConfigError, match="database's clock"):
        open_store("postgresql://nobody@127.0.0.1:1/none", clock=ManualClock())


async def test_lapsed_lease_starts_no_new_dispatch(
    ledger: Ledger, ns: str, lapse: Callable[[float], Awaitable[None]]
) -> None:
    """A worker whose lease lapsed (not yet swept) cannot admit new work."""
    lapsed = await register(ledger, f"{ns}-lapsed", lease_s=0.05)
    await lapse(0.1)
    with pytest.raises(FencedError):
        await ledger.admit(lapsed, req(ns))


# -- cancellation and append-only --------------------------------------------------------------


async def test_cancelled_admissions_do_not_wedge_the_writer(
    ledger: Ledger, w1: Writer, ns: str
) -> None:
    """50 admissions cancelled at once and 50 mid-flight leave a working, consistent ledger."""
    tasks = [asyncio.create_task(ledger.admit(w1, req(ns))) for _ in range(50)]
    for t in tasks:
        t.cancel()
    later = [asyncio.create_task(ledger.admit(w1, req(ns))) for _ in range(50)]
    for _ in range(3):
        await asyncio.sleep(0)
    for t in later:
        t.cancel()
    results = await asyncio.gather(*tasks, *later, return_exceptions=True)
    assert all(isinstance(r, (asyncio.CancelledError, Admitted)) for r in results)
    assert all(isinstance(r, asyncio.CancelledError) for r in results[:50])

    after = await asyncio.wait_for(ledger.admit(w1, req(ns)), timeout=5)
    assert after.action == "admit"
    calls = await ledger.calls(budget=ns)
    assert all(c.stage == "in_flight" and c.reserved == R for c in calls)
    assert await node(ledger, ns) == (None, R * len(calls), 0, 0)
    report = await asyncio.wait_for(verify_ledger(ledger), timeout=5)
    assert report.ok, report.problems


async def test_an_admission_cancelled_as_its_batch_resolves_is_handed_over(
    ledger: Ledger, w1: Writer, ns: str
) -> None:
    """A caller cancelled in the loop step just before the batch holding its admission
    resolves: the admission commits, and the cancelled caller's ``orphaned`` is told it
    (the guard then records the attempt as never sent). It was told nothing: the batch
    found the caller's future cancelled and nobody to tell yet, and the caller adopted the
    job after that, so the call sat in flight, never sent, until a restart marked it
    effect_unknown (seen through the transport with callers under ``asyncio.timeout``)."""
    told: list[Admitted] = []
    task = asyncio.ensure_future(ledger.admit(w1, req(ns), told.append))
    await asyncio.sleep(0)  # the caller queues its admission; the batch's runner is due
    await asyncio.sleep(0)  # the runner yields once to gather more: its batch is due next
    task.cancel()  # the caller's future is cancelled now, its own step runs after the batch
    with pytest.raises(asyncio.CancelledError):
        await task
    await ledger.store.write(w1, lambda tx: None)  # queued behind it: that batch resolved
    calls = await ledger.calls(budget=ns)
    assert [a.call_id for a in told] == [c.call_id for c in calls]


async def test_an_operation_that_cannot_commit_fails_alone(
    ledger: Ledger, w1: Writer, ns: str
) -> None:
    """Ops that fail only at commit (a counter beyond 64 bits) fail alone; batch-mates commit."""
    from effectguard.errors import LedgerUnavailable
    from effectguard.ledger.groupcommit import GroupCommitter

    def poisoned(i: int) -> Callable[[Any], None]:
        # Bypasses the rules on purpose: a write the store itself cannot hold.
        return lambda tx: tx.put_node(BudgetNode(f"{ns}-bad{i}", reserved=2**64))

    gate = threading.Event()
    held = None
    if isinstance(ledger.store.committer, GroupCommitter):  # type: ignore[attr-defined]
        # A writer thread batches what is queued while it works: hold it on one operation
        # so that every submission below lands in one batch.
        held = asyncio.ensure_future(ledger.store.write(w1, lambda tx: gate.wait(10)))
        await asyncio.sleep(0.05)
    good: list[asyncio.Future[Admitted]] = []
    bad: list[asyncio.Future[None]] = []
    for i in range(23):  # submitted interleaved: poisoned ones at 3, 11 and 19
        if i % 8 == 3:
            bad.append(asyncio.ensure_future(ledger.store.write(w1, poisoned(i))))
        else:
            good.append(asyncio.ensure_future(ledger.admit(w1, req(ns))))
    await asyncio.sleep(0)
    gate.set()
    await asyncio.gather(*good, *bad, return_exceptions=True)
    if held is not None:
        await held
    for task in bad:
        assert isinstance(task.exception(), LedgerUnavailable)
    for task in good:
        assert task.result().action == "admit"
    assert await node(ledger, ns) == (None, 20 * R, 0, 0)
    assert not [n for n in await ledger.budgets() if n.path.startswith(f"{ns}-bad")]


async def test_stored_events_are_immutable_values(ledger: Ledger, w1: Writer, ns: str) -> None:
    """Events handed out by the store are frozen; changing one raises."""
    await admit_ok(ledger, w1, req(ns))
    event = (await all_events(ledger))[-1]
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.seq = 99  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.event.call = "other"  # type: ignore[attr-defined]


async def test_events_table_rejects_update_and_delete(
    ledger: Ledger, w1: Writer, ns: str, store_kind: str, ledger_url: str
) -> None:
    """The database itself aborts any UPDATE, DELETE (or TRUNCATE) of an event."""
    await admit_ok(ledger, w1, req(ns))
    before = await all_events(ledger)
    if store_kind == "memory":
        pytest.skip("the memory store has no SQL table; its events are frozen values")
    if store_kind == "sqlite":
        conn = sqlite3.connect(ledger_url, isolation_level=None)
        try:
            for sql in (
                "UPDATE events SET data = '{}' WHERE seq = 1",
                "DELETE FROM events WHERE seq = 1",
                "DELETE FROM events",
            ):
                with pytest.raises(sqlite3.IntegrityError, match="append-only"):
                    conn.execute(sql)
        finally:
            conn.close()
    else:
        import psycopg

        with psycopg.connect(_pg_dsn(), autocommit=True) as pg:
            pg.execute(f"SET search_path TO {ns}")
            for sql in (
                "UPDATE events SET data = '{}' WHERE seq = 1",
                "DELETE FROM events WHERE seq = 1",
                "TRUNCATE events",
            ):
                with pytest.raises(psycopg.Error, match="append-only"):
                    pg.execute(sql)
    assert await all_events(ledger) == before


async def test_refused_state_is_not_found_by_key(ledger: Ledger, w1: Writer, ns: str) -> None:
    """Listing by stage finds refused and admitted calls separately."""
    await ledger.set_limit(ns, 0)
    refused = await ledger.admit(w1, req(ns, key="k1"))
    await ledger.set_limit(ns, None)
    admitted = await admit_ok(ledger, w1, req(ns, key="k1"))
    in_root = {c.call_id: c for c in await ledger.calls(budget=ns)}
    assert set(in_root) == {refused.call_id, admitted.call_id}
    assert [c.call_id for c in await ledger.calls(stage="refused", budget=ns)] == [refused.call_id]
    state: WorkState = in_root[admitted.call_id]
    assert state.stage == "in_flight"


async def test_calls_are_listed_by_provider_and_creation_time(
    ledger: Ledger, w1: Writer, ns: str, lapse: Callable[[float], Awaitable[None]]
) -> None:
    """Listing by provider and by creation time (at or after a moment) selects in the
    store, resolved and unresolved calls alike (SQLite lists calls made in the same
    millisecond in any order: compared as sets)."""
    first = await admit_ok(ledger, w1, req(ns))
    await ledger.record(w1, first.call_id, 1, completion(first.call_id, f"{ns}/run", 5))
    await lapse(0.05)
    moment = await ledger.store.clock_now()
    other = await admit_ok(ledger, w1, dataclasses.replace(req(ns), provider="anthropic"))
    last = await admit_ok(ledger, w1, req(ns))
    await ledger.record(w1, last.call_id, 1, completion(last.call_id, f"{ns}/run", 6))

    def ids(calls: list[WorkState]) -> set[str]:
        return {c.call_id for c in calls}

    assert ids(await ledger.calls(budget=ns, provider="openai")) == {last.call_id, first.call_id}
    assert ids(await ledger.calls(budget=ns, provider="anthropic")) == {other.call_id}
    assert ids(await ledger.calls(budget=ns, since=moment)) == {last.call_id, other.call_id}
    recent = await ledger.calls(budget=ns, provider="openai", since=moment, limit=5)
    assert ids(recent) == {last.call_id} and recent[0].cost == 6


async def _spend_ledger(ledger: Ledger, w1: Writer, ns: str) -> dict[str, str]:
    """Calls of two providers and three models in every stage that carries money or none:
    completed, failed, effect unknown (held), reconciled applied at a cost and not
    applied, refused and in flight. Their call ids by name."""
    made: dict[str, str] = {}

    async def call(name: str, provider: str = "openai", model: str | None = "gpt-x") -> str:
        request = dataclasses.replace(
            req(ns, request_hash=f"hash-{name}"), provider=provider, model=model
        )
        admitted = await admit_ok(ledger, w1, request)
        made[name] = admitted.call_id
        return admitted.call_id

    done = await call("completed")
    await ledger.record(w1, done, 1, completion(done, f"{ns}/run", 5))
    other = await call("other provider", provider="anthropic", model="claude")
    await ledger.record(w1, other, 1, completion(other, f"{ns}/run", 7))
    failed = await call("failed", model="gpt-y")
    await ledger.record(w1, failed, 1, failure(failed, f"{ns}/run"))
    unknown = await call("unknown")
    await ledger.interrupt(w1, unknown, 1, "read timeout")
    applied = await call("reconciled applied", model="gpt-y")
    await ledger.interrupt(w1, applied, 1, "reset")
    await ledger.reconcile(applied, applied=True, cost=2_500, note="n", by="ann")
    not_applied = await call("reconciled not applied", provider="anthropic", model=None)
    await ledger.interrupt(w1, not_applied, 1, "reset")
    await ledger.reconcile(not_applied, applied=False, note="n", by="ann")
    await call("in flight", provider="anthropic", model=None)
    await ledger.set_limit(ns, 0)
    refused = await ledger.admit(w1, req(ns, request_hash="hash-refused"))
    assert refused.refusal is not None
    made["refused"] = refused.call_id
    await ledger.set_limit(ns, None)
    return made


async def test_call_spend_is_each_calls_money_as_its_state_has_it(
    ledger: Ledger, w1: Writer, ns: str
) -> None:
    """``call_spend`` gives, for the calls ``calls`` lists (by creation time and limit),
    exactly the creation time, provider, model, cost and hold their states have, newest
    first, without folding a call: the spend chart's table is the same from either."""
    await _spend_ledger(ledger, w1, ns)
    now = await ledger.store.clock_now()
    since = now - 3600
    spends = await ledger.call_spend(since, 100)
    states = await ledger.calls(limit=100, since=since)
    assert len(spends) == len(states) == 8
    # Calls made in the same instant may list in either order: compared as multisets.
    assert collections.Counter(spends) == collections.Counter(map(CallSpend.of, states))
    assert [s.created_at for s in spends] == sorted((s.created_at for s in spends), reverse=True)
    table = spend_by_day(spends, now=now, days=3)
    assert table == spend_by_day(states, now=now, days=3)
    today = {name: row[-1] for name, row in table.spent.items()}
    assert today == {
        "openai/gpt-x": 5,
        "openai/gpt-y": R + 2_500,
        "anthropic/claude": 7,
    }
    assert table.held == {"openai/gpt-x": R, "openai/gpt-y": 0, "anthropic/claude": 0}
    assert table.calls == {"openai/gpt-x": 2, "openai/gpt-y": 2, "anthropic/claude": 1}
    assert await ledger.call_spend(now + 1, 100) == []
    newest = await ledger.call_spend(since, 3)
    assert len(newest) == 3 and min(s.created_at for s in newest) >= spends[3].created_at


async def test_spend_sums_are_the_call_spend_window_summed_by_day_provider_and_model(
    ledger: Ledger, w1: Writer, ns: str
) -> None:
    """``spend_sums`` is the database's sum of exactly the window ``call_spend`` reads (per
    UTC day, provider and model, with that window's call count and oldest call), so the
    spend page folds no call yet shows the same table as folding each one."""
    await _spend_ledger(ledger, w1, ns)
    now = await ledger.store.clock_now()
    since = now - 3600
    sums = await ledger.spend_sums(since, 100)
    spends = await ledger.call_spend(since, 100)
    assert sums == sum_spend(spends)
    assert sums.calls == 8 and sums.oldest == min(s.created_at for s in spends)
    states = await ledger.calls(limit=100, since=since)
    assert spend_table(sums.days, now=now, days=3) == spend_by_day(states, now=now, days=3)
    assert await ledger.spend_sums(now + 1, 100) == SpendSums()
    newest = await ledger.call_spend(since, 3)
    assert await ledger.spend_sums(since, 3) == sum_spend(newest)


async def test_unknown_after_pages_through_the_unknown_calls_oldest_first(
    ledger: Ledger, w1: Writer, ns: str
) -> None:
    """``unknown_after`` lists only ``effect_unknown`` calls, by creation time then call
    id, and paging with the last call of each page as the cursor reads each exactly once,
    calls admitted in one batch (one instant) included."""
    admitted = await asyncio.gather(
        *(admit_ok(ledger, w1, req(ns, request_hash=f"hash-u{n}")) for n in range(7))
    )
    for a in admitted:
        await ledger.interrupt(w1, a.call_id, a.attempt, "reset")
    await admit_ok(ledger, w1, req(ns, request_hash="hash-in-flight"))  # not unknown
    every = await ledger.unknown_after(None, 100)
    assert sorted(s.call_id for s in every) == sorted(a.call_id for a in admitted)
    assert {s.stage for s in every} == {"effect_unknown"}
    assert [s.created_at for s in every] == sorted(s.created_at for s in every)
    paged: list[WorkState] = []
    cursor = None
    while page := await ledger.unknown_after(cursor, 3):
        assert len(page) <= 3
        paged += page
        cursor = (page[-1].created_at, page[-1].call_id)
    assert [s.call_id for s in paged] == [s.call_id for s in every]


async def test_budget_nodes_of_a_depth_are_the_shallow_ones_read_alone(
    ledger: Ledger, w1: Writer, ns: str
) -> None:
    """``budget_nodes(depth)`` gives exactly the nodes whose paths have fewer than
    ``depth`` ``/``: a reader of the roots (metrics) never reads per-user nodes."""
    for user in ("u1", "u2"):
        await admit_ok(ledger, w1, req(ns, request_hash=f"hash-{user}", budget=f"{ns}/{user}/run"))
    every = await ledger.store.budget_nodes()
    assert {n.path.count("/") for n in every} >= {0, 1, 2}
    for depth in (1, 2, 3):
        shallow = await ledger.store.budget_nodes(depth)
        assert shallow == [n for n in every if n.path.count("/") < depth]
    roots = await ledger.budgets(depth=1)
    assert roots and all("/" not in n.path for n in roots)
    assert roots == [n for n in await ledger.budgets() if "/" not in n.path]


async def test_the_policyless_read_ranks_and_sums_as_a_read_of_every_node_would(
    ledger: Ledger, w1: Writer, ns: str
) -> None:
    """``policyless(depth, limit)`` gives the first ``limit`` nodes no policy names (money
    committed, most first, then path) and all of them counted and summed, exactly as a
    read of every node ranks them: the metrics read ``limit`` nodes however many
    clients made. Nodes with a policy (a daily one here) are never among them."""
    await ledger.change_policy(f"{ns}p", {"limit": 100 * R, "period": "day"})
    charges = {f"{ns}p/u": 9, f"{ns}a": 3, f"{ns}b": 1, f"{ns}c": 3, f"{ns}d/u": 5, f"{ns}e": 2}
    for n, (path, units) in enumerate(charges.items()):
        await admit_ok(ledger, w1, req(ns, request_hash=f"h{n}", reserve=units * R, budget=path))
    policies = await ledger.policies()
    every = [n for n in await ledger.store.budget_nodes() if n.path not in policies]
    for depth in (1, 2):
        nodes = [n for n in every if n.path.count("/") < depth]
        assert len(nodes) == (5 if depth == 1 else 7)
        for limit in (0, 1, 2, 3, 10):
            read = await ledger.store.policyless(depth, limit)
            ranked = sorted(nodes, key=lambda n: (-n.committed, n.path))
            assert list(read.top) == ranked[:limit]
            assert read.count == len(nodes)
            assert read.total.reserved == sum(n.reserved for n in nodes)
            assert (read.total.spent, read.total.held) == (0, 0)


async def every_node_tree(
    ledger: Ledger, under: str | None, depth: int, limit: int
) -> tuple[list[BudgetNode], int]:
    """The budget page's tree as it was read before ``Ledger.budget_tree``: every node of
    the levels, the empty nodes on the way to a declared one, in the tree's order."""
    nodes = await ledger.budgets(depth=depth, under=under)
    shown, out = {n.path for n in nodes}, list(nodes)
    for path in await ledger.policies():
        if under is not None and not is_under(path, under):
            continue
        parts = path.split("/")
        for i in range(min(len(parts), depth)):
            ancestor = "/".join(parts[: i + 1])
            if ancestor not in shown and (under is None or is_under(ancestor, under)):
                shown.add(ancestor)
                out.append(BudgetNode(ancestor))
    ordered = sorted(out, key=lambda n: n.path.split("/"))
    return ordered[:limit], len(ordered)


async def test_the_budget_tree_reads_a_page_and_shows_what_a_read_of_every_node_would(
    ledger: Ledger, w1: Writer, ns: str
) -> None:
    """``Ledger.budget_tree`` (the operator page) reads ``limit`` of the nodes clients made,
    and gives the very nodes and count a read of every node gives: the tree's order (``a``,
    ``a/b``, then ``a-c``: segment by segment, not byte by byte), periods, the empty
    nodes on the way to a declared node (charged or not, on the page or past it)."""
    charged = [f"{ns}/a", f"{ns}/a-b", f"{ns}/a/b", f"{ns}/a.b/c", f"{ns}-x/lim", f"{ns}.y",
               f"{ns}0/z", f"{ns}/p/q"]  # fmt: skip
    for n, path in enumerate(charged):
        await admit_ok(ledger, w1, req(ns, request_hash=f"h{n}", budget=path))
    await ledger.change_policy(f"{ns}-x/lim", {"limit": 100 * R, "period": "day"})
    await ledger.change_policy(f"{ns}/p/q/r", {"limit": R})  # declared, never charged
    await ledger.change_policy(f"{ns}9/never", {"limit": R})  # its ancestors have no row
    for under in (None, ns, f"{ns}/a", f"{ns}9", f"{ns}/p", f"{ns}-nothing"):
        base = 0 if under is None else under.count("/") + 1
        for depth in (base + 1, base + 2, base + 3):
            for limit in (1, 2, 3, 100):
                want = await every_node_tree(ledger, under, depth, limit)
                assert await ledger.budget_tree(under, depth, limit) == want, (under, depth)
    page, count = await ledger.store.policyless_page(2, ns, 100)
    assert [n.path for n in page] == [ns, f"{ns}/a", f"{ns}/a-b", f"{ns}/a.b", f"{ns}/p"]
    assert count == 5 and (await ledger.store.policyless_page(2, ns, 2))[1] == 5
    rows = await ledger.store.budget_rows([f"{ns}9", f"{ns}/a", f"{ns}/a"])
    assert [(n.path, n.period) for n in rows] == [(f"{ns}/a", "total")]


class WriteBetweenReads:
    """A store wrapper that lets one write commit between verify's event scan and its counter read.

    It stands in for a guard writing while an operator runs ``effectguard verify`` (no patching:
    ``Ledger`` takes any store).
    """

    def __init__(self, ledger: Ledger, write: Callable[[], Awaitable[object]]) -> None:
        self._store = ledger.store
        self._write = write
        self.pending: asyncio.Future[object] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def budget_nodes(self) -> list[BudgetNode]:
        self.pending = asyncio.ensure_future(self._write())
        # A verify that holds a read snapshot (or lock) may keep this write out: that is fine.
        await asyncio.wait([self.pending], timeout=2)
        return await self._store.budget_nodes()


async def test_verify_of_a_live_ledger_reports_no_false_corruption(
    ledger: Ledger, w1: Writer, ns: str
) -> None:
    """verify while the guard keeps writing reports a healthy ledger as healthy."""
    await admit_ok(ledger, w1, req(ns))
    store = WriteBetweenReads(ledger, lambda: ledger.admit(w1, req(ns)))
    report = await verify_ledger(Ledger(store))
    assert store.pending is not None
    await asyncio.wait_for(store.pending, timeout=5)
    assert report.ok, report.problems


async def test_verify_pages_through_the_calls_rows_and_kept_states(
    ledger: Ledger, w1: Writer, ns: str
) -> None:
    """verify reads the calls' rows and kept states a page at a time, in the store's order
    of call ids: pages of one and of two give every call once, and verify with one call a
    page checks and counts them all."""
    ids = [(await admit_ok(ledger, w1, req(ns, key=f"k{n}"))).call_id for n in range(5)]
    for limit in (1, 2):
        rows: list[str] = []
        while page := await ledger.store.call_columns(rows[-1] if rows else None, limit):
            assert 0 < len(page) <= limit
            rows += [str(row[0]) for row in page]
        kept: list[str] = []
        while states := await ledger.store.kept_states(kept[-1] if kept else None, limit):
            assert 0 < len(states) <= limit
            kept += [state.call_id for state in states]
        # In flight, so every store keeps each one's state in its row.
        assert sorted(rows) == sorted(kept) == sorted(ids), (rows, kept)
    report = await verify_ledger(ledger, page=1)
    assert report.ok, report.problems
    assert report.calls == len(ids)


async def test_a_caller_whose_loop_closed_does_not_wedge_the_writer(
    ledger: Ledger, w1: Writer, ns: str
) -> None:
    """A cancelled caller whose event loop is gone does not stop other callers' writes."""

    def caller_on_another_loop() -> None:
        async def give_up_early() -> None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ledger.admit(w1, req(ns)), timeout=0.001)

        asyncio.run(give_up_early())  # cancels its admission, then closes its loop

    thread = threading.Thread(target=caller_on_another_loop)
    thread.start()
    thread.join()
    mine = asyncio.create_task(ledger.admit(w1, req(ns)))
    assert (await asyncio.wait_for(mine, timeout=3)).action == "admit"
    after = await asyncio.wait_for(ledger.admit(w1, req(ns)), timeout=3)
    assert after.action == "admit"


# -- the body store (rules/bodyref): by-reference request bodies, in chunks -------------


def spool(tmp_path: Path, data: bytes, name: str = "body.bin") -> SpooledBody:
    """``data`` in a file, as the front door spools an upload."""
    path = tmp_path / name
    path.write_bytes(data)
    return SpooledBody(str(path), len(data), hashlib.sha256(data).hexdigest())


def ref_req(ns: str, spooled: SpooledBody | None, **fields: object) -> AdmitRequest:
    """An admission request whose body is stored by reference (``fields`` replace any)."""
    fields.setdefault("body", None if spooled is None else spooled.sha256)
    fields.setdefault("body_encoding", REF_ENCODING)
    return dataclasses.replace(req(ns), spool=spooled, **fields)  # type: ignore[arg-type]


async def read_back(ledger: Ledger, call_id: str) -> tuple[int, bytes]:
    out = io.BytesIO()
    written = await ledger.copy_body(call_id, out)
    return written, out.getvalue()


async def test_a_multi_chunk_body_round_trips(
    ledger: Ledger, w1: Writer, ns: str, tmp_path: Path
) -> None:
    """A 600 KiB body is stored in chunks with its manifest and read back byte for byte."""
    data = os.urandom(600 * 1024)
    admitted = await admit_ok(ledger, w1, ref_req(ns, spool(tmp_path, data)))
    assert await read_back(ledger, admitted.call_id) == (len(data), data)
    assert await ledger.body_size(admitted.call_id) == len(data)
    chunks = [c for c in await ledger.store.body_chunks() if c[0] == admitted.call_id]
    assert [(seq, size) for _, seq, size in chunks] == [
        (0, CHUNK_BYTES),
        (1, CHUNK_BYTES),
        (2, len(data) - 2 * CHUNK_BYTES),
    ]
    manifest = (await ledger.events(admitted.call_id))[0]
    assert manifest.data["body"] == hashlib.sha256(data).hexdigest()
    assert manifest.data["body_encoding"] == REF_ENCODING


async def test_a_body_of_whole_chunks_has_no_empty_tail(
    ledger: Ledger, w1: Writer, ns: str, tmp_path: Path
) -> None:
    """A body of exactly two chunks is two rows, not two and an empty one."""
    data = os.urandom(2 * CHUNK_BYTES)
    admitted = await admit_ok(ledger, w1, ref_req(ns, spool(tmp_path, data)))
    assert await read_back(ledger, admitted.call_id) == (len(data), data)
    assert len([c for c in await ledger.store.body_chunks() if c[0] == admitted.call_id]) == 2


async def test_the_empty_body_is_stored_as_one_empty_chunk(
    ledger: Ledger, w1: Writer, ns: str, tmp_path: Path
) -> None:
    """An empty body round trips, and is found stored (one empty chunk), unlike no body."""
    admitted = await admit_ok(ledger, w1, ref_req(ns, spool(tmp_path, b"")))
    assert await read_back(ledger, admitted.call_id) == (0, b"")
    assert await ledger.body_size(admitted.call_id) == 0
    assert [c for c in await ledger.store.body_chunks() if c[0] == admitted.call_id] == [
        (admitted.call_id, 0, 0)
    ]


async def test_a_call_without_a_stored_body_copies_nothing(
    ledger: Ledger, w1: Writer, ns: str
) -> None:
    """An inline body (and an unknown call) has no stored body: copy_body writes 0 bytes."""
    admitted = await admit_ok(ledger, w1, req(ns))
    assert await read_back(ledger, admitted.call_id) == (0, b"")
    assert await read_back(ledger, "call_" + "0" * 32) == (0, b"")
    assert await ledger.body_size(admitted.call_id) is None


@pytest.mark.parametrize("lie", ["sha256", "size"])
async def test_a_file_that_is_not_the_declared_body_is_refused_and_nothing_is_written(
    ledger: Ledger, w1: Writer, ns: str, tmp_path: Path, lie: str
) -> None:
    """The file's bytes must hash to the manifest's digest and have its size: otherwise the
    admission fails with BodyMismatch and leaves no call, no event and no chunk."""
    data = os.urandom(CHUNK_BYTES + 10)
    good = spool(tmp_path, data)
    other = hashlib.sha256(b"other").hexdigest()
    bad = (
        SpooledBody(good.path, good.size, other)
        if lie == "sha256"
        else SpooledBody(good.path, good.size + 1, good.sha256)
    )
    before = await ledger.store.events_after(0, 1 << 30)
    with pytest.raises(BodyMismatch, match="nothing is stored"):
        await ledger.admit(w1, ref_req(ns, bad))
    assert await ledger.store.body_chunks() == []
    assert await ledger.store.events_after(0, 1 << 30) == before
    assert await ledger.calls() == []


async def test_a_failed_transaction_leaves_no_chunks(
    ledger: Ledger, w1: Writer, ns: str, tmp_path: Path
) -> None:
    """An operation that stores a body and then fails keeps none of its chunks, in a batch
    of one and beside operations that commit."""
    body = spool(tmp_path, os.urandom(CHUNK_BYTES * 2 + 1))

    def store_then_fail(tx: Tx) -> None:
        tx.put_body("call_" + "1" * 32, body)
        raise RuntimeError("the operation fails after storing its body")

    with pytest.raises(RuntimeError):
        await ledger.store.write(w1, store_then_fail)
    assert await ledger.store.body_chunks() == []
    others = [admit_ok(ledger, w1, req(ns, request_hash=f"h{i}")) for i in range(3)]
    results = await asyncio.gather(
        ledger.store.write(w1, store_then_fail), *others, return_exceptions=True
    )
    assert isinstance(results[0], RuntimeError)
    assert await ledger.store.body_chunks() == []


async def test_a_refused_admission_stores_no_body(
    ledger: Ledger, w1: Writer, ns: str, tmp_path: Path
) -> None:
    """A call refused at admission keeps its manifest (with the digest) but not the bytes:
    a refused call is never sent, so nothing will ever read them back."""
    await ledger.set_limit(ns, R - 1)
    refused = await ledger.admit(w1, ref_req(ns, spool(tmp_path, os.urandom(1000))))
    assert refused.action == "refuse"
    assert await ledger.store.body_chunks() == []
    assert (await ledger.events(refused.call_id))[0].data["body_encoding"] == REF_ENCODING


async def test_a_manifest_and_file_that_disagree_are_a_programming_error(
    ledger: Ledger, w1: Writer, ns: str, tmp_path: Path
) -> None:
    """A ref manifest must carry its file, named by its digest; an inline one none."""
    body = spool(tmp_path, b"x" * 100)
    with pytest.raises(ValueError, match="sha256"):
        await ledger.admit(w1, ref_req(ns, body, body="0" * 64))
    with pytest.raises(ValueError, match="spooled file"):
        await ledger.admit(w1, ref_req(ns, None, body=body.sha256))
    with pytest.raises(ValueError, match="spooled file"):
        await ledger.admit(w1, ref_req(ns, body, body="{}", body_encoding="utf8"))
    assert await ledger.store.body_chunks() == []


async def test_storing_a_body_never_runs_on_the_event_loop_thread(
    ledger: Ledger,
    w1: Writer,
    ns: str,
    tmp_path: Path,
    store_kind: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Copying an upload's chunks (about 30 ms for 10 MiB on SQLite) happens off the loop,
    so other requests are served meanwhile, alone in its batch or among others."""
    if store_kind == "memory":
        pytest.skip("the memory store keeps the body in memory; it has no copy to move")
    readers: list[int] = []
    real = bodystore.chunks

    def chunks(call_id: str, body: SpooledBody) -> Iterator[tuple[int, bytes]]:
        readers.append(threading.get_ident())
        return real(call_id, body)

    monkeypatch.setattr(bodystore, "chunks", chunks)
    data = os.urandom(300 * 1024)
    await admit_ok(ledger, w1, ref_req(ns, spool(tmp_path, data)))
    crowd = [ledger.admit(w1, req(ns)) for _ in range(5)]
    together = ledger.admit(w1, ref_req(ns, spool(tmp_path, data, "b.bin")))
    await asyncio.gather(*crowd, together)
    assert len(readers) == 2
    assert threading.get_ident() not in readers


async def test_an_upload_alone_in_its_batch_commits_off_the_event_loop_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite commits a lone small operation inline (a thread hop would only add
    latency), but the commit of a lone upload fsyncs its pages: that leaves the loop."""
    from effectguard.ledger.sqlitesession import SqliteSession

    committers: list[int] = []
    real = SqliteSession.commit

    def commit(self: SqliteSession) -> None:
        committers.append(threading.get_ident())
        real(self)

    monkeypatch.setattr(SqliteSession, "commit", commit)
    async with Ledger.open(str(tmp_path / "ledger.db")) as ledger:
        writer = await register(ledger, "w-upload")
        ns = "t" + uuid.uuid4().hex[:12]
        committers.clear()
        await admit_ok(ledger, writer, req(ns))
        await admit_ok(ledger, writer, ref_req(ns, spool(tmp_path, os.urandom(300 * 1024))))
    loop_thread = threading.get_ident()
    assert committers[0] == loop_thread, "a lone small admission commits inline"
    assert committers[1] != loop_thread, "a lone upload's commit leaves the loop"


def _token_digest(text: str) -> str:
    """The SHA-256 of a made-up session token, as the operator page stores it."""
    return hashlib.sha256(text.encode()).hexdigest()


async def test_an_ended_session_reads_as_ended_and_writes_no_event(ledger: Ledger, ns: str) -> None:
    """A logout's record: its digest reads as ended (another digest does not), ending it
    twice is harmless, and nothing enters the hash chain."""
    ended, other = _token_digest(f"{ns}-ended"), _token_digest(f"{ns}-other")
    before = await ledger.store.events_after(0, 1000)
    now = await ledger.store.clock_now()
    assert not await ledger.session_ended(ended)
    await ledger.end_session(ended, now + 3600)
    await ledger.end_session(ended, now + 3600)
    assert await ledger.session_ended(ended)
    assert not await ledger.session_ended(other)
    assert await ledger.store.events_after(0, 1000) == before


async def test_ending_a_session_forgets_the_ones_long_expired(ledger: Ledger, ns: str) -> None:
    """Each logout deletes the ended sessions whose token expired more than
    KEPT_PAST_EXPIRY_S ago (by the ledger's clock); one that expired lately is kept, and
    the session being ended is never deleted by its own logout."""
    old, late = _token_digest(f"{ns}-old"), _token_digest(f"{ns}-late")
    now = await ledger.store.clock_now()
    await ledger.end_session(old, now - endedsessions.KEPT_PAST_EXPIRY_S - 600)
    assert await ledger.session_ended(old)
    await ledger.end_session(late, now - 60)
    assert not await ledger.session_ended(old)
    assert await ledger.session_ended(late)


async def test_a_failed_operation_ends_no_session_and_deletes_none(ledger: Ledger, ns: str) -> None:
    """An operation that ends a session and then fails leaves the table as it was: the new
    row is not kept and the expired row its logout deleted is back."""
    old, new = _token_digest(f"{ns}-old"), _token_digest(f"{ns}-new")
    now = await ledger.store.clock_now()
    await ledger.end_session(old, now - endedsessions.KEPT_PAST_EXPIRY_S - 600)

    def end_then_fail(tx: Tx) -> None:
        endedsessions.end_session(tx, new, now + 3600)
        raise RuntimeError("the operation fails after ending the session")

    with pytest.raises(RuntimeError):
        await ledger.store.write(OPERATOR, end_then_fail)
    assert not await ledger.session_ended(new)
    assert await ledger.session_ended(old)


@pytest.mark.parametrize(
    "digest",
    ["", "session-token", "A" * 64, "0" * 63, "g" * 64],
    ids=["empty", "a-token", "upper-case", "short", "not-hex"],
)
async def test_only_a_token_digest_is_stored(ledger: Ledger, digest: str) -> None:
    """end_session refuses anything but a SHA-256 in lowercase hex, so no token (or other
    text) reaches the ledger by mistake."""
    with pytest.raises(ValueError, match="SHA-256"):
        await ledger.end_session(digest, 0.0)
