"""The PostgreSQL ledger: a fleet of replicas on one database, the same rules as SQLite.

Writes run on one thread per replica with a synchronous psycopg 3 connection
(:class:`~effectguard.ledger.groupcommit.GroupCommitter`), in autocommit mode
with explicit ``BEGIN``/``SAVEPOINT``/``COMMIT``. Each batch starts with
``pg_advisory_xact_lock``: batches of every replica are serialized, so the
single hash chain, the budget counters and the idempotency keys are read and
written by one transaction at a time (no overshoot, no duplicate key, no fork in
the chain). The lock is released by ``COMMIT``; a batch of many operations is
one lock hold and one commit. The primary key on ``events.seq`` and the unique
index on ``(budget_root, idempotency_key)`` stay as store-side safety nets.

Round trips are the cost on PostgreSQL (~50 µs each on loopback, more under
load), so a batch sends few: writes are buffered and go as one multi-row
statement per table together with ``COMMIT``, and point reads are answered from
what the batch already read or wrote — sound because the lock keeps every other
writer out until ``COMMIT`` (see :class:`PostgresSession`).

The clock is the database's (``effectguard_now()``, that is ``clock_timestamp()``,
read right after the lock is taken, once per batch), so leases, periods and rate
windows compare times from one clock and clock skew between replica hosts cannot
give a worker's calls two owners. ``effectguard_now()`` adds the ledger's
``clock_offset``, which is 0 except where a test moved it
(:mod:`effectguard.testing.pgclock`); opening a store with a non-zero offset logs a
warning.

Reads use a separate :class:`psycopg.AsyncConnection` in autocommit mode, so
operator queries and metrics scrapes never queue behind writes. Lease renewals use a
third, opened at the first heartbeat, so a heartbeat never waits behind the writer's
queue (:mod:`effectguard.ledger.pglease`); where it cannot be opened or used (no
connection slot left), the renewal goes through the writer as before.

Schema: ``postgresql://…/db?schema=NAME`` keeps the ledger in schema ``NAME``
(created by the migrations); without it the connection's ``search_path``
decides (``options=-csearch_path%3DNAME`` works too). Advisory-lock keys are
derived from the schema, so ledgers in different schemas do not serialize
against each other.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar

from effectguard.errors import LedgerUnavailable
from effectguard.ledger import operations
from effectguard.ledger.base import Operation, Orphaned, Writer, probe
from effectguard.ledger.groupcommit import GroupCommitter
from effectguard.ledger.pgdriver import psycopg
from effectguard.ledger.pglease import LeaseConnection
from effectguard.ledger.pgreader import PgReader
from effectguard.ledger.pgschema import Target, migrate, redacted
from effectguard.ledger.pgsession import CLOCK, PostgresSession
from effectguard.ledger.queries import POSTGRES
from effectguard.ledger.sqlreads import SqlReads

__all__ = ["PostgresSession", "PostgresStore", "Target", "migrate", "redacted"]

T = TypeVar("T")

log = logging.getLogger("effectguard.ledger")


class PostgresStore(SqlReads):
    """A ledger in a PostgreSQL database, shared by any number of replicas."""

    queries = POSTGRES

    def __init__(self, url: str) -> None:
        self.url = url
        self.target = Target.parse(url)
        self._writer: GroupCommitter[PostgresSession] | None = None
        self._reader: PgReader | None = None
        self._lease = LeaseConnection(self.target)
        self._lease_failing = False  # its failure was logged: not again until it works
        #: Why the writer refuses the ledger (a newer release migrated it), once it does:
        #: the lease is no longer renewed (:meth:`renew_lease`). Set on the writer thread.
        self._refused: str | None = None

    @property
    def committer(self) -> GroupCommitter[PostgresSession]:
        """The group committer (for commit statistics)."""
        if self._writer is None:
            raise LedgerUnavailable(f"ledger {redacted(self.url)} is not open")
        return self._writer

    async def open(self) -> None:
        writer = GroupCommitter(
            lambda: PostgresSession(self.target, on_newer=self._refuse),
            operations.check_writer,
            name="effectguard-pg-writer",
        )
        try:
            writer.start()
        except psycopg.Error as exc:
            raise LedgerUnavailable(f"cannot open ledger {redacted(self.url)}: {exc}") from exc
        self._writer = writer
        try:
            self._reader = await PgReader.open(self.target)
        except BaseException:
            writer.stop()
            self._writer = None
            raise

    async def close(self) -> None:
        await self._lease.close()
        if self._reader is not None:
            await self._reader.close()
            self._reader = None
        if self._writer is not None:
            writer, self._writer = self._writer, None
            await writer.aclose()

    async def write(self, writer: Writer, op: Operation[T], orphaned: Orphaned | None = None) -> T:
        return await self.committer.submit(writer, op, orphaned)

    def _refuse(self, why: str | None) -> None:
        self._refused = why

    async def renew_lease(self, writer: Writer, lease_s: float) -> float:
        if self._refused is not None:
            # This process writes nothing more: its calls in flight can never be recorded
            # by it. Left to lapse, its lease lets another replica's sweeper take them
            # over (effect_unknown), as it would a dead replica's, instead of their
            # staying in flight, renewed on the lease's own connection, until it stops.
            raise LedgerUnavailable(f"lease not renewed: {self._refused}")
        try:
            expires = await self._lease.renew(writer, lease_s)
        except LedgerUnavailable as exc:
            if not self._lease_failing:
                log.warning(
                    "lease renewal could not use its own connection (%s); renewing through "
                    "the writer, behind its queued writes",
                    exc,
                    extra={"event": "lease_connection_failed"},
                )
                self._lease_failing = True
            return await self.write(writer, lambda tx: operations.heartbeat(tx, writer, lease_s))
        self._lease_failing = False
        return expires

    async def clock_now(self) -> float:
        return float((await self._fetch(CLOCK))[0][0])

    async def _fetch(self, query: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return await self._opened_reader().fetch(query, params)

    @contextlib.asynccontextmanager
    async def snapshot(self) -> AsyncIterator[None]:
        async with self._opened_reader().snapshot():
            yield

    def _opened_reader(self) -> PgReader:
        if self._reader is None:
            raise LedgerUnavailable(f"ledger {redacted(self.url)} is not open")
        return self._reader

    async def writable(self) -> bool:
        if not self.committer.stats.last_ok:  # a probe commits even where real writes fail
            return False
        try:
            await self.committer.submit(Writer("healthz", 0), probe)
        except Exception:
            return False
        return True
