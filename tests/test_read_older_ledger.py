"""``calls``, ``show`` and ``budgets`` on a SQLite ledger an older release left.

The backup of step 1 of an upgrade (docs/operations.md, "Upgrades and migrations") is the
file an operator reads after the upgrade to see what it holds. These commands refused it
(exit 2, "is behind this release ... run effectguard migrate"), while ``verify`` read it
through a migrated copy; following the advice would migrate the backup, and the release
it was taken for would then refuse it. They read a migrated copy too, and never change
the file.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

from effectguard.ledger import writerformat

#: SQLite's migration 23 (writer format 6): the first this release has and format 5 lacks.
LAST = 23


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "effectguard", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _as_format_5(path: Path) -> None:
    """What a release of writer format 5 left (as tests/test_verify_older_ledger.py does)."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        for statement in writerformat.sqlite_require(5):
            conn.execute(statement)
        conn.execute("ALTER TABLE rate_windows DROP COLUMN reached")
        conn.execute(f"DELETE FROM migrations WHERE version = {LAST}")
    finally:
        conn.close()


def _older_backup(tmp_path: Path) -> Path:
    """A backup of a ledger with one budget, taken by the older release."""
    ledger, backup = tmp_path / "ledger.db", tmp_path / "backup.db"
    assert _run("migrate", "--ledger", str(ledger)).returncode == 0
    done = _run("budget", "set", "team", "--limit", "5", "--ledger", str(ledger))
    assert done.returncode == 0, done.stderr
    _as_format_5(ledger)
    assert _run("backup", "--ledger", str(ledger), str(backup)).returncode == 0
    return backup


def _versions(path: Path) -> set[int]:
    conn = sqlite3.connect(path)
    try:
        return {row[0] for row in conn.execute("SELECT version FROM migrations")}
    finally:
        conn.close()


def test_calls_show_and_budgets_read_an_older_backup_and_leave_it_as_it_was(
    tmp_path: Path,
) -> None:
    backup = _older_backup(tmp_path)
    before = backup.read_bytes()

    budgets = _run("budgets", "--json", "--ledger", str(backup))
    calls = _run("calls", "--json", "--ledger", str(backup))
    show = _run("show", "no-such-call", "--ledger", str(backup))

    assert budgets.returncode == 0, budgets.stdout + budgets.stderr
    assert [row["path"] for row in json.loads(budgets.stdout)] == ["team"], budgets.stdout
    assert calls.returncode == 0, calls.stdout + calls.stderr
    assert json.loads(calls.stdout) == []
    # The copy is read: the call is not in it (exit 3, as on any ledger), not "behind".
    assert show.returncode == 3 and "no-such-call" in show.stderr, show.stderr
    for done in (budgets, calls, show):
        assert f"migration {LAST} pending" in done.stderr, done.stderr
        assert "reading a copy" in done.stderr and "not changed" in done.stderr, done.stderr
    assert backup.read_bytes() == before and LAST not in _versions(backup)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["backup.db", "ledger.db"]


def test_commands_that_change_the_ledger_still_refuse_an_older_one(tmp_path: Path) -> None:
    """A change made to a copy would be lost: ``budget set`` keeps refusing, exit 2."""
    backup = _older_backup(tmp_path)

    done = _run("budget", "set", "team", "--limit", "6", "--ledger", str(backup))

    assert done.returncode == 2 and "behind this release" in done.stderr, done.stderr
    assert LAST not in _versions(backup)
