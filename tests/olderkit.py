"""A SQLite ledger as the previous release (writer format 5) left it: the backup step 1
of an upgrade takes (docs/operations.md, "Upgrades and migrations"), for the tests of
the commands that must read it without changing it."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

from effectguard.ledger import writerformat

#: SQLite's migration 23 (writer format 6): the first this release has and format 5 lacks.
LAST = 23


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "effectguard", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def as_format_5(path: Path) -> None:
    """What a release of writer format 5 left: no ``reached``, no migration 23, and the
    triggers of format 5."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        for statement in writerformat.sqlite_require(5):
            conn.execute(statement)
        conn.execute("ALTER TABLE rate_windows DROP COLUMN reached")
        conn.execute(f"DELETE FROM migrations WHERE version = {LAST}")
    finally:
        conn.close()


def older_backup(tmp_path: Path, *budget: str) -> Path:
    """A backup, taken by the older release, of a ledger with one budget ``team`` set
    with ``budget``'s options."""
    ledger, backup = tmp_path / "ledger.db", tmp_path / "backup.db"
    assert run_cli("migrate", "--ledger", str(ledger)).returncode == 0
    done = run_cli("budget", "set", "team", *budget, "--ledger", str(ledger))
    assert done.returncode == 0, done.stderr
    as_format_5(ledger)
    assert run_cli("backup", "--ledger", str(ledger), str(backup)).returncode == 0
    return backup


def versions(path: Path) -> set[int]:
    """The migrations the ledger at ``path`` records."""
    conn = sqlite3.connect(path)
    try:
        return {row[0] for row in conn.execute("SELECT version FROM migrations")}
    finally:
        conn.close()
