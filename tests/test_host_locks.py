"""Where PostgreSQL workers keep their liveness locks: only in a directory of the user's own.

A lock file found free proves its worker's process gone (contract §7), so the directory
must be one no other user can put files in: else another user could make a live
replica look gone (a free lock file of its name) and have it taken over. A directory not
the user's alone is not used: workers are then known gone by their lease only.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

import pytest

from effectguard.callpath import hostlocks
from effectguard.callpath.liveness import remove_if_free
from effectguard.callpath.recovery import lock_dir_for

PG = "postgresql://u@127.0.0.1:5432/db?schema=s"


@pytest.fixture
def temp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The system's temporary directory moved to ``tmp_path``, no runtime directory set."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_a_pg_ledger_locks_in_a_private_directory_of_the_user_and_boot(temp_dir: Path) -> None:
    base = temp_dir / f"effectguard-{os.getuid()}"
    found = lock_dir_for(PG)
    assert found is not None and found.parent == base, found
    assert found.name.startswith("pg-")
    assert base.stat().st_mode & 0o777 == 0o700
    # Another spelling of the same ledger (or another ledger) shares the directory: a
    # worker id is unique, and a replica and a reconcile may spell the DSN differently.
    assert lock_dir_for("postgres://u@localhost/db") == found


def test_the_runtime_directory_is_used_when_it_is_the_users(
    temp_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = temp_dir / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    found = lock_dir_for(PG)
    assert found is not None and found.parent == runtime / "effectguard", found


def test_a_directory_others_may_write_is_not_used(temp_dir: Path) -> None:
    base = temp_dir / f"effectguard-{os.getuid()}"
    base.mkdir()
    base.chmod(0o777)
    assert lock_dir_for(PG) is None


def test_a_link_in_the_place_of_the_directory_is_not_used(temp_dir: Path) -> None:
    elsewhere = temp_dir / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (temp_dir / f"effectguard-{os.getuid()}").symlink_to(elsewhere)
    assert lock_dir_for(PG) is None


def test_the_boot_names_the_subdirectory(temp_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    boot = temp_dir / "boot_id"
    boot.write_text("0b3c7a52-1f7e-4a49-9a8e-2d1b9b8c7d6e\n")
    monkeypatch.setattr(hostlocks, "BOOT_ID", boot)
    found = lock_dir_for(PG)
    assert found is not None and found.name == "pg-0b3c7a52-1f7e-4a49-9a8e-2d1b9b8c7d6e"
    boot.write_text("../../etc\n")  # never a path out of the directory
    found = lock_dir_for(PG)
    assert found is not None and found.name == "pg-unknown"


def test_a_lock_file_is_removed_only_while_nobody_holds_it(tmp_path: Path) -> None:
    """The sweeper removes a taken-over worker's file only holding its lock: a file its
    worker still holds is never removed from under it."""
    path = tmp_path / "w1.lock"
    with path.open("wb") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert not remove_if_free(tmp_path, "w1")
        assert path.exists()
    assert remove_if_free(tmp_path, "w1")
    assert not path.exists()
    assert not remove_if_free(tmp_path, "w1")  # gone already: nothing to do
