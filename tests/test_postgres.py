"""The PostgreSQL ledger: one database, many replicas, the same guarantees as SQLite.

Runs against the real server at ``EFFECTGUARD_TEST_PG_DSN``; each test gets its
own schema (``?schema=…``), dropped afterwards. The replica tests start real
``effectguard serve`` processes against the fake provider.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from admitkit import admit_request
from pgkit import DSN, NEEDS_PG, pg_url

from effectguard.errors import FencedError, LedgerCorrupt
from effectguard.ledger import Ledger, operations
from effectguard.ledger.base import OPERATOR, Writer
from effectguard.ops.verify import verify_ledger
from effectguard.providers import load_providers
from effectguard.rules.events import (
    AttemptInterrupted,
    AttemptObserved,
    WorkerTakenOver,
    canonical_json,
)
from effectguard.rules.usage import estimate
from effectguard.testing import Proxy, fake_provider, start_proxy

_ = (pg_url,)  # fixtures

pytestmark = NEEDS_PG

GPT = "gpt-4o-mini"
CHAT = {"model": GPT, "max_tokens": 50, "messages": [{"role": "user", "content": "Say hello"}]}
RECOVERY = "[server]\nlease_s = 2\nheartbeat_s = 0.5\nsweep_s = 0.5\n"


def _reservation() -> int:
    price = load_providers([])["openai"].price_for(GPT)
    assert price is not None
    return estimate(price, CHAT)


def _admit_request(key: str | None, reserve: int, budget: str = "fleet") -> operations.AdmitRequest:
    return admit_request(
        budget, budget_root=budget, request_hash="h" * 64, model=GPT, key=key, reserve=reserve
    )


async def _register(ledger: Ledger, name: str, lease_s: float = 30.0) -> Writer:
    return await ledger.store.write(
        Writer(name, 0),
        lambda tx: operations.register_worker(tx, worker=name, host="h", pid=1, lease_s=lease_s),
    )


async def _eventually(check: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


# -- the store across replicas, in one process ---------------------------------------


async def test_now_is_the_database_clock(pg_url: str) -> None:
    """Leases are timed by the database's clock: the session's now() is the server's."""
    import psycopg

    from effectguard.ledger.postgres import PostgresSession, Target

    session = PostgresSession(Target.parse(pg_url))
    try:
        session.begin()
        ours = session.now()
        session.commit()
        with psycopg.connect(DSN, autocommit=True) as conn:
            row = conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
        assert row is not None
        assert abs(ours - row[0]) < 1.0
    finally:
        session.close()
    async with Ledger.open(pg_url) as ledger:
        await _register(ledger, "w", lease_s=30.0)
        (row_w,) = await ledger.store.workers()
        assert abs(row_w.lease_expires - (row[0] + 30.0)) < 5.0


async def test_two_stores_admit_atomically(pg_url: str) -> None:
    """Two replicas' stores racing on one budget and one key: no overshoot, one key owner."""
    reserve = 1_000
    async with Ledger.open(pg_url) as a, Ledger.open(pg_url) as b:
        await a.set_limit("fleet", 7 * reserve)
        wa, wb = await _register(a, "a"), await _register(b, "b")
        results = await asyncio.gather(
            *(
                (a if i % 2 else b).admit(wa if i % 2 else wb, _admit_request(None, reserve))
                for i in range(60)
            )
        )
        assert sum(r.action == "admit" for r in results) == 7
        keyed = await asyncio.gather(
            *(
                (a if i % 2 else b).admit(wa if i % 2 else wb, _admit_request("k", 1, "keys"))
                for i in range(40)
            )
        )
        assert sum(r.action == "admit" for r in keyed) == 1
        assert {r.refusal.type for r in keyed if r.refusal} == {"in_progress"}
        (node,) = [n for n in await a.budgets() if n.path == "fleet"]
        assert node.reserved == 7 * reserve and node.limit == 7 * reserve
        report = await verify_ledger(b)
        assert report.ok, report.problems


