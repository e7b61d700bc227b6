"""Proxy keys kept in the ledger: the pure fold of ``key.created`` / ``key.revoked``.

A key row is what the proxy consults: the key's SHA-256 (never the key), its budget
root, and what ends or narrows it (revocation, expiry, allowed models and providers).
The store keeps one row per name as a fold of these events; ``effectguard verify``
re-derives it with its own code.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Final

from effectguard.rules.events import Event, KeyCreated, KeyRevoked, StoredEvent

_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/@:-]{0,99}")
_DIGEST: Final = re.compile(r"[0-9a-f]{64}")
#: The kinds this fold reads.
KINDS: Final = frozenset({KeyCreated.kind, KeyRevoked.kind})


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


def folded(rows: Mapping[str, LedgerKey], events: Iterable[StoredEvent]) -> dict[str, LedgerKey]:
    """``rows`` (by name) with the key ``events`` folded in, in their order, as the store
    folds them (:func:`apply`). Folding again an event the rows already hold, with every
    later one after it, leaves them as they were: a copy read while keys were written
    comes right by folding the events from a seq read before it."""
    out = dict(rows)
    for stored in events:
        event = stored.event
        name = key_name(event)
        if name is None:
            continue
        row = apply(out.get(name), event, stored.at)
        if row is not None:
            out[name] = row
    return out


def by_digest(rows: Iterable[LedgerKey]) -> dict[str, tuple[LedgerKey, ...]]:
    """``rows`` grouped by key digest (a secret made twice under two names has two)."""
    grouped: dict[str, tuple[LedgerKey, ...]] = {}
    for row in rows:
        grouped[row.sha256] = (*grouped.get(row.sha256, ()), row)
    return grouped


def regrouped(
    grouped: Mapping[str, tuple[LedgerKey, ...]],
    before: Mapping[str, LedgerKey],
    changed: Iterable[LedgerKey],
) -> dict[str, tuple[LedgerKey, ...]]:
    """:func:`by_digest` of ``before`` with the ``changed`` rows (by name) in place, from
    ``grouped`` (:func:`by_digest` of ``before``), in time proportional to the change."""
    out = dict(grouped)
    for row in changed:
        old = before.get(row.name)
        for digest in {row.sha256, *(() if old is None else (old.sha256,))}:
            kept = tuple(r for r in out.get(digest, ()) if r.name != row.name)
            out[digest] = (*kept, row) if digest == row.sha256 else kept
            if not out[digest]:
                del out[digest]
    return out
