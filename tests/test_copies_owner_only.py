"""Copies of a SQLite ledger are owner-only, as the ledger is (docs/contract.md §12).

The ledger holds prompts, answers and proxy key digests, and is created 0600; a backup
(``effectguard backup``) and an archive file (``effectguard archive``) hold the same, so
they are created 0600 too, whatever the umask.
"""

from __future__ import annotations

import asyncio
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_archive import cli
from test_archive_rules import DAY_S, admitted_long_ago

from effectguard.ops.cli import main


@pytest.fixture
def open_umask() -> Iterator[None]:
    """The common 022 umask, under which a new file is readable by everyone."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _others_may_read(path: Path) -> bool:
    return bool(stat.S_IMODE(path.stat().st_mode) & 0o077)


def test_a_backup_is_owner_only(
    tmp_path: Path, open_umask: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """``effectguard backup PATH`` writes PATH readable and writable by its owner only."""
    ledger, copy = tmp_path / "ledger.db", tmp_path / "copy.db"
    assert main(["migrate", "--ledger", str(ledger)]) == 0
    assert not _others_may_read(ledger)
    assert main(["backup", str(copy), "--ledger", str(ledger)]) == 0
    assert not _others_may_read(copy), oct(copy.stat().st_mode)


def test_an_archive_file_is_owner_only(
    tmp_path: Path, open_umask: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """``effectguard archive`` writes its file (a call's request and answer in it)
    readable and writable by its owner only."""
    ledger = tmp_path / "ledger.db"
    asyncio.run(admitted_long_ago(ledger, time.time() - 60 * DAY_S))
    code, moved = cli(capsys, "archive", "--ledger", str(ledger), "--before", "30d")
    assert code == 0 and moved["calls"] == 1, moved
    archive = Path(moved["path"])
    assert not _others_may_read(archive), oct(archive.stat().st_mode)