async def test_fenced_worker_is_refused_by_the_store(pg_url: str) -> None:
    """A worker taken over by another replica's sweeper cannot write through its own store."""
    async with Ledger.open(pg_url) as a, Ledger.open(pg_url) as b:
        old = await _register(a, "old", lease_s=0.0)
        with pytest.raises(FencedError, match="lease lapsed"):
            await a.admit(old, _admit_request(None, 10))
        sweeper = await _register(b, "sweeper")
        await b.store.write(sweeper, lambda tx: operations.sweep(tx, sweeper))
        with pytest.raises(FencedError, match="fenced"):
            await a.store.write(old, lambda tx: operations.heartbeat(tx, old, 10.0))


async def test_events_are_append_only(pg_url: str) -> None:
    """The database itself refuses UPDATE and DELETE of events."""
    import psycopg

    async with Ledger.open(pg_url) as ledger:
        await ledger.set_limit("x", 5)
    schema = pg_url.rsplit("schema=", 1)[1]
    with psycopg.connect(DSN, autocommit=True) as conn:
        for statement in ("UPDATE {}.events SET kind = 'x'", "DELETE FROM {}.events"):
            with pytest.raises(psycopg.errors.RaiseException, match="append-only"):
                conn.execute(statement.format(schema))


async def test_concurrent_migrations_apply_once(pg_url: str) -> None:
    """Replicas starting at once migrate the schema exactly once."""
    from effectguard.ledger.pgschema import MIGRATIONS
    from effectguard.ledger.postgres import migrate

    applied = await asyncio.gather(*(asyncio.to_thread(migrate, pg_url) for _ in range(4)))
    assert sorted(len(a) for a in applied) == [0, 0, 0, len(MIGRATIONS)]
    assert migrate(pg_url) == []


def _run_op(session: Any, op: Callable[[Any], object]) -> BaseException | None:
    """One operation the way the group committer runs it: savepoint, op, release."""
    session.savepoint()
    try:
        op(session)
    except Exception as exc:
        session.rollback_to()
        session.release()
        return exc
    session.release()
    return None


def _raise_after(*steps: Callable[[Any], object]) -> Callable[[Any], object]:
    def op(tx: Any) -> object:
        for step in steps:
            step(tx)
        raise RuntimeError("the operation fails after writing")

    return op


async def test_failed_operation_undoes_only_its_own_writes(pg_url: str) -> None:
    """In one batch, an operation that fails leaves no trace; the others commit in order."""
    from effectguard.ledger.postgres import PostgresSession, Target

    def limit(path: str, nanos: int) -> Callable[[Any], object]:
        return lambda tx: operations.set_limit(tx, OPERATOR, path, nanos)

    session = PostgresSession(Target.parse(pg_url))
    try:
        session.begin()
        assert _run_op(session, limit("a", 5)) is None
        # Writes sent early (a scan must see them), then the operation fails.
        early = _raise_after(limit("b", 7), lambda tx: tx.in_flight_of(["nobody"]))
        assert isinstance(_run_op(session, early), RuntimeError)
        # Writes still buffered, then the operation fails.
        assert isinstance(_run_op(session, _raise_after(limit("c", 9))), RuntimeError)
        assert set(session.get_policies(["a", "b", "c"])) == {"a"}
        assert _run_op(session, limit("d", 1)) is None
        session.commit()
    finally:
        session.close()
    async with Ledger.open(pg_url) as ledger:
        assert [(n.path, n.limit) for n in await ledger.budgets()] == [("a", 5), ("d", 1)]
        assert [e.seq for e in await ledger.store.events_after(0, 100)] == [1, 2]
        report = await verify_ledger(ledger)
        assert report.ok, report.problems


