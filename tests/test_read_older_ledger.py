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
from pathlib import Path

from olderkit import LAST, older_backup, run_cli, versions


def test_calls_show_and_budgets_read_an_older_backup_and_leave_it_as_it_was(
    tmp_path: Path,
) -> None:
    backup = older_backup(tmp_path, "--limit", "5")
    before = backup.read_bytes()

    budgets = run_cli("budgets", "--json", "--ledger", str(backup))
    calls = run_cli("calls", "--json", "--ledger", str(backup))
    show = run_cli("show", "no-such-call", "--ledger", str(backup))

    assert budgets.returncode == 0, budgets.stdout + budgets.stderr
    assert [row["path"] for row in json.loads(budgets.stdout)] == ["team"], budgets.stdout
    assert calls.returncode == 0, calls.stdout + calls.stderr
    assert json.loads(calls.stdout) == []
    # The copy is read: the call is not in it (exit 3, as on any ledger), not "behind".
    assert show.returncode == 3 and "no-such-call" in show.stderr, show.stderr
    for done in (budgets, calls, show):
        assert f"migration {LAST} pending" in done.stderr, done.stderr
        assert "reading a copy" in done.stderr and "not changed" in done.stderr, done.stderr
    assert backup.read_bytes() == before and LAST not in versions(backup)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["backup.db", "ledger.db"]


def test_commands_that_change_the_ledger_still_refuse_an_older_one(tmp_path: Path) -> None:
    """A change made to a copy would be lost: ``budget set`` keeps refusing, exit 2."""
    backup = older_backup(tmp_path, "--limit", "5")

    done = run_cli("budget", "set", "team", "--limit", "6", "--ledger", str(backup))

    assert done.returncode == 2 and "behind this release" in done.stderr, done.stderr
    assert LAST not in versions(backup)
