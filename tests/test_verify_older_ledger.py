"""``verify`` of a SQLite ledger an older release left: the backup taken before an upgrade.

Step 1 of an upgrade is a backup with the release that serves (docs/operations.md,
"Upgrades and migrations"), and rolling back means restoring it. After the upgrade the
new release's ``verify`` refused that backup (exit 2, "is behind this release ... run
effectguard migrate"), and following that advice would migrate the backup, after which
the release it was taken for refuses it: the rollback copy would be gone. ``verify``
checks a migrated copy instead, in a temporary directory, and leaves the file as it is.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

from olderkit import LAST, as_format_5, older_backup, run_cli, versions


def test_verify_checks_a_backup_an_older_release_took_and_leaves_it_as_it_was(
    tmp_path: Path,
) -> None:
    backup = older_backup(tmp_path, "--limit", "5", "--rpm", "10")
    before = backup.read_bytes()

    done = run_cli("verify", "--ledger", str(backup))

    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("ok: "), done.stdout
    assert f"migration {LAST} pending" in done.stderr and "not changed" in done.stderr
    assert backup.read_bytes() == before and LAST not in versions(backup)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["backup.db", "ledger.db"]


def test_verify_still_names_a_broken_older_ledger(tmp_path: Path) -> None:
    """The copy is the file's: a ledger an older release left that is damaged is BROKEN."""
    ledger = tmp_path / "ledger.db"
    assert run_cli("migrate", "--ledger", str(ledger)).returncode == 0
    done = run_cli("budget", "set", "team", "--limit", "5", "--ledger", str(ledger))
    assert done.returncode == 0, done.stderr
    as_format_5(ledger)
    conn = sqlite3.connect(ledger, isolation_level=None)
    try:
        conn.execute("UPDATE budgets SET limit_nanos = limit_nanos + 1")
    finally:
        conn.close()

    done = run_cli("verify", "--ledger", str(ledger))

    assert done.returncode == 1 and "BROKEN" in done.stdout, done.stdout + done.stderr
    assert LAST not in versions(ledger)


def test_serve_says_which_migrations_it_applied_to_an_older_ledger(tmp_path: Path) -> None:
    """`serve` applies pending migrations as it opens the ledger (operations.md); one that
    raises the writer format locks every replica of the older release out. It did so
    without a word in its log: the log names each migration it applied."""
    ledger = tmp_path / "ledger.db"
    assert run_cli("migrate", "--ledger", str(ledger)).returncode == 0
    as_format_5(ledger)
    proc = subprocess.Popen(
        [sys.executable, "-m", "effectguard", "serve", "--ledger", str(ledger), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "listening on" in line:
                break
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
    told = [line for line in lines if f"migration {LAST} applied" in line]
    assert told and "writer format 6" in told[0], "".join(lines)
    assert LAST in versions(ledger)
