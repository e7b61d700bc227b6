"""Whether a ledger's migrations are this release's: the rule every command but
``migrate`` and ``serve`` applies before it opens a ledger (docs/operations.md,
"Upgrades and migrations").

Opening a store applies its pending migrations. A command that only reads (``calls``,
``verify``) or decides one call (``reconcile``) must not do that on the side: since
writer format 1 a migration can lock every replica of an older release out of the ledger
(:mod:`.writerformat`), so an operator trying the new release's CLI against a live fleet
would stop it. Such a command is refused instead, and so is one on a ledger that a newer
release migrated (it could misread what that release writes).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from effectguard.errors import ConfigError

log = logging.getLogger("effectguard.ledger")


def check_current(shown: str, applied: Iterable[int], known: Iterable[int]) -> None:
    """Refuse (``ConfigError``) the ledger ``shown`` unless its ``applied`` migrations are
    exactly the ``known`` ones of this release."""
    done, ours = set(applied), set(known)
    check_not_newer(shown, done, ours)
    pending = sorted(ours - done)
    if pending:
        raise ConfigError(
            f"ledger {shown} is behind this release (migration {', '.join(map(str, pending))} "
            f"pending): stop its older replicas, then run `effectguard migrate --ledger "
            f"{shown}` (docs/operations.md, Upgrades and migrations)"
        )


def check_not_newer(shown: str, applied: Iterable[int], known: Iterable[int]) -> None:
    """Refuse (``ConfigError``) the ledger ``shown`` if a newer release migrated it: the
    rule ``serve`` and ``migrate`` apply too, so that a rollback is refused before anything
    is written, whether or not that release's migration raised the writer format."""
    newer = sorted(set(applied) - set(known))
    if newer:
        raise ConfigError(
            f"ledger {shown} was migrated by a newer effectguard (migration "
            f"{', '.join(map(str, newer))} is not this release's): use that release or a later one"
        )


def migrated(before: Iterable[int], after: Iterable[int]) -> str:
    """What ``effectguard migrate`` did, from the migrations applied ``before`` and ``after``."""
    was, now = set(before), sorted(set(after))
    done = [v for v in now if v not in was]
    at = f"migration {now[-1]}" if now else "no migration"
    if not done:
        return f"up to date at {at}; nothing applied"
    if not was:
        return f"created: {len(done)} migrations applied, now at {at}"
    return f"migration {', '.join(map(str, done))} applied, now at {at}"


def announce(applied: Iterable[tuple[int, str]]) -> None:
    """Log each migration (version, name) applied to a ledger an earlier release made: one
    that raises the writer format locks that release's replicas out, so ``serve`` says so."""
    for version, name in applied:
        log.info(
            "ledger migration %d applied: %s",
            version,
            name,
            extra={"event": "ledger_migrated", "migration": version},
        )
