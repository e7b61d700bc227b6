"""Proxy keys kept in the ledger: the pure fold of ``key.created`` / ``key.revoked``.

A key row is what the proxy consults: the key's SHA-256 (never the key), its budget
root, and what ends or narrows it (revocation, expiry, allowed models and providers).
The store keeps one row per name as a fold of these events; ``effectguard verify``
re-derives it with its own code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Final

from effectguard.rules.events import Event, KeyCreated, KeyRevoked

_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/@:-]{0,99}")
_DIGEST: Final = re.compile(r"[0-9a-f]{64}")
#: The kinds this fold reads.
KINDS: Final = frozenset({KeyCreated.kind, KeyRevoked.kind})

#: What changes whenever a key row is written: how many rows, how many revoked, and the
#: sums of their creation, expiry and revocation times. A new name adds a row, a revocation
#: revokes one, and a new key under an ended key's name replaces its row with a later
#: creation time: each moves the counts or a sum, and two writes between reads would have
#: to cancel to the last bit of three sums of ledger times to leave all five as they were.
KeysStamp = tuple[int, int, float, float, float]


@dataclass(frozen=True, slots=True)
class LedgerKey:
    """One proxy key as the ledger knows it (times from the ledger's clock)."""

    name: str
    sha256: str
    budget_root: str
    created_at: float
    expires_at: float | None = None
    #: Models / providers it may call; None allows any.
    models: tuple[str, ...] | None = None
    providers: tuple[str, ...] | None = None
    revoked_at: float | None = None

    def ended(self, now: float) -> str | None:
        """Why the key no longer admits anything at ``now`` (revoked, expired), or None."""
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and now >= self.expires_at:
            return "expired"
        return None

    def allows_model(self, model: str | None) -> bool:
        """Whether the key may call ``model`` (a request naming none passes)."""
        return self.models is None or model is None or model in self.models

    def allows_provider(self, provider: str) -> bool:
        """Whether the key may call ``provider``."""
        return self.providers is None or provider in self.providers


def validate_name(name: str) -> str:
    """A key name: letters, digits and ``._/@:-``, up to 100 characters."""
    if not _NAME.fullmatch(name):
        raise ValueError(
            f"key name {name!r}: use letters, digits and . _ / @ : - (at most 100 characters)"
        )
    return name


def validate_digest(digest: str) -> str:
    """A lowercase hex SHA-256 digest."""
    if not _DIGEST.fullmatch(digest):
        raise ValueError("a key is stored as a lowercase hex SHA-256 digest")
    return digest


def apply(row: LedgerKey | None, event: Event, at: float) -> LedgerKey | None:
    """The key row after ``event`` (written at ``at``); other kinds leave it unchanged."""
    if isinstance(event, KeyCreated):
        return LedgerKey(
            name=event.name,
            sha256=event.sha256,
            budget_root=event.budget_root,
            created_at=at,
            expires_at=event.expires_at,
            models=None if event.models is None else tuple(event.models),
            providers=None if event.providers is None else tuple(event.providers),
        )
    if isinstance(event, KeyRevoked) and row is not None and row.revoked_at is None:
        return replace(row, revoked_at=at)
    return row


def key_name(event: Event) -> str | None:
    """The key name a key event changes (None for other kinds)."""
    if isinstance(event, KeyCreated | KeyRevoked):
        return event.name
    return None


def keys_stamp_of(rows: list[LedgerKey]) -> KeysStamp:
    """The :data:`KeysStamp` of ``rows``, as the stores' aggregate reads compute it."""
    revoked = [r.revoked_at for r in rows if r.revoked_at is not None]
    created = sum(r.created_at for r in rows)
    expires = sum(r.expires_at for r in rows if r.expires_at is not None)
    return (len(rows), len(revoked), float(created), float(expires), float(sum(revoked)))
