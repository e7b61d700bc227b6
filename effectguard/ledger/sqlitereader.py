"""The SQLite ledger's read connection, on its own thread so reads never block the loop.

Reads use a second connection (WAL lets them run beside the writer), so operator
queries and metrics scrapes never queue behind writes. The connection lives on
one daemon thread (:mod:`effectguard.ledger.daemonthreads`), so a program that never
closes its ledger (or its transport) still exits, even while a read is under way, and
a thread still reading after the main thread returned is served.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from effectguard.ledger.daemonthreads import DaemonThreads
from effectguard.ledger.sqlitefrozen import connect_frozen

T = TypeVar("T")


class SqliteReader:
    """One read-only-by-use ``sqlite3`` connection, used from one worker thread."""

    def __init__(self, path: str, busy_timeout_ms: int, frozen: str | None = None) -> None:
        self.path = path
        # The URI reading a ledger on read-only storage as it lies (sqlitefrozen), if so.
        self._frozen = frozen
        self._busy_timeout_ms = busy_timeout_ms
        self._pool: DaemonThreads | None = None
        self._conn: sqlite3.Connection | None = None

    async def open(self) -> None:
        """Open the connection on the worker thread."""
        self._pool = DaemonThreads(1, "effectguard-reader")
        self._conn = await self._run(self._connect)

    def _connect(self) -> sqlite3.Connection:
        # One worker means one thread; check_same_thread would only guard against a
        # second worker that the pool never starts.
        if self._frozen is not None:
            return connect_frozen(self._frozen)
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        conn.execute(f"PRAGMA busy_timeout = {self._busy_timeout_ms}")
        return conn

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        """Every row of ``sql``; raises ``sqlite3.Error`` as the driver does."""
        conn = self._conn
        if conn is None:
            raise sqlite3.ProgrammingError("the ledger's reader is closed")
        return await self._run(lambda: conn.execute(sql, tuple(params)).fetchall())

    async def close(self) -> None:
        """Close the connection and stop the worker thread."""
        conn, self._conn = self._conn, None
        if conn is not None:
            await self._run(conn.close)
        if self._pool is not None:
            pool, self._pool = self._pool, None
            pool.shutdown(wait=False)
            await pool.ended()

    async def _run(self, job: Callable[[], T]) -> T:
        assert self._pool is not None
        return await asyncio.get_running_loop().run_in_executor(self._pool, job)
