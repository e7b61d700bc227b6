"""How long the operator start page's calls take with many calls unknown and gone workers.

    python -m effectguard_bench.gonebench --calls 100000 --unknown 20000 --gone 20 [--ledger PATH]

Builds a SQLite ledger (unless ``--ledger`` names one already built) straight through a
write session, as :mod:`effectguard_bench.recoverybench` does: ``--calls`` calls, of which
``--unknown`` are effect unknown and the rest completed, written by a worker whose lease
runs a day (alive), with ``--alive-calls`` calls still in flight; then ``--gone`` workers
whose lease has lapsed and ``--fenced`` workers taken over by a sweep that could not mark
their calls, each with ``--per-gone`` calls still in flight. It prints SQLite's plan
for the read of calls in flight whose worker is not alive, then times the start page's
calls sections (``AdminPage._unknown_calls``: the unknown calls, and the calls in flight
whose worker is gone) and that look alone, and a sweep taking every gone worker over in
its write transaction (rolled back). The build is not timed. For a before/after pair,
run this file with another tree first on ``PYTHONPATH``. ``--ledger`` may name a
PostgreSQL ledger (``postgresql://…?schema=NAME``, built if it holds no call): the page
is timed there, the plan and the sweep (SQLite's) are not.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sqlite3
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from effectguard.callpath.takeover import gone_in_flight
from effectguard.config.settings import AdminSettings
from effectguard.ingress.admin.routes import GONE_SHOWN, UNKNOWN_SHOWN, AdminPage
from effectguard.ledger import Ledger, Writer, operations
from effectguard.ledger.base import Tx
from effectguard.ledger.pgschema import Target
from effectguard.ledger.pgsession import PostgresSession
from effectguard.ledger.queries import SQLITE
from effectguard.ledger.sqlitesession import SqliteSession
from effectguard_bench.ledgerbench import outcome_events
from effectguard_bench.recoverybench import _BUDGET, _RESERVE, _started_events

_BATCH = 20_000


def _session(where: str) -> SqliteSession | PostgresSession:
    """A write session on the ledger at ``where`` (a path, or a PostgreSQL URL)."""
    if where.startswith(("postgresql://", "postgres://")):
        return PostgresSession(Target.parse(where))
    return SqliteSession(where)


def _register(session: Tx, name: str, lease_s: float = 0) -> Writer:
    # Lease 0 on a host that is not this one: gone by its lease, never by a lock here.
    return operations.register_worker(
        session, worker=name, host="bench-gone", pid=0, lease_s=lease_s
    )


def build(
    path: Path | str,
    calls: int,
    unknown: int,
    gone: int,
    per_gone: int,
    fenced: int = 0,
    alive: int = 0,
) -> None:
    """Write ``calls`` calls (``unknown`` of them effect unknown, the rest completed) and
    ``alive`` calls in flight by a worker alive for a day, then ``per_gone`` calls in
    flight of each of ``gone`` workers whose lease has lapsed and of each of ``fenced``
    workers fenced by a sweep that left their calls in flight."""
    session = _session(str(path))
    try:
        session.begin()
        loader = _register(session, "bench-loader", lease_s=86_400)
        workers = [_register(session, f"bench-gone-{n}") for n in range(gone)]
        fencing = [_register(session, f"bench-fenced-{n}") for n in range(fenced)]
        session.commit()
        for start in range(0, calls, _BATCH):
            session.begin()
            now = session.now()
            for n in range(start, min(start + _BATCH, calls)):
                call_id = "call_" + uuid.uuid4().hex
                events = _started_events(call_id, loader, now)
                if n < unknown:  # interrupted as a sweep interrupts it
                    state = operations.append(session, loader, events)[call_id]
                    operations.interrupt(session, loader, state, "bench")
                    continue
                events += outcome_events(call_id, 1, _BUDGET, _RESERVE)
                operations.append(session, loader, events)
            session.commit()
        session.begin()
        for writer, n in [*((w, per_gone) for w in workers + fencing), (loader, alive)]:
            for _ in range(n):
                call_id = "call_" + uuid.uuid4().hex
                operations.append(session, writer, _started_events(call_id, writer, session.now()))
        _fence(session, loader, fencing)
        session.commit()
    finally:
        session.close()


def _fence(session: Tx, sweeper: Writer, workers: list[Writer]) -> None:
    """Take ``workers`` over as a sweep that could not mark their calls does: fenced, each
    call left in flight (only a lease seen unchanged before lapses: theirs alone)."""
    leases = {}
    for writer in workers:
        row = session.get_worker(writer.worker)
        assert row is not None
        leases[writer.worker] = row.lease_expires
    if leases:
        operations.sweep(session, sweeper, interrupt_calls=False, held_still=leases)


def plan(path: Path, workers: int) -> list[str]:
    """SQLite's plan for the read of the calls in flight of workers not alive (a tree
    before 2026-12-05 read those of ``workers`` gone workers by name: that query's plan)."""
    if hasattr(SQLITE, "in_flight_except"):
        sql, params = SQLITE.in_flight_except(1), ["bench-loader"]
    else:
        page: Any = getattr(SQLITE, "in_flight_page")  # noqa: B009 (an older tree's)
        params = [f"bench-gone-{n}" for n in range(workers)]
        sql = page(len(params))
    conn = sqlite3.connect(str(path))
    try:
        rows = conn.execute("EXPLAIN QUERY PLAN " + sql, (*params, GONE_SHOWN + 1))
        return [str(row[-1]) for row in rows]
    finally:
        conn.close()


