"""A PostgreSQL worker's lease renewals, on a connection of their own.

A heartbeat used to be one more operation in the writer's queue
(:class:`~effectguard.ledger.groupcommit.GroupCommitter`), so it waited for every batch
queued before it. A replica recording a few large answers (20 MB event streams: each
observation a 20 MB statement) kept its writer busy for longer than the lease, the
heartbeat waited behind them, and another replica's sweeper took the healthy replica
over: its calls in flight became ``effect_unknown`` and their answers were refused
(502 ``observe_refused``). A renewal is one statement on one row, which needs neither the
batch lock nor the chain, so it runs here, beside the writer, on the first heartbeat.

It is the heartbeat of :func:`effectguard.ledger.operations.heartbeat` as one statement:
the row is renewed only while it is this registration's and not fenced, so a fence
committed first makes it renew nothing (:class:`FencedError`, as before), and a renewal
committed first is overwritten by the fence (a sweep decides on what it read under the
batch lock). The lease is counted from the ledger's clock, as every batch counts it.
"""

from __future__ import annotations

from effectguard.errors import FencedError
from effectguard.ledger.base import Writer
from effectguard.ledger.pgreader import PgReader
from effectguard.ledger.pgschema import CLOCK_FUNCTION, Target

#: Renews a registration's lease unless it was fenced or replaced; the new expiry.
RENEW = (
    f"UPDATE workers SET lease_expires = {CLOCK_FUNCTION}() + %s "
    "WHERE worker = %s AND generation = %s AND NOT fenced RETURNING lease_expires"
)


class LeaseConnection:
    """The connection a replica renews its lease on, opened at its first renewal (a
    command that never heartbeats never opens it)."""

    def __init__(self, target: Target) -> None:
        self._target = target
        self._conn: PgReader | None = None

    async def renew(self, writer: Writer, lease_s: float) -> float:
        """Renew ``writer``'s lease; its new expiry (ledger clock). :class:`FencedError`
        when the store no longer takes this registration's writes; ``LedgerUnavailable``
        when the renewal could not be made here (a lost connection is tried once more
        on a new one: renewing twice only moves the expiry to the later clock)."""
        if self._conn is None:
            self._conn = await PgReader.open(self._target)
        rows = await self._conn.fetch(RENEW, (lease_s, writer.worker, writer.generation))
        if not rows:
            raise FencedError(f"worker {writer.worker} was fenced")
        return float(rows[0][0])

    async def close(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            await conn.close()
