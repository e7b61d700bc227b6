"""Operator-page sessions ended by a logout: kept beside the ledger's events, never among them.

A login is a signed token that every replica accepts until it expires
(:mod:`effectguard.ingress.admin.session`). A logout must end it on every replica, so the
ledger, which they all read, keeps the ended ones in its table ``ended_sessions``
(SQLite migration 17, PostgreSQL migration 10): the SHA-256 of the token (never the token,
which would be a login to whoever reads the ledger) and when the token expires.

A logout is no effect: it spends nothing, decides no call and changes no key. So it is
not an event: it is outside the hash chain, and ``verify``, ``archive`` and a backup's
check are as they were. It is written through the store's committer, like every write:
on SQLite under ``BEGIN IMMEDIATE`` (the single writer, waited for off the loop), on
PostgreSQL in the batch that holds the fleet's batch lock, sent at once inside the
operation's savepoint as a key change is. It is durable before the logout is answered.

Each logout also deletes the rows whose token expired more than
:data:`KEPT_PAST_EXPIRY_S` ago (a token that has expired is refused anyway), so the table
holds about the sessions ended within the last ``session_hours``.
"""

from __future__ import annotations

from effectguard.ledger.base import Tx

#: How long past its expiry an ended token's row is kept. The expiry is the clock of the
#: replica that made the token, the deletion the ledger's (PostgreSQL: the database's):
#: kept this long, a replica whose clock runs behind still sees the token ended until its
#: own check finds it expired (session.CLOCK_SLACK_S allows a minute).
KEPT_PAST_EXPIRY_S = 3600.0

_HEX = frozenset("0123456789abcdef")

#: SQLite: two statements, run in the operation's savepoint.
SQLITE_PURGE = "DELETE FROM ended_sessions WHERE expires_at < ? AND token_sha256 <> ?"
SQLITE_INSERT = (
    "INSERT INTO ended_sessions(token_sha256, expires_at) VALUES (?, ?) "
    "ON CONFLICT(token_sha256) DO NOTHING"
)
#: PostgreSQL: one statement, one round trip (parameters: purge before, the digest twice,
#: the expiry). The purge spares the digest being inserted: one statement may not both
#: delete a row and find it in conflict.
POSTGRES_END = (
    "WITH purged AS (DELETE FROM ended_sessions WHERE expires_at < %s AND token_sha256 <> %s) "
    "INSERT INTO ended_sessions(token_sha256, expires_at) VALUES (%s, %s) "
    "ON CONFLICT (token_sha256) DO NOTHING"
)


def validate_digest(token_sha256: str) -> None:
    """Refuse anything but a SHA-256 in lowercase hex: the ledger never holds a token."""
    if len(token_sha256) != 64 or not _HEX.issuperset(token_sha256):
        raise ValueError("an ended session is stored by its token's SHA-256 (64 hex digits)")


def end_session(tx: Tx, token_sha256: str, expires_at: float) -> None:
    """The operation: record ``token_sha256`` as ended until ``expires_at``, and forget the
    ended tokens that expired long enough ago (by the ledger's clock)."""
    tx.put_ended_session(token_sha256, expires_at, tx.now() - KEPT_PAST_EXPIRY_S)
