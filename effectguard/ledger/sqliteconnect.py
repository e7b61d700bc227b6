"""How a SQLite ledger file is opened: with WAL and ``synchronous=FULL``, or not at all.

``connect`` refuses to run without both; :mod:`~effectguard.ledger.sqliteschema` makes
the tables on the connection it gives.
"""

from __future__ import annotations

import sqlite3
import time

from effectguard.errors import LedgerCorrupt
from effectguard.ledger import writerformat

BUSY_TIMEOUT_MS = 5000
#: The first and the longest pause between tries of the switch to WAL (see _switch_to_wal).
_WAL_PAUSE_S = (0.001, 0.05)


def connect(path: str) -> sqlite3.Connection:
    """A connection to the ledger file at ``path`` (SQLite creates a missing one), in WAL
    mode with ``synchronous=FULL``, declaring this release's writer format; refused
    (``LedgerCorrupt``) where SQLite will not give both."""
    conn = sqlite3.connect(
        path, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_MS / 1000
    )
    conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    writerformat.declare_sqlite(conn)  # the ledger refuses writes from older releases
    try:
        _switch_to_wal(conn)
    except BaseException:
        conn.close()
        raise
    conn.execute("PRAGMA synchronous = FULL")
    mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
    sync = conn.execute("PRAGMA synchronous").fetchone()[0]
    if str(mode).lower() != "wal" or int(sync) != 2:
        conn.close()
        raise LedgerCorrupt(
            f"{path}: refusing to run without WAL and synchronous=FULL "
            f"(got journal_mode={mode}, synchronous={sync})"
        )
    return conn


def _switch_to_wal(conn: sqlite3.Connection) -> None:
    """Switch the file to WAL (nothing to do where it is already), waiting up to the busy
    timeout for other connections' locks.

    SQLite does not call the busy handler for the switch: where another program holds a
    lock on a file still in rollback mode (it is creating the same new ledger), the switch
    failed at once with "database is locked", and of two ``serve`` replicas started
    together on a new path, one did not start.
    """
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    pause, longest = _WAL_PAUSE_S
    while True:
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            busy = exc.sqlite_errorcode & 0xFF == sqlite3.SQLITE_BUSY
            if not busy or time.monotonic() >= deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, longest)
