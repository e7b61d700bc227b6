"""A SQLite ledger on read-only storage: when its main file alone can be read, and how.

A WAL-mode database is read through its ``-shm`` index, which SQLite creates beside it
when missing; on a read-only filesystem it cannot, and every open fails with "unable to
open database file". A backup is such a file (``effectguard backup`` leaves it alone,
checkpointed), so a backup in a read-only snapshot or on read-only media could not even
be verified. SQLite reads a file without any index when told it is ``immutable``: no
locks, no ``-wal``, nothing but the main file. That is exact only where the main file
holds every commit and nothing changes it meanwhile: on a read-only filesystem, with no
``-wal`` beside it (or an empty one). A ``-wal`` holding frames would be passed over in
silence, its commits missing from what ``verify`` then calls a sound ledger; that case
is refused, saying why.

:func:`frozen_uri` is only consulted after the normal open failed, so opening a writable
ledger costs nothing more than it did.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from effectguard.errors import LedgerUnavailable

T = TypeVar("T")


def or_frozen(path: str, attempt: Callable[[str | None], T]) -> T:
    """``attempt(None)``, the normal way to the ledger at ``path``; where that fails
    (``sqlite3.OperationalError``) on read-only storage and reading the main file alone
    is exact, ``attempt`` with the URI that does (:func:`frozen_uri`). Anywhere else the
    first error is raised as it was."""
    try:
        return attempt(None)
    except sqlite3.OperationalError:
        frozen = frozen_uri(path)
        if frozen is None:
            raise
    return attempt(frozen)


def open_or_frozen(path: str, start: Callable[[str | None], T]) -> tuple[T, str | None]:
    """:func:`or_frozen` for the store's open: what ``start`` returned and the URI it was
    given (None: the normal open). A ``sqlite3.Error`` is ``LedgerUnavailable``."""
    try:
        return or_frozen(path, lambda frozen: (start(frozen), frozen))
    except sqlite3.Error as exc:
        raise LedgerUnavailable(f"cannot open ledger {path}: {exc}") from exc


def frozen_uri(path: str) -> str | None:
    """The URI that reads the ledger at ``path`` as immutable, where that is exact; None
    where its storage is writable (the normal open failed for another reason).

    Raises ``LedgerUnavailable`` where the storage is read-only but a ``-wal`` file beside
    the ledger holds commits that the main file may not.
    """
    file = Path(path).resolve()
    if not on_read_only_storage(str(file)):
        return None
    wal = Path(f"{file}-wal")
    try:
        wal_bytes = wal.stat().st_size
    except FileNotFoundError:
        wal_bytes = 0
    if wal_bytes:
        index = "" if Path(f"{file}-shm").exists() else " without its -shm index"
        raise LedgerUnavailable(
            f"cannot read ledger {path}: it is on a read-only filesystem with a {wal.name} "
            f"file{index}, whose commits SQLite cannot read there (and reading the main "
            "file alone would leave them out); copy the ledger and its -wal file to "
            "writable storage and read the copy there"
        )
    return f"{file.as_uri()}?mode=ro&immutable=1"


def on_read_only_storage(path: str) -> bool:
    """Whether the file at ``path`` is on a filesystem mounted read-only (a snapshot,
    read-only media): nothing can change it, nor create a file beside it."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def connect_frozen(uri: str) -> sqlite3.Connection:
    """A connection reading the ledger through ``uri`` (:func:`frozen_uri`).

    SQLite refuses every write through it ("attempt to write a readonly database"), so
    the journal mode and ``synchronous`` setting, which only concern writes, are not
    asked for (an immutable file reports journal mode ``delete``).
    """
    return sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
