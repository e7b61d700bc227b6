"""Where a SQLite ledger's file is, how it is created (owner-only), and whether a file is one."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

from effectguard.errors import ConfigError, LedgerUnavailable
from effectguard.ledger import sqlitefrozen, versions
from effectguard.ledger.sqliteconnect import BUSY_TIMEOUT_MS
from effectguard.rules.urltext import redacted


def file_identity(path: str) -> tuple[int, int]:
    """The file at ``path`` (device and inode): a replaced file is another one."""
    stat = os.stat(path)
    return stat.st_dev, stat.st_ino


def sqlite_path(url: str) -> str:
    """The file path of a ``sqlite:///path`` URL or a plain path."""
    if url.startswith("sqlite:///"):
        # sqlite:///relative/path, sqlite:////absolute/path (as SQLAlchemy reads them).
        return url[len("sqlite:///") :]
    if "://" in url:
        raise ConfigError(f"not a SQLite ledger: {redacted(url)!r}")
    return url


def create_owner_only(path: str) -> None:
    """Create the ledger file readable by its owner only (it holds prompts and responses),
    in a directory that must exist (``ConfigError`` otherwise).

    SQLite gives the ``-wal`` and ``-shm`` files the main file's permissions. An existing
    file is left as its owner set it.
    """
    parent = Path(path).parent
    if not parent.exists():
        raise ConfigError(f"ledger directory {parent} does not exist")
    if path == ":memory:" or path.startswith("file:"):
        return
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


#: How long a command waits at most for the tables of a ledger another program is creating.
CREATING_S = BUSY_TIMEOUT_MS / 1000
#: How recently that program must have written the file (or its ``-wal``) for the command
#: to wait: a creation writes every few milliseconds until its tables are made.
_CREATING_QUIET_S = 2.0
#: How often the command looks again meanwhile.
_CREATING_POLL_S = 0.02

#: The files SQLite keeps beside a database ``F``: ``F-wal`` and ``F-shm`` in WAL mode,
#: ``F-journal`` in rollback mode. SQLite overwrites, truncates or deletes them as it sees
#: fit, so nothing else may be written under those names.
COMPANIONS = ("-wal", "-shm", "-journal")


def check_ledger_place(path: str) -> None:
    """Refuse (``ConfigError``) a ``path`` where ``serve`` or ``migrate`` cannot make or open
    a ledger, before either starts anything.

    Unlike :func:`check_ledger_file`, a missing file is fine (it is created) and so is an
    empty database; but its directory must exist, and an existing file must be a SQLite
    database that is a ledger or holds no tables yet. Another program's database (tables,
    none of them ours) is refused rather than given a ledger's tables beside its own.
    Read only, through a read-only connection. A ledger on a read-only filesystem, which
    neither could write, is ``LedgerUnavailable``.
    """
    file = Path(path)
    if path == ":memory:" or path.startswith("file:"):
        return
    if not file.exists():
        parent = file.parent
        if not parent.is_dir():
            raise ConfigError(f"no directory {parent} for the ledger {path}")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise ConfigError(
                f"cannot create the ledger {path}: directory {parent} is not writable"
            )
        return
    if not file.is_file():
        raise ConfigError(f"ledger {path} is not a file (name the ledger's file, not a directory)")
    if sqlitefrozen.on_read_only_storage(path):
        # It can still be read (sqlitefrozen), which is no reason to serve or migrate it.
        raise LedgerUnavailable(f"cannot write ledger {path}: it is on a read-only filesystem")
    tables = _tables(path)
    if tables and "migrations" not in tables:
        shown = ", ".join(sorted(tables)[:3]) + (", ..." if len(tables) > 3 else "")
        raise ConfigError(
            f"{path} is another program's SQLite database (tables {shown}), not a ledger: "
            "name a new file"
        )


