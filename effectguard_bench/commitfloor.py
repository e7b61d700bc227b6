"""What one durable commit costs on this disk, before any of effectguard's own work.

The one-client targets of issue #17 (p50 and a stream's first byte, each at most 0.6 ms
above the bare baseline) are set against a path that holds durable commits the baseline
does not make: two per call (admission before dispatch, observation before the answer,
docs/contract.md §3), one before a stream's first byte. This measures their floor in the
directory where the benchmark's ledgers live, so every run prints it beside the targets:

- **fdatasync**: ``pwrite`` of :data:`PAGES` pages (the WAL frames of a single-operation
  commit, ``effectguard bench ledger`` counts them) and ``fdatasync``, the raw disk;
- **SQLite commit**: a transaction writing one page of each of four b-trees (an appended
  row, an upserted keyed row, a partial-index entry, an updated counter row: what an
  admission or an observation touches) in WAL with ``synchronous=FULL``, with no
  effectguard code at all.

Medians over :data:`COMMITS` commits, after :data:`WARMUP` to fill the WAL's first pages.
A disk whose commit floor is above half the target cannot meet the p50 target with two
commits per call, whatever the code does.
"""

from __future__ import annotations

import os
import sqlite3
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PAGES = 4
PAGE = 4096
COMMITS = 400
WARMUP = 50


@dataclass(frozen=True, slots=True)
class CommitFloor:
    """Median wall milliseconds of a raw 4-page fdatasync and of a 4-page SQLite commit."""

    fdatasync_ms: float
    sqlite_commit_ms: float

    def to_json(self) -> dict[str, Any]:
        """The figures as a JSON-ready dict."""
        return {
            "fdatasync_ms": round(self.fdatasync_ms, 3),
            "sqlite_commit_ms": round(self.sqlite_commit_ms, 3),
        }


def _fdatasync_ms(path: Path) -> float:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        block = b"\xa5" * (PAGE * PAGES)
        span = 64  # a WAL is reused from its start: overwrite a bounded region
        os.pwrite(fd, block * span, 0)
        os.fsync(fd)
        times = []
        for n in range(WARMUP + COMMITS):
            started = time.perf_counter()
            os.pwrite(fd, block, (n % span) * len(block))
            os.fdatasync(fd)
            if n >= WARMUP:
                times.append(time.perf_counter() - started)
        return statistics.median(times) * 1000
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


_SCHEMA = (
    "CREATE TABLE log (seq INTEGER PRIMARY KEY, data BLOB NOT NULL)",
    "CREATE TABLE rows (id BLOB PRIMARY KEY, stage INTEGER NOT NULL, data BLOB) WITHOUT ROWID",
    "CREATE INDEX rows_open ON rows(stage) WHERE stage = 1",
    "CREATE TABLE counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL)",
)


def _sqlite_commit_ms(path: Path) -> float:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA wal_autocheckpoint=0")
        for sql in _SCHEMA:
            conn.execute(sql)
        conn.execute("INSERT INTO counters VALUES ('budget', 0)")
        times = []
        for n in range(WARMUP + COMMITS):
            key = n.to_bytes(16, "big")
            started = time.perf_counter()
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT INTO log(data) VALUES (?)", (os.urandom(400),))
            conn.execute("INSERT INTO rows VALUES (?, 1, ?)", (key, os.urandom(120)))
            conn.execute("UPDATE counters SET value = value + 1 WHERE name = 'budget'")
            conn.execute("COMMIT")
            if n >= WARMUP:
                times.append(time.perf_counter() - started)
            if n % 100 == 99:
                conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        return statistics.median(times) * 1000
    finally:
        conn.close()
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)


def measure(work: Path) -> CommitFloor:
    """Measure both floors in ``work`` (the directory the benchmark's ledgers use)."""
    return CommitFloor(
        fdatasync_ms=_fdatasync_ms(work / "floor.bin"),
        sqlite_commit_ms=_sqlite_commit_ms(work / "floor.db"),
    )
