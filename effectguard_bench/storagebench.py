"""What the ledger writes per call: bytes on disk and WAL pages per commit (SQLite).

Both are counts, not timings, so they do not depend on the machine's load:

- **bytes per call**: the database file's growth over N calls (WAL checkpointed
  before and after), less the request and response bodies' own bytes; split by
  table and index with SQLite's ``dbstat``;
- **WAL pages per commit**: the frames one admission (and one observation) adds
  to a WAL truncated just before it. Each frame is one page the commit fsyncs.
"""

from __future__ import annotations

import asyncio
import sqlite3
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from effectguard.ledger import Ledger, Writer
from effectguard_bench import ledgerbench

#: Calls written before measuring, so that trees have their working depth.
WARMUP_CALLS = 200
#: Calls whose file growth is measured (enough that page granularity is noise).
CALLS = 1000
#: Single-operation commits whose WAL frames are counted (the median is reported).
COMMITS = 21
_WAL_HEADER = 32
_FRAME_HEADER = 24


@dataclass(frozen=True, slots=True)
class StorageCost:
    """What one call costs the SQLite ledger in bytes and in WAL pages per commit."""

    calls: int
    bytes_per_call: float
    body_bytes_per_call: int
    admission_wal_pages: float
    observation_wal_pages: float
    page_size: int
    objects: dict[str, float] = field(default_factory=dict)
    #: The means of the same 21 commits: a commit that grows a b-tree writes more pages
    #: (a new page, page 1 for the file's size, a split's siblings), which the median hides.
    admission_wal_pages_mean: float = 0.0
    observation_wal_pages_mean: float = 0.0

    @property
    def overhead_per_call(self) -> float:
        """Bytes per call beyond the request and response bodies' own bytes."""
        return self.bytes_per_call - self.body_bytes_per_call

    def to_json(self) -> dict[str, Any]:
        """The figures as a JSON-ready dict."""
        return {
            "calls": self.calls,
            "bytes_per_call": round(self.bytes_per_call, 1),
            "body_bytes_per_call": self.body_bytes_per_call,
            "overhead_bytes_per_call": round(self.overhead_per_call, 1),
            "admission_wal_pages": self.admission_wal_pages,
            "observation_wal_pages": self.observation_wal_pages,
            "admission_wal_pages_mean": round(self.admission_wal_pages_mean, 2),
            "observation_wal_pages_mean": round(self.observation_wal_pages_mean, 2),
            "page_size": self.page_size,
            "objects_bytes_per_call": {k: round(v, 1) for k, v in self.objects.items()},
        }


def _truncate_wal(side: sqlite3.Connection) -> None:
    busy, _, _ = side.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    if busy:
        raise RuntimeError("the WAL could not be checkpointed: a reader held it")


def _wal_frames(path: Path, page_size: int) -> int:
    wal = Path(f"{path}-wal")
    size = wal.stat().st_size if wal.exists() else 0
    return max(0, size - _WAL_HEADER) // (page_size + _FRAME_HEADER)


def _object_bytes(side: sqlite3.Connection) -> dict[str, int]:
    rows = side.execute("SELECT name, sum(pgsize) FROM dbstat GROUP BY name")
    return {str(name): int(size) for name, size in rows}


async def _one_call(ledger: Ledger, writer: Writer, budget: str) -> None:
    request = ledgerbench.admit_request(budget)
    admitted = await ledger.admit(writer, request)
    if admitted.action != "admit":
        raise RuntimeError(f"admission refused: {admitted.refusal}")
    events = ledgerbench.outcome_events(
        admitted.call_id, admitted.attempt, budget, ledgerbench.RESERVE
    )
    await ledger.record(writer, admitted.call_id, admitted.attempt, events)


async def _commit_pages(
    ledger: Ledger, writer: Writer, budget: str, side: sqlite3.Connection, path: Path
) -> tuple[list[int], list[int]]:
    page_size = int(side.execute("PRAGMA page_size").fetchone()[0])
    admissions: list[int] = []
    observations: list[int] = []
    for _ in range(COMMITS):
        _truncate_wal(side)
        admitted = await ledger.admit(writer, ledgerbench.admit_request(budget))
        admissions.append(_wal_frames(path, page_size))
        _truncate_wal(side)
        events = ledgerbench.outcome_events(
            admitted.call_id, admitted.attempt, budget, ledgerbench.RESERVE
        )
        await ledger.record(writer, admitted.call_id, admitted.attempt, events)
        observations.append(_wal_frames(path, page_size))
    return admissions, observations


async def measure(path: Path, calls: int = CALLS) -> StorageCost:
    """Build a SQLite ledger at ``path`` and measure what its calls cost."""
    async with Ledger.open(str(path)) as ledger:
        writer = await ledgerbench.register(ledger, lease_s=600)
        budget = "bench/storage"
        side = sqlite3.connect(path, isolation_level=None, timeout=5.0)
        try:
            for _ in range(WARMUP_CALLS):
                await _one_call(ledger, writer, budget)
            _truncate_wal(side)
            page_size = int(side.execute("PRAGMA page_size").fetchone()[0])
            size0, objects0 = path.stat().st_size, _object_bytes(side)
            for _ in range(calls):
                await _one_call(ledger, writer, budget)
            _truncate_wal(side)
            size1, objects1 = path.stat().st_size, _object_bytes(side)
            admission, observation = await _commit_pages(ledger, writer, budget, side, path)
        finally:
            side.close()
    grown = {
        name: (size - objects0.get(name, 0)) / calls
        for name, size in sorted(objects1.items())
        if size != objects0.get(name, 0)
    }
    return StorageCost(
        calls=calls,
        bytes_per_call=(size1 - size0) / calls,
        body_bytes_per_call=ledgerbench.BODY_BYTES_PER_CALL,
        admission_wal_pages=statistics.median(admission),
        observation_wal_pages=statistics.median(observation),
        admission_wal_pages_mean=statistics.fmean(admission),
        observation_wal_pages_mean=statistics.fmean(observation),
        page_size=page_size,
        objects=grown,
    )


def run(work: Path, calls: int = CALLS) -> StorageCost:
    """Measure on a fresh SQLite ledger in ``work``."""
    return asyncio.run(measure(work / "ledger-storage.db", calls))