async def test_a_rejected_write_abandons_the_whole_batch(pg_url: str) -> None:
    """A write the database refuses (a second event with one seq) commits nothing of its batch."""
    from effectguard.ledger.postgres import PostgresSession, Target

    async with Ledger.open(pg_url) as ledger:
        await ledger.set_limit("kept", 1)
        (first,) = await ledger.store.events_after(0, 1)
    session = PostgresSession(Target.parse(pg_url))
    try:
        session.begin()
        _run_op(session, lambda tx: operations.set_limit(tx, OPERATOR, "lost", 2))
        _run_op(session, lambda tx: tx.insert_event(first, canonical_json(first.data)))
        with pytest.raises(LedgerCorrupt):
            session.commit()
        session.rollback()
    finally:
        session.close()
    async with Ledger.open(pg_url) as ledger:
        assert [n.path for n in await ledger.budgets()] == ["kept"]
        report = await verify_ledger(ledger)
        assert report.ok, report.problems


# -- real replicas ------------------------------------------------------------------


def _serve(url: str, tmp_path: Path, provider_url: str, n: int, config: str = "") -> list[Proxy]:
    args: list[str] = []
    if config:
        path = tmp_path / "serve.toml"
        path.write_text(config)
        args = ["--config", str(path)]
    return [
        start_proxy(
            url,
            upstreams={"openai": provider_url},
            args=args,
            log_path=tmp_path / f"replica-{i}.log",
        )
        for i in range(n)
    ]


def _stop_all(replicas: list[Proxy]) -> None:
    for proxy in replicas:
        if proxy.process.poll() is None:
            proxy.kill(signal.SIGCONT)
        proxy.stop()


async def _post(client: httpx.AsyncClient, proxy: Proxy, **headers: str) -> httpx.Response:
    return await client.post(
        proxy.url + "/openai/v1/chat/completions",
        json=CHAT,
        headers={"authorization": "Bearer sk-test", "effectguard-budget": "fleet", **headers},
    )


@pytest.mark.slow
async def test_three_replicas_admit_exactly_the_budget(pg_url: str, tmp_path: Path) -> None:
    """300 clients over three replicas on one budget with room for k: exactly k go out."""
    k, reserve = 37, _reservation()
    async with Ledger.open(pg_url) as ledger:
        await ledger.set_limit("fleet", k * reserve)
    # The provider holds every admitted call long enough for the whole burst to be decided
    # while all k reservations are still held (a settled call frees what it did not spend).
    with fake_provider(tmp_path / "receipts.jsonl", delay=6.0) as provider:
        replicas = _serve(pg_url, tmp_path, provider.url, 3)
        try:
            limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
            async with httpx.AsyncClient(timeout=60, limits=limits) as client:
                responses = await asyncio.gather(
                    *(_post(client, replicas[i % 3]) for i in range(300))
                )
        finally:
            _stop_all(replicas)
        statuses = [r.status_code for r in responses]
        for i in range(3):  # every replica decided admissions (200 or 402) on the shared budget
            assert {s for s in statuses[i::3]} <= {200, 402}
        assert statuses.count(200) == k, sorted(set(statuses))
        assert statuses.count(402) == 300 - k
        assert len(provider.effects()) == k
    async with Ledger.open(pg_url) as ledger:
        (node,) = [n for n in await ledger.budgets() if n.path == "fleet"]
        assert node.reserved == 0 and node.held == 0
        # Fake usage costs less than the reservation, so nothing may pass the limit.
        assert node.limit is not None and node.spent <= node.limit
        completed = await ledger.calls(stage="completed")
        assert len(completed) == k
        report = await verify_ledger(ledger)
        assert report.ok, report.problems


async def _only_call_stage(url: str, stage: str) -> bool:
    async with Ledger.open(url) as ledger:
        calls = await ledger.calls()
    return len(calls) == 1 and calls[0].stage == stage