def time_sweep(path: Path) -> tuple[float, int]:
    """Seconds a sweep takes, inside its write transaction, to take over the gone workers
    and mark their calls (rolled back: the ledger is left as it was), and the calls marked."""
    session = SqliteSession(str(path))
    try:
        session.begin()
        try:
            sweeper = operations.register_worker(
                session, worker="bench-sweeper", host="bench", pid=0, lease_s=60
            )
            began = time.perf_counter()
            marked = operations.sweep(session, sweeper)
            return time.perf_counter() - began, len(marked)
        finally:
            session.rollback()
    finally:
        session.close()


async def _timed(work: Callable[[], Awaitable[object]], repeats: int) -> list[float]:
    await work()  # warm: the first read loads the pages
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        await work()
        times.append(time.perf_counter() - began)
    return times


async def time_page(path: Path | str, repeats: int) -> dict[str, list[float]]:
    """Seconds each of ``repeats`` renderings of the start page's calls sections took, and
    each of their reads alone: the unknown calls' totals (``stage_counts``), the oldest
    unknown calls it lists, and the look at calls in flight whose worker is gone."""
    async with Ledger.open(str(path)) as ledger:
        page = AdminPage(AdminSettings(), ledger)
        return {
            "start page calls sections": await _timed(page._unknown_calls, repeats),
            "stage_counts": await _timed(ledger.stage_counts, repeats),
            f"oldest {UNKNOWN_SHOWN} unknown": await _timed(
                lambda: ledger.calls("effect_unknown", limit=UNKNOWN_SHOWN, oldest_first=True),
                repeats,
            ),
            "gone_in_flight": await _timed(
                lambda: gone_in_flight(ledger, None, GONE_SHOWN), repeats
            ),
        }


async def _empty(where: str) -> bool:
    """Whether the ledger at ``where`` (a PostgreSQL URL) holds no call yet."""
    async with Ledger.open(where) as ledger:
        return not await ledger.calls(limit=1)


async def listed(path: Path | str) -> dict[str, int]:
    """How many calls the look lists, by why their worker is gone."""
    async with Ledger.open(str(path)) as ledger:
        found, _ = await gone_in_flight(ledger, None, GONE_SHOWN)
    return dict(collections.Counter(why for _, why in found))


def main() -> None:
    """Build a ledger (or take one) and print the plan and the timings."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--calls", type=int, default=100_000)
    parser.add_argument("--unknown", type=int, default=20_000)
    parser.add_argument("--gone", type=int, default=20)
    parser.add_argument("--fenced", type=int, default=5)
    parser.add_argument("--per-gone", type=int, default=3)
    parser.add_argument("--alive-calls", type=int, default=20)
    parser.add_argument("--ledger", help="a SQLite ledger to time (kept; built if new)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        pg = str(args.ledger or "").startswith(("postgresql://", "postgres://"))
        path: Path | str = args.ledger if pg else Path(args.ledger or Path(scratch) / "gone.db")
        if asyncio.run(_empty(str(path))) if pg else not Path(path).exists():
            began = time.perf_counter()
            build(
                path,
                args.calls,
                args.unknown,
                args.gone,
                args.per_gone,
                fenced=args.fenced,
                alive=args.alive_calls,
            )
            print(f"built {args.calls} calls in {time.perf_counter() - began:.1f} s")
        if not pg:
            print("plan: " + "; ".join(plan(Path(path), min(args.gone, 20))))
        for name, times in asyncio.run(time_page(path, args.repeats)).items():
            shown = ", ".join(f"{t * 1000:.1f}" for t in times)
            print(f"{name}: median {statistics.median(times) * 1000:.1f} ms ({shown} ms)")
        print(f"gone_in_flight lists: {asyncio.run(listed(path))}")
        if pg:
            return
        took, marked = time_sweep(Path(path))
        print(f"sweep taking the gone workers over: {took * 1000:.0f} ms ({marked} calls marked)")


if __name__ == "__main__":
    main()
