"""How long the operator start page's calls take with many calls unknown and gone workers.

    python -m effectguard_bench.gonebench --calls 100000 --unknown 20000 --gone 20 [--ledger PATH]

Builds a SQLite ledger (unless ``--ledger`` names one already built) straight through a
write session, as :mod:`effectguard_bench.recoverybench` does: ``--calls`` calls, of which
``--unknown`` are effect unknown and the rest completed, then ``--gone`` workers whose
lease has lapsed, each with ``--per-gone`` calls still in flight. It prints SQLite's plan
for the read of gone workers' calls in flight, then times the start page's calls sections
(``AdminPage._unknown_calls``: the unknown calls, and the calls in flight whose worker is
gone) and that look alone, and a sweep taking every gone worker over in its write
transaction (rolled back). The build is not timed. For a before/after pair, run this
file with another tree first on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import asyncio
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
from effectguard.ingress.admin.routes import GONE_SHOWN, AdminPage
from effectguard.ledger import Ledger, Writer, operations
from effectguard.ledger.queries import SQLITE
from effectguard.ledger.sqlite import SqliteSession
from effectguard_bench.ledgerbench import outcome_events
from effectguard_bench.recoverybench import _BUDGET, _RESERVE, _started_events

_BATCH = 20_000


def _register(session: SqliteSession, name: str) -> Writer:
    # Lease 0 on a host that is not this one: gone by its lease, never by a lock here.
    return operations.register_worker(session, worker=name, host="bench-gone", pid=0, lease_s=0)


def build(path: Path, calls: int, unknown: int, gone: int, per_gone: int) -> None:
    """Write ``calls`` calls (``unknown`` of them effect unknown, the rest completed), then
    ``per_gone`` calls in flight of each of ``gone`` workers whose lease has lapsed."""
    session = SqliteSession(str(path))
    try:
        session.begin()
        loader = _register(session, "bench-loader")
        workers = [_register(session, f"bench-gone-{n}") for n in range(gone)]
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
        for writer in workers:
            for _ in range(per_gone):
                call_id = "call_" + uuid.uuid4().hex
                operations.append(session, writer, _started_events(call_id, writer, session.now()))
        session.commit()
    finally:
        session.close()


def plan(path: Path, workers: int) -> list[str]:
    """SQLite's plan for the read of ``workers`` gone workers' calls in flight (a tree
    before 2026-12-05 read them one worker a query: that query's plan)."""
    names = [f"bench-gone-{n}" for n in range(workers)]
    page: Any = SQLITE.in_flight_page
    sql, params = (page(len(names)), names) if callable(page) else (page, names[:1])
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


async def time_page(path: Path, repeats: int) -> dict[str, list[float]]:
    """Seconds each of ``repeats`` renderings of the start page's calls sections took, and
    each look at the calls in flight whose worker is gone alone (``gone_in_flight``)."""
    async with Ledger.open(str(path)) as ledger:
        page = AdminPage(AdminSettings(), ledger)
        return {
            "start page calls sections": await _timed(page._unknown_calls, repeats),
            "gone_in_flight": await _timed(
                lambda: gone_in_flight(ledger, None, GONE_SHOWN), repeats
            ),
        }


def main() -> None:
    """Build a ledger (or take one) and print the plan and the timings."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--calls", type=int, default=100_000)
    parser.add_argument("--unknown", type=int, default=20_000)
    parser.add_argument("--gone", type=int, default=20)
    parser.add_argument("--per-gone", type=int, default=3)
    parser.add_argument("--ledger", help="a SQLite ledger to time (kept; built if new)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(args.ledger or Path(scratch) / "gone.db")
        if not path.exists():
            began = time.perf_counter()
            build(path, args.calls, args.unknown, args.gone, args.per_gone)
            print(f"built {args.calls} calls in {time.perf_counter() - began:.1f} s")
        print("plan: " + "; ".join(plan(path, min(args.gone, 20))))
        for name, times in asyncio.run(time_page(path, args.repeats)).items():
            shown = ", ".join(f"{t * 1000:.1f}" for t in times)
            print(f"{name}: median {statistics.median(times) * 1000:.1f} ms ({shown} ms)")
        took, marked = time_sweep(path)
        print(f"sweep taking the gone workers over: {took * 1000:.0f} ms ({marked} calls marked)")


if __name__ == "__main__":
    main()
