"""Write operations on proxy keys: create and revoke, each one event in the hash chain.

The keys table is kept by :func:`effectguard.ledger.operations.append` as a fold of
these events, like every other projection.
"""

from __future__ import annotations

from effectguard.errors import KeyChangeRefused
from effectguard.ledger.base import Tx, Writer
from effectguard.ledger.operations import append
from effectguard.rules import budget as budgets
from effectguard.rules import keys
from effectguard.rules.events import KeyCreated, KeyRevoked
from effectguard.rules.keys import LedgerKey


def create_key(tx: Tx, writer: Writer, event: KeyCreated) -> LedgerKey:
    """Record a new proxy key (its hash only); a name still in use is refused."""
    try:
        keys.validate_name(event.name)
        keys.validate_digest(event.sha256)
        budgets.validate_path(event.budget_root)
    except ValueError as exc:
        raise KeyChangeRefused(str(exc)) from exc
    now = tx.now()
    existing = tx.get_key(event.name)
    if existing is not None and existing.ended(now) is None:
        raise KeyChangeRefused(
            f"a key named {event.name!r} is in use; revoke it or choose another name"
        )
    if event.expires_at is not None and event.expires_at <= now:
        raise KeyChangeRefused("the expiry is not in the future")
    append(tx, writer, [event])
    row = tx.get_key(event.name)
    assert row is not None
    return row


def revoke_key(tx: Tx, writer: Writer, name: str) -> LedgerKey:
    """Revoke proxy key ``name``: every replica refuses it once its key cache refreshes."""
    row = tx.get_key(name)
    if row is None:
        raise KeyChangeRefused(f"no key named {name!r} in the ledger")
    if row.revoked_at is not None:
        raise KeyChangeRefused(f"key {name!r} is already revoked")
    append(tx, writer, [KeyRevoked(name=name)])
    revoked = tx.get_key(name)
    assert revoked is not None
    return revoked
