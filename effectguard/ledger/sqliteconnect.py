"""How a SQLite ledger file is opened: with WAL and ``synchronous=FULL``, or not at all.

``connect`` refuses to run without both; :mod:`~effectguard.ledger.sqliteschema` makes
the tables on the connection it gives.
"""

from __future__ import annotations

import sqlite3

from effectguard.errors import LedgerCorrupt
from effectguard.ledger import writerformat

BUSY_TIMEOUT_MS = 5000


def connect(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(
        path, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_MS / 1000
    )
    conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    writerformat.declare_sqlite(conn)  # the ledger refuses writes from older releases
    conn.execute("PRAGMA journal_mode = WAL")
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
