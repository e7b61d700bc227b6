"""The PostgreSQL store's reader: one autocommit connection for every read a replica
makes outside its writer (calls, events, evidence, budgets, the sweeper, keys).

A read has no effect, so a read lost with its connection (the server restarted, a
failover, an operator's ``pg_terminate_backend``) is run once more on a new connection
instead of failing the request that made it. The server only tells a client its session
ended when the client next uses it, so without that second try the first read after
every lost connection failed: a keyed resend or a joining retry was answered 500. Inside
a :meth:`PgReader.snapshot` a read is never retried: its transaction died with the
connection, and a new one would not see the same state.

A read that gets no answer within :data:`READ_WAIT_S` is given up and its connection
closed (the next read opens a new one). A connection can go silent with no reset (a
middlebox that stopped forwarding, a server host that vanished: the kernel then waits
hours before it calls the connection dead), and every read of the replica queues
behind the one waiting on it: the sweeper would never take a dead worker over, so its
calls would hold their ``concurrency`` slots for as long as the silence lasted.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

from effectguard.errors import LedgerUnavailable
from effectguard.ledger.pgdriver import psycopg
from effectguard.ledger.pgschema import Target

#: How long one read may wait for its answer: far above any read effectguard makes (the
#: largest are operators' pages and scans), far below the hours a silent connection takes.
READ_WAIT_S = 60.0


class PgReader:
    """The reader connection of one :class:`~effectguard.ledger.postgres.PostgresStore`."""

    def __init__(self, target: Target, conn: psycopg.AsyncConnection[Any]) -> None:
        self._target = target
        self._conn = conn
        self._snapshot_lock = asyncio.Lock()
        self._reconnecting = asyncio.Lock()
        self._in_snapshot = False

    @classmethod
    async def open(cls, target: Target) -> PgReader:
        """A reader on a new connection to ``target``."""
        return cls(target, await target.aconnect())

    async def close(self) -> None:
        """Close the connection."""
        await self._conn.close()

    async def fetch(self, query: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Run ``query``; its rows. Raises :class:`LedgerUnavailable`."""
        conn = self._conn
        if conn.closed and not self._in_snapshot:  # known dead: reconnect first
            conn = await self._reconnect(conn)
        try:
            return await self._rows(query, params)
        except psycopg.OperationalError as exc:
            if not conn.closed or self._in_snapshot:
                raise LedgerUnavailable(f"ledger read failed: {exc}") from exc
        # The connection was lost under this read: once more, on a new one.
        await self._reconnect(conn)
        try:
            return await self._rows(query, params)
        except psycopg.Error as exc:
            raise LedgerUnavailable(f"ledger read failed: {exc}") from exc

    async def _reconnect(self, dead: psycopg.AsyncConnection[Any]) -> psycopg.AsyncConnection[Any]:
        """A new connection in place of ``dead``: one, when reads that met it at once ask."""
        async with self._reconnecting:
            if self._conn is dead:
                self._conn = await self._target.aconnect()
            return self._conn

    async def _rows(self, query: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        conn = self._conn
        try:
            return await asyncio.wait_for(self._answer(conn, query, params), READ_WAIT_S)
        except TimeoutError as exc:
            # Given up: the connection may be silent for good. Closed, it is replaced by
            # the next read, and the reads queued behind this one fail over to that.
            await conn.close()
            raise LedgerUnavailable(
                f"ledger read got no answer within {READ_WAIT_S:g} s; connection closed"
            ) from exc
        except psycopg.OperationalError:
            raise
        except psycopg.Error as exc:
            raise LedgerUnavailable(f"ledger read failed: {exc}") from exc

    @staticmethod
    async def _answer(
        conn: psycopg.AsyncConnection[Any], query: str, params: Sequence[Any]
    ) -> list[tuple[Any, ...]]:
        cursor = await conn.execute(query, params)
        return await cursor.fetchall()

    @contextlib.asynccontextmanager
    async def snapshot(self) -> AsyncIterator[None]:
        """Every read inside the block sees one committed state of the ledger."""
        async with self._snapshot_lock:
            await self._execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            self._in_snapshot = True
            try:
                await self.fetch("SELECT 1")
                yield
            finally:
                self._in_snapshot = False
                if not self._conn.closed:  # else the read that met it has raised
                    await self._execute("COMMIT")

    async def _execute(self, query: str) -> None:
        if self._conn.closed and not self._in_snapshot:
            await self._reconnect(self._conn)
        try:
            await self._conn.execute(query)
        except psycopg.Error as exc:
            raise LedgerUnavailable(f"ledger read failed: {exc}") from exc
