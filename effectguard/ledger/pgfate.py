"""What became of a PostgreSQL batch whose connection was lost after it wrote.

The lost transaction may still be running on the server, committing or rolling back.
It holds the batch lock until it ends, so a fresh connection that takes the lock sees
its outcome: the batch committed exactly when its last event is in the ledger, with
the digest the batch computed (a sequence number another batch took carries another
digest). An archive may have moved that event already, so both tables are looked in.
"""

from __future__ import annotations

from typing import Any

from effectguard.ledger.pgdriver import psycopg

_DIGEST_AT = (
    "SELECT digest FROM events WHERE seq = %s "
    "UNION ALL SELECT digest FROM archived_events WHERE seq = %s"
)


def committed(conn: psycopg.Connection[Any], batch_key: int, last: tuple[int, str]) -> bool:
    """Whether the batch whose last event was ``last`` (seq, digest) committed, read on
    ``conn`` (a fresh autocommit connection) once no transaction holds ``batch_key``."""
    seq, digest = last
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (batch_key,))
        row = conn.execute(_DIGEST_AT, (seq, seq)).fetchone()
    return row is not None and str(row[0]) == digest
