"""``effectguard --version`` names the release an operator runs: every release so far is
package version 0.1.0, so it also names what the ledger sees of it, the writer format
and the last migration of each store (docs/operations.md, "Upgrading")."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

from pgkit import ledger_url

_ = (ledger_url,)  # a fixture


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "effectguard", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=cwd,
    )


def test_version_names_the_package_and_the_migration_each_store_reaches(
    ledger_url: str,
) -> None:
    shown = _cli("--version")
    assert shown.returncode == 0, shown.stderr
    line = shown.stdout.strip()
    assert line.startswith(f"effectguard {version('effectguard')} ("), line
    assert re.search(r"writer format \d+;", line), line
    store = "PostgreSQL" if ledger_url.startswith("postgresql") else "SQLite"
    named = re.search(rf"{store} (\d+)", line)
    assert named is not None, line
    # What a fresh ledger of that store is migrated to is what the release says it is.
    migrated = _cli("migrate", "--ledger", ledger_url)
    assert migrated.returncode == 0, migrated.stderr
    reached = re.search(r"now at migration (\d+)", migrated.stdout + migrated.stderr)
    assert reached is not None, (migrated.stdout, migrated.stderr)
    assert reached.group(1) == named.group(1)


def test_version_needs_no_command_and_writes_no_ledger(tmp_path: Path) -> None:
    shown = _cli("--version", cwd=tmp_path)
    assert shown.returncode == 0 and shown.stdout.count("\n") == 1, shown
    assert not list(tmp_path.iterdir())  # no ./effectguard.db made


def test_version_without_the_postgres_driver_still_names_the_sqlite_release() -> None:
    """An install without the ``postgres`` extra (no psycopg) prints its release too."""
    hide = (
        "import sys; sys.modules['psycopg'] = None; "
        "from effectguard.ops.cli import main; main(['--version'])"
    )
    shown = subprocess.run(
        [sys.executable, "-c", hide], capture_output=True, text=True, timeout=60, check=False
    )
    assert shown.returncode == 0, shown.stderr
    line = shown.stdout.strip()
    assert re.search(r"writer format \d+; migrations: SQLite \d+", line), line
    assert "PostgreSQL: needs the postgres extra" in line, line
