"""Where an operator command may write a new file (``backup``, ``archive``).

A new file goes where no file is, in a directory that exists, and never under a name
SQLite keeps beside the ledger (``LEDGER-wal``, ``-shm``, ``-journal``): SQLite would
take a backup written there for its own file, and truncate or delete it on the next open.

A command writes its file as ``.FILE.partial`` first (:func:`partial_of`) and holds it
(:class:`Held`) with an exclusive ``flock`` until it is done: the kernel drops the lock
when the process dies, so a partial file nobody holds was left by a command that
stopped, and one that is held belongs to a command running now (:func:`in_use`), which
a second command must neither remove nor reuse. For the moment between its creation and
its lock (microseconds, unless the command is stopped right there) a file looks left over;
a second command's advice then (verify it, else delete it) loses nothing, because a
command whose file was removed before it committed writes nothing (:meth:`Held.in_place`).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import BinaryIO

from effectguard.errors import ConfigError
from effectguard.ledger.sqlitefile import COMPANIONS


def new_file(path: str | Path, *, ledger: Path, command: str, what: str) -> Path:
    """``path`` as the target of ``command`` (which writes ``what``), or ``ConfigError``."""
    if not str(path):
        raise ConfigError(f"{command} needs a file name")
    target = Path(path)
    resolved = target.resolve()
    home = ledger.resolve()
    for suffix in COMPANIONS:  # whether SQLite has one there right now or not
        if resolved == home.with_name(home.name + suffix):
            raise ConfigError(
                f"{target} is the ledger's own {suffix} file: SQLite would overwrite or "
                f"delete {what} written there"
            )
    if target.exists() or target.is_symlink():
        raise ConfigError(f"{target} exists; {what} never overwrites a file")
    if not resolved.parent.is_dir():
        raise ConfigError(f"{command}: directory {target.parent} does not exist")
    if not os.access(resolved.parent, os.W_OK):
        raise ConfigError(f"{command}: cannot write in {target.parent}")
    return target


def partial_of(target: Path) -> Path:
    """Where ``backup`` and ``archive`` write ``target`` before renaming it into place."""
    return target.with_name(f".{target.name}.partial")


class Held:
    """A new file this process writes, locked (``flock``) until :meth:`close`."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        #: The file, open for writing at its start (buffered: flush it before an fsync).
        self.file: BinaryIO = os.fdopen(fd, "r+b")

    def in_place(self) -> bool:
        """Whether ``path`` still names this file (nobody removed or replaced it)."""
        return _same_file(self.path, self.file.fileno())

    def close(self) -> None:
        """Close the file, which drops the lock."""
        self.file.close()


def hold_new(path: Path, *, busy: str) -> Held:
    """Create ``path`` empty and owner-only (0600), and hold it, for a command to write:
    ``backup``'s and ``archive``'s files hold what the ledger holds (prompts, answers, key
    digests), which the ledger keeps owner-only too. Nothing may be there already, a
    symbolic link included: in a shared directory one planted there would have the copy
    written wherever it points. ``busy`` is the error when another process took ``path``
    in the moment between its creation and the lock."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        raise ConfigError(f"{path} exists; it is not overwritten") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        taken = not _same_file(path, fd)
    except BlockingIOError:
        taken = True
    if taken:
        os.close(fd)
        if not os.path.lexists(path):  # removed, not taken: no other command is running
            raise ConfigError(f"{path} was removed as this command created it: nothing was written")
        raise ConfigError(busy)
    return Held(path, fd)


def in_use(path: Path) -> bool:
    """Whether a running command holds the file at ``path`` (:class:`Held`)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:  # gone, a symbolic link, unreadable: nobody holds it as Held does
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # drops the shared lock taken to look
    return False


def remove_left_over(path: Path, *, busy: str) -> None:
    """Remove the file at ``path`` that a command which stopped left there; ``busy`` is
    the error when a running command holds it. Removed only while this process holds
    its lock, so a file another process has just made and holds is never removed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return
    except OSError:  # a symbolic link (or no file we can open): never ours to lock
        path.unlink(missing_ok=True)  # removes the link itself, never what it names
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if _same_file(path, fd):
            path.unlink()
    except BlockingIOError:
        raise ConfigError(busy) from None
    finally:
        os.close(fd)


def _same_file(path: Path, fd: int) -> bool:
    try:
        named = os.lstat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)
