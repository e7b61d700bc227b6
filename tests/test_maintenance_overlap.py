"""Two maintenance commands at once on one SQLite ledger, as a tired operator runs them.

``backup`` and ``archive`` write ``.FILE.partial`` and rename it once done. A second
command that met that file took it for one a killed command left: a second backup to the
same name deleted the first one's copy under it (and overwrote its result), and a second
archive told the operator to delete a file whose events the first archive was about to
delete from the ledger. The first command here is paused mid-write with SIGSTOP (the
operator's Ctrl-Z, a stalled disk), so that the overlap does not depend on timing.
"""

from __future__ import annotations

import fcntl
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from observing import call_stages
from test_archive import cli, later, verify

from effectguard.ops.cli import main
from effectguard_bench.recoverybench import build_ledger

pytestmark = pytest.mark.slow

CALLS = 3000  # completed calls (plus 8 in flight): enough that writing a copy takes a while
#: How often a command that finished before it could be paused is run again.
TRIES = 10


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ledger of ``CALLS`` completed calls, built once and copied by each test."""
    path = tmp_path_factory.mktemp("built") / "ledger.db"
    build_ledger(path, CALLS)
    return path


@pytest.fixture
def ledger(built: Path, tmp_path: Path) -> Path:
    """A fresh copy of the built ledger (no proxy has it open: no WAL beside it)."""
    path = tmp_path / "ledger.db"
    path.write_bytes(built.read_bytes())
    return path


def start(*args: str) -> subprocess.Popen[str]:
    """``python -m effectguard ARGS`` in a process of its own."""
    command = [sys.executable, "-m", "effectguard", *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@dataclass
class Paused:
    """A command paused while it writes ``partial``; ``result`` once it has run on."""

    partial: Path
    result: tuple[int, str] | None = None  # (exit code, stderr)


@contextmanager
def paused_while_writing(args: list[str], partial: str, tmp_path: Path) -> Iterator[Paused]:
    """Run ``args`` and SIGSTOP it once its partial file (glob ``partial``) is there;
    resume it after the block and wait for it. A run that finished before it could be
    paused is run again, on a new name (``{n}`` in ``args`` and ``partial``)."""
    for n in range(TRIES):
        process = start(*(a.replace("{n}", str(n)) for a in args))
        held = _stop_once_held(process, tmp_path, partial.replace("{n}", str(n)))
        if held is not None:
            paused = Paused(held)
            try:
                yield paused
            finally:
                process.send_signal(signal.SIGCONT)
                _, err = process.communicate(timeout=120)
                paused.result = (process.returncode, err)
            return
        process.kill()
        process.communicate()
        time.sleep(0.01)
    pytest.fail(f"{args[0]} finished every time before it could be paused")


def _stop_once_held(process: subprocess.Popen[str], tmp_path: Path, pattern: str) -> Path | None:
    """SIGSTOP ``process`` once the file it writes (glob ``pattern``) is there and locked;
    None if it finished first. A command creates its file, then locks it: stopped between
    the two (microseconds apart), it would look like one that died there, which is not
    the overlap these tests are about, so it is resumed and stopped again later."""
    while process.poll() is None:
        found = sorted(tmp_path.glob(pattern))
        if not found:
            continue
        process.send_signal(signal.SIGSTOP)
        if _locked(found[0]):
            return found[0]
        process.send_signal(signal.SIGCONT)
    return None


def _locked(path: Path) -> bool:
    """Whether a process holds ``path`` with an exclusive ``flock`` (False once it is gone)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_a_second_backup_to_the_same_name_is_refused_while_the_first_is_writing(
    ledger: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second backup to the name a running backup writes is refused (exit 2, naming
    it) and leaves its copy alone; the first then finishes a copy that verifies."""
    args = ["backup", "--ledger", str(ledger), str(tmp_path / "copy-{n}.db")]
    with paused_while_writing(args, ".copy-{n}.db.partial", tmp_path) as paused:
        partial = paused.partial
        target = partial.with_name(partial.name[1 : -len(".partial")])
        before = os.stat(partial)
        capsys.readouterr()
        code = main(["backup", "--ledger", str(ledger), str(target)])
        err = capsys.readouterr().err
        assert code == 2, err
        assert "another backup" in err and str(target) in err
        after = os.stat(partial)
        assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)
        assert not target.exists()
    assert paused.result is not None
    code, err = paused.result
    assert code == 0, err
    assert not list(tmp_path.glob(".copy-*"))
    code, report = verify(capsys, "--ledger", str(target))
    assert code == 0 and report["calls"] == CALLS + 8, report["problems"]


def test_a_backup_killed_midway_leaves_nothing_the_next_backup_trips_on(
    ledger: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What a SIGKILLed backup left (its partial copy, SQLite's journal beside it) is not
    a running backup's: the next backup to that name removes it and writes a copy that
    verifies."""
    target = tmp_path / "copy.db"
    (tmp_path / ".copy.db.partial").write_bytes(b"half a copy")
    (tmp_path / ".copy.db.partial-journal").write_bytes(b"its journal")
    capsys.readouterr()
    assert main(["backup", "--ledger", str(ledger), str(target)]) == 0
    assert not list(tmp_path.glob(".copy.db.partial*"))
    code, report = verify(capsys, "--ledger", str(target))
    assert code == 0 and report["calls"] == CALLS + 8, report["problems"]


def test_an_archive_never_deletes_events_whose_file_was_removed_while_it_wrote_it(
    ledger: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second archive while one is writing its file says that one is running (exit 2),
    not that the file is left over and may be deleted; and when the file is removed all
    the same, the first archive moves nothing: every call stays in the ledger, which
    verifies. It used to write its checkpoint into a new file of that name and delete
    the range from the ledger, its events nowhere."""
    args = ["archive", "--ledger", str(ledger), "--before", later()]
    args += ["--step-events", "10000000", "--out", str(tmp_path / "arch-{n}.jsonl.gz")]
    stages = call_stages(ledger)
    with paused_while_writing(args, ".arch-{n}.jsonl.gz.partial", tmp_path) as paused:
        partial = paused.partial
        assert _first_seq(ledger) == 1  # paused before its commit
        target = partial.with_name(partial.name[1 : -len(".partial")])
        again = ["archive", "--ledger", str(ledger), "--before", later(), "--out", str(target)]
        code, out = cli(capsys, *again)
        assert code == 2 and "another archive is running now" in out["err"], out
        assert "delete it" not in out["err"] and "verify --archive" not in out["err"]
        partial.unlink()  # a clean-up of dot files, or an operator, removes it anyway
    assert paused.result is not None
    code, err = paused.result
    # Paused after its file appeared: before its lock was checked (the file is gone at
    # the check), or after (the step finds its file gone before the commit).
    gone = "was removed as this command created it: nothing was written"
    assert code == 2 and ("archived nothing" in err or gone in err), err
    assert call_stages(ledger) == stages and _first_seq(ledger) == 1
    assert not list(tmp_path.glob("*arch-*"))
    code, report = verify(capsys, "--ledger", str(ledger))
    assert code == 0 and report["calls"] == CALLS + 8, report["problems"]


def _first_seq(ledger: Path) -> int:
    conn = sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)
    try:
        return int(conn.execute("SELECT min(seq) FROM events").fetchone()[0])
    finally:
        conn.close()


def test_an_archive_the_ledger_lock_stops_says_so_without_a_traceback(
    ledger: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An archive that cannot take the ledger's write lock (another program holds it
    past the busy wait) exits 4, ledger unavailable, and moves nothing; it used to end
    in the driver's traceback."""
    stages = call_stages(ledger)
    holder = sqlite3.connect(ledger, isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")
        code, out = cli(capsys, "archive", "--ledger", str(ledger), "--before", later())
    finally:
        holder.close()
    assert code == 4 and "database is locked" in out["err"], out
    assert call_stages(ledger) == stages
    code, report = verify(capsys, "--ledger", str(ledger))
    assert code == 0, report["problems"]


def test_a_file_removed_as_it_is_created_is_not_called_another_commands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A partial file removed between its creation and its lock is said to be removed,
    not held by another command: no other archive or backup is running (a CI run paused
    an archive exactly there, and its message named an archive that did not exist)."""
    import fcntl

    from effectguard.errors import ConfigError
    from effectguard.ops import outpath

    partial = tmp_path / ".copy.db.partial"
    real = fcntl.flock

    def removed_first(fd: int, operation: int) -> None:
        partial.unlink()  # what the test above does while the command is paused
        real(fd, operation)

    monkeypatch.setattr(outpath.fcntl, "flock", removed_first)
    with pytest.raises(ConfigError, match="was removed as this command created it"):
        outpath.hold_new(partial, busy="another command is writing it")
    assert not partial.exists()
