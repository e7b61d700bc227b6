"""The floor of the ledger's CPU per call: the statements and digests alone, no Python logic.

``python -m effectguard_bench.floorbench [--calls 2000] [--batch 10]`` answers whether a
CPU target for the proxy can be met by making the ledger's Python faster, or whether
what the contract requires already costs more (docs/performance.md, "What the floor
shows"). It writes a real ledger of ``--calls`` admit+settle pairs, reads back exactly the
rows it stored, and then times, in CPU seconds of this process:

1. **storage**: replaying those rows into a fresh ledger file with the same schema,
   triggers and indexes and the store's own statements (per call: an admission and an
   observation, each one ``executemany`` of its event rows (one record of three events
   since format 4), one call upsert and one budget-period upsert), ``--batch``
   operations per transaction, WAL with ``synchronous=FULL`` as the store runs it;
2. **sealing**: the canonical JSON and SHA-256 chain digest of each of the call's six
   events, with the functions that define them.

Nothing else runs: no decisions, no folding, no caches, no event loop. A store written in
any language must do at least (1)'s work in SQLite and (2)'s encoding and hashing.
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from effectguard.ledger import Ledger, sqlitecalls, writerformat
from effectguard.ledger.queries import SQLITE
from effectguard.ledger.rows import NODE_COLUMNS
from effectguard.ledger.sqliteevents import ALL_EVENTS, INSERT_COLUMNS
from effectguard.ledger.sqliterecords import events_from_row
from effectguard.ledger.sqlparts import upsert
from effectguard.rules.events import stored_digest
from effectguard_bench import ledgerbench, storagebench

_INSERT_EVENT = SQLITE.insert_events.rows(1)
_UPSERT_CALL = upsert("calls", sqlitecalls.ROW_COLUMNS, "?", sqlitecalls.MUTABLE_COLUMNS).rows(1)
_UPSERT_NODE = SQLITE.upsert_nodes.rows(1)
_AT = 7  # the ``at`` column of INSERT_COLUMNS: an operation's rows share it


@dataclass(frozen=True, slots=True)
class Floor:
    """CPU microseconds per call of the storage and sealing floors."""

    calls: int
    batch: int
    storage_us: float
    sealing_us: float
    #: Wall-clock microseconds per commit (at one operation per commit: one fdatasync).
    commit_wall_us: float

    @property
    def total_us(self) -> float:
        return self.storage_us + self.sealing_us


@dataclass(frozen=True, slots=True)
class _Call:
    events: list[tuple[Any, ...]]
    row: tuple[Any, ...]


def _source(path: Path, calls: int) -> tuple[list[_Call], tuple[Any, ...], list[Any]]:
    """A real ledger of ``calls`` pairs: each call's stored rows, the budget row, and the
    stored events (for sealing)."""

    async def build() -> None:
        async with Ledger.open(str(path)) as ledger:
            writer = await ledgerbench.register(ledger, lease_s=600)
            for _ in range(calls):
                await storagebench._one_call(ledger, writer, "bench/floor")

    asyncio.run(build())
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute(f"SELECT {INSERT_COLUMNS} FROM events ORDER BY seq").fetchall()
        by_call: dict[Any, list[tuple[Any, ...]]] = {}
        for row in rows:
            if row[2] is not None:
                by_call.setdefault(row[2], []).append(row)
        call_rows = conn.execute(f"SELECT {sqlitecalls.ROW_COLUMNS} FROM calls").fetchall()
        node = conn.execute(f"SELECT {NODE_COLUMNS} FROM budget_periods").fetchone()
        stored = [e for r in conn.execute(ALL_EVENTS) for e in events_from_row(r)]
    finally:
        conn.close()
    keyed = {r[0]: r for r in call_rows}  # keyed as the events key them (sqlitecalls)
    built = [_Call(events, keyed[key]) for key, events in by_call.items() if key in keyed]
    return built, node, stored


def _schema(source: Path) -> list[str]:
    conn = sqlite3.connect(source)
    try:
        found = conn.execute(
            "SELECT sql FROM sqlite_master WHERE sql IS NOT NULL AND name NOT LIKE 'sqlite_%'"
            " ORDER BY rowid"
        ).fetchall()
    finally:
        conn.close()
    return [str(sql) for (sql,) in found]


def _operations(calls: list[_Call], node: tuple[Any, ...]) -> list[Callable[[Any], None]]:
    """Each call's admission and observation, as the statements the store sends."""
    ops: list[Callable[[Any], None]] = []
    for call in calls:
        parts: dict[Any, list[tuple[Any, ...]]] = {}
        for row in call.events:
            parts.setdefault(row[_AT], []).append(row)
        for part in parts.values():

            def op(conn: Any, part: list[tuple[Any, ...]] = part, row: Any = call.row) -> None:
                conn.executemany(_INSERT_EVENT, part)
                conn.execute(_UPSERT_CALL, row)
                conn.execute(_UPSERT_NODE, node)

            ops.append(op)
    return ops


def storage_floor(
    source: Path, target: Path, calls: list[_Call], node: Any, batch: int
) -> tuple[float, float]:
    """CPU seconds to write ``calls``' rows into a fresh ledger, ``batch`` ops a commit,
    and the wall seconds per commit."""
    conn = sqlite3.connect(target, isolation_level=None, check_same_thread=False)
    writerformat.declare_sqlite(conn)  # as the store does: the schema's triggers call it
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    for sql in _schema(source):
        conn.execute(sql)
    ops = _operations(calls, node)
    started, wall = time.process_time(), time.perf_counter()
    for at in range(0, len(ops), batch):
        conn.execute("BEGIN IMMEDIATE")
        for op in ops[at : at + batch]:
            op(conn)
        conn.execute("COMMIT")
    spent, wall = time.process_time() - started, time.perf_counter() - wall
    conn.close()
    return spent, wall / -(-len(ops) // batch)


def sealing_floor(stored: list[Any]) -> float:
    """CPU seconds to encode and chain-hash every stored event once."""
    started = time.process_time()
    for e in stored:
        stored_digest(e)
    return time.process_time() - started


def measure(work: Path, calls: int, batch: int) -> Floor:
    """Build the source ledger in ``work`` and time both floors."""
    source, target = work / "floor-source.db", work / "floor-target.db"
    built, node, stored = _source(source, calls)
    storage, commit_wall = storage_floor(source, target, built, node, batch)
    call_events = [e for e in stored if e.call_id is not None]
    sealing = sealing_floor(call_events)
    n = len(built)
    return Floor(n, batch, storage / n * 1e6, sealing / n * 1e6, commit_wall * 1e6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--batch", type=int, action="append", help="ops per commit (repeat)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for batch in args.batch or [10, 2]:
            work = Path(tmp) / f"b{batch}"
            work.mkdir()
            floor = measure(work, args.calls, batch)
            print(
                f"{floor.calls} calls, {batch} operations per commit: storage "
                f"{floor.storage_us:.0f} µs + sealing {floor.sealing_us:.0f} µs = "
                f"{floor.total_us:.0f} µs CPU per call; {floor.commit_wall_us:.0f} µs wall "
                "per commit"
            )


if __name__ == "__main__":
    main()