def _tables(path: str) -> set[str]:
    """The tables of the SQLite database at ``path`` (refused if it is none)."""
    try:
        rows = _read(path, "SELECT name FROM sqlite_master WHERE type = 'table'")
    except sqlite3.OperationalError as exc:  # locked, unreadable: it may be a ledger
        raise LedgerUnavailable(f"cannot read ledger {path}: {exc}") from exc
    except sqlite3.DatabaseError as exc:
        raise ConfigError(f"{path} is not a SQLite database ({exc}): no ledger there") from exc
    return {row[0] for row in rows}


def _tables_made(path: str) -> set[str]:
    """The tables of the SQLite database at ``path``, once another program that is creating
    a ledger there has made them.

    ``serve``, ``migrate`` and a transport create a ledger as an empty file, then give it
    its tables in one transaction, so a command run at that moment found the file without
    them, and said it was "not an effectguard ledger" (tests/test_ledger_creation). A file
    without tables is read again while it (or its ``-wal``) was written in the last
    :data:`_CREATING_QUIET_S`, for up to :data:`CREATING_S`; one left alone longer (an
    empty file its owner made) is what it is.
    """
    deadline = time.monotonic() + CREATING_S
    while True:
        tables = _tables(path)
        if tables or time.monotonic() >= deadline or not _just_written(path):
            return tables
        time.sleep(_CREATING_POLL_S)


def _just_written(path: str) -> bool:
    """Whether the file at ``path`` or its ``-wal`` was written in the last moments."""
    latest = 0.0
    for name in (path, path + "-wal"):
        with contextlib.suppress(FileNotFoundError):
            latest = max(latest, os.stat(name).st_mtime)
    return abs(time.time() - latest) < _CREATING_QUIET_S


def check_ledger_file(path: str, *, current: bool = True) -> None:
    """Refuse (``ConfigError``) a ``path`` that is not an effectguard SQLite ledger.

    The file is only read, through a read-only connection: opening a store on a file
    would migrate it, and so turn an empty file, or another application's database, into
    a ledger. A ledger is a SQLite database whose ``migrations`` table
    (:func:`~effectguard.ledger.sqliteschema.migrate`) exists. With ``current``, its
    migrations must be this release's (:func:`~effectguard.ledger.versions.check_current`);
    ``backup`` copies an older ledger too (the first step of an upgrade).
    """
    file = Path(path)
    if not file.exists():
        raise ConfigError(
            f"no ledger at {path} (use --ledger; `effectguard serve` or `effectguard migrate` "
            "creates one)"
        )
    if not file.is_file():
        raise ConfigError(f"{path} is not a file: no ledger there (use --ledger)")
    if "migrations" not in _tables_made(path):
        raise ConfigError(
            f"{path} is not an effectguard ledger (effectguard migrate --ledger PATH makes one)"
        )
    if not current:
        return
    from effectguard.ledger.sqliteschema import MIGRATIONS

    versions.check_current(path, _applied(path), (m[0] for m in MIGRATIONS))


def applied_versions(path: str) -> list[int]:
    """The migrations applied to the ledger at ``path``, read only; none where there is no
    ledger yet (no file, or one without a ``migrations`` table)."""
    if not Path(path).is_file() or "migrations" not in _tables(path):
        return []
    return _applied(path)


def _applied(path: str) -> list[int]:
    """The migrations applied to the ledger at ``path``, read through a read-only connection."""
    try:
        return [int(row[0]) for row in _read(path, "SELECT version FROM migrations")]
    except sqlite3.Error as exc:  # locked, unreadable: it may be a ledger
        raise LedgerUnavailable(f"cannot read ledger {path}: {exc}") from exc


def _read(path: str, sql: str) -> list[Any]:
    """The rows of ``sql`` on the database at ``path``, through a read-only connection
    (on read-only storage, one that reads the main file alone where that is exact:
    :mod:`~effectguard.ledger.sqlitefrozen`)."""
    read_only = f"{Path(path).resolve().as_uri()}?mode=ro"
    return sqlitefrozen.or_frozen(path, lambda frozen: _rows(frozen or read_only, sql))


def _rows(uri: str, sql: str) -> list[Any]:
    conn = sqlite3.connect(uri, uri=True, timeout=5.0)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()
