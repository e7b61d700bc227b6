"""The simulator's summary says what its maintenance checked, on each kind of ledger.

On SQLite an archive writes files, each verified against the ledger; on PostgreSQL it
moves its range into the ledger's archive tables, verified as one (``verify --archived``).
The summary had said "1 archive files checked" for the tables.
"""

from __future__ import annotations

from effectguard.testing.sim.command import SimResult
from effectguard.testing.sim.evidence import Evidence
from effectguard.testing.sim.maintevidence import ARCHIVE_TABLE
from effectguard.testing.sim.schedule import Schedule


def _maintenance(ledger: str, checks: list[tuple[str, int, str]]) -> str:
    schedule = Schedule(seed=1, duration=1.0, replicas=1, ledger=ledger, lease_s=5.0)
    evidence = Evidence(archive_checks=checks, archived_calls=frozenset({"call_a"}))
    (line,) = [
        ln for ln in SimResult(schedule, [], evidence).summary().splitlines() if "maint" in ln
    ]
    return line


def test_sqlite_archives_are_counted_as_files() -> None:
    checks = [("a.jsonl.gz", 0, ""), ("b.jsonl.gz", 0, "")]
    assert "2 archive files checked (1 calls" in _maintenance("sqlite", checks)


def test_postgres_archives_are_the_tables_not_files() -> None:
    line = _maintenance("postgres", [(ARCHIVE_TABLE, 0, "")])
    assert "archive files" not in line, line
    assert "archive tables checked (1 calls" in line, line