@pytest.mark.slow
async def test_killed_replica_calls_are_marked_by_another(pg_url: str, tmp_path: Path) -> None:
    """A replica SIGKILLed mid-call: another replica's sweeper marks its call effect_unknown."""
    with fake_provider(tmp_path / "receipts.jsonl", delay=30.0) as provider:
        victim, survivor = replicas = _serve(pg_url, tmp_path, provider.url, 2, RECOVERY)
        try:
            async with httpx.AsyncClient(timeout=60) as client:
                pending = asyncio.ensure_future(_post(client, victim))
                await _eventually(lambda: _only_call_stage(pg_url, "in_flight"), 10, "admission")
                await _eventually(_async(lambda: len(provider.effects()) == 1), 10, "dispatch")
                victim.kill(signal.SIGKILL)
                with pytest.raises(httpx.TransportError):
                    await pending
                await _eventually(
                    lambda: _only_call_stage(pg_url, "effect_unknown"),
                    15,
                    "the sweeper to mark the call",
                )
        finally:
            _stop_all(replicas)
        assert len(provider.effects()) == 1
    async with Ledger.open(pg_url) as ledger:
        (call,) = await ledger.calls()
        events = [e.event for e in await ledger.events(call.call_id)]
        (interrupted,) = [e for e in events if isinstance(e, AttemptInterrupted)]
        workers = {w.pid: w for w in await ledger.store.workers()}
        assert interrupted.by == workers[survivor.process.pid].worker
        assert workers[victim.process.pid].fenced
        assert call.held == _reservation()
        report = await verify_ledger(ledger)
        assert report.ok, report.problems


@pytest.mark.slow
async def test_stopped_replica_is_fenced_and_recovers(pg_url: str, tmp_path: Path) -> None:
    """A replica stopped past its lease is fenced: its late result is refused; then it
    registers anew (a new worker id and generation) and serves new calls."""
    with fake_provider(tmp_path / "receipts.jsonl", delay=1.0) as provider:
        sleeper, survivor = replicas = _serve(pg_url, tmp_path, provider.url, 2, RECOVERY)
        try:
            async with httpx.AsyncClient(timeout=60) as client:
                pending = asyncio.ensure_future(_post(client, sleeper))
                await _eventually(_async(lambda: len(provider.effects()) == 1), 10, "dispatch")
                sleeper.kill(signal.SIGSTOP)
                await _eventually(
                    lambda: _only_call_stage(pg_url, "effect_unknown"),
                    15,
                    "the sweeper to take over the stopped replica",
                )
                sleeper.kill(signal.SIGCONT)
                late = await pending
                assert late.status_code == 502
                assert late.json()["error"]["type"] == "observe_refused"

                async def healthy() -> bool:
                    return (await client.get(sleeper.url + "/healthz")).status_code == 200

                await _eventually(healthy, 30, "the fenced replica to register anew")
                again = await _post(client, sleeper)
                assert again.status_code == 200, again.text
        finally:
            _stop_all(replicas)
        assert len(provider.effects()) == 2
    async with Ledger.open(pg_url) as ledger:
        stages = {c.call_id: c.stage for c in await ledger.calls()}
        late_id = late.headers["effectguard-call-id"]
        assert stages == {
            late_id: "effect_unknown",
            again.headers["effectguard-call-id"]: "completed",
        }
        kinds = [e.event for e in await ledger.events(late_id)]
        assert not any(isinstance(e, AttemptObserved) for e in kinds)
        rows = [w for w in await ledger.store.workers() if w.pid == sleeper.process.pid]
        (old,) = [w for w in rows if w.fenced]
        (new,) = [w for w in rows if not w.fenced]
        assert new.generation > old.generation
        (survivor_row,) = [w for w in await ledger.store.workers() if w.pid == survivor.process.pid]
        taken = [e.event for e in await ledger.store.events_after(0, 10_000)]
        assert any(
            isinstance(e, WorkerTakenOver)
            and e.worker == old.worker
            and e.by == survivor_row.worker
            for e in taken
        )
        report = await verify_ledger(ledger)
        assert report.ok, report.problems


def _async(check: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def run() -> bool:
        return check()

    return run
