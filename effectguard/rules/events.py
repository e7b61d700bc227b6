"""Event records: what the ledger stores, append-only, hash-chained.

An ``Event`` is a frozen value (one dataclass per kind). The store wraps it in a
``StoredEvent`` with a gap-free sequence number, the writer's worker id and
fencing generation, the time it was written, its predecessor's digest and its
own. Money is integer nano-dollars; bodies are stored as text (rules/bodytext).

The kinds are defined by concept on :mod:`.eventbase`: a call's life (:mod:`.callevents`),
its money (:mod:`.budgetevents`) and the ledger itself (:mod:`.ledgerevents`). This
module registers them all and is where they are imported from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from effectguard.rules import budgetevents, callevents, ledgerevents
from effectguard.rules.budgetevents import (
    BudgetCorrected,
    BudgetHeld,
    BudgetLimitSet,
    BudgetReleased,
    BudgetReserved,
    BudgetSettled,
    BudgetUnheld,
)
from effectguard.rules.callevents import (
    AttemptInterrupted,
    AttemptLateAnswer,
    AttemptNotSent,
    AttemptObserved,
    AttemptStarted,
    CallCompleted,
    CallManifest,
    CallReconciled,
    CallRefused,
    CallResendAuthorized,
)
from effectguard.rules.canonical import canonical_json
from effectguard.rules.digest import event_digest
from effectguard.rules.eventbase import CallEvent, Event
from effectguard.rules.ledgerevents import (
    KeyCreated,
    KeyRevoked,
    LedgerArchived,
    WorkerRegistered,
    WorkerTakenOver,
)
from effectguard.rules.quickinit import quick_init

#: Every kind is importable from here, as are the digest helpers sealing uses.
__all__ = [
    "GENESIS_DIGEST",
    "AttemptInterrupted",
    "AttemptLateAnswer",
    "AttemptNotSent",
    "AttemptObserved",
    "AttemptStarted",
    "BudgetCorrected",
    "BudgetHeld",
    "BudgetLimitSet",
    "BudgetReleased",
    "BudgetReserved",
    "BudgetSettled",
    "BudgetUnheld",
    "CallCompleted",
    "CallEvent",
    "CallManifest",
    "CallReconciled",
    "CallRefused",
    "CallResendAuthorized",
    "Event",
    "KeyCreated",
    "KeyRevoked",
    "LedgerArchived",
    "StoredEvent",
    "WorkerRegistered",
    "WorkerTakenOver",
    "canonical_json",
    "event_digest",
    "event_from_data",
    "event_kinds",
    "seal",
    "stored_digest",
]

GENESIS_DIGEST = "0" * 64

_KINDS: dict[str, type[Event]] = {}


# Every kind of the modules above; events are built on every request's path, hence quick_init.
_KINDS.update(
    (cls.kind, quick_init(cls))
    for module in (callevents, budgetevents, ledgerevents)
    for cls in list(vars(module).values())
    if isinstance(cls, type)
    and issubclass(cls, Event)
    and cls.kind
    and cls.__module__ == module.__name__
)


def event_from_data(kind: str, data: dict[str, Any]) -> Event:
    """Rebuild a typed event from its stored kind and data."""
    try:
        cls = _KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown event kind {kind!r}") from None
    return cls(**data)


def event_kinds() -> frozenset[str]:
    """Every registered event kind."""
    return frozenset(_KINDS)


@quick_init
@dataclass(frozen=True, slots=True)
class StoredEvent:
    """An event as stored: numbered, attributed, timestamped and chained."""

    seq: int
    kind: str
    call_id: str | None
    data: dict[str, Any]
    worker: str
    generation: int
    at: float
    prev_digest: str
    digest: str
    #: ``(first, last)``: read from a stored record of events ``first..last`` that keeps
    #: one digest, ``last``'s (the others derived on read); None: its own digest is stored.
    #: Not part of the event: equal events compare equal whatever their record.
    record: tuple[int, int] | None = field(default=None, compare=False, repr=False)

    @property
    def event(self) -> Event:
        """The typed event."""
        return event_from_data(self.kind, self.data)


def stored_digest(e: StoredEvent) -> str:
    """The digest ``e``'s content and predecessor call for (what its ``digest`` must be)."""
    return event_digest(
        seq=e.seq,
        kind=e.kind,
        call_id=e.call_id,
        data_json=canonical_json(e.data),
        worker=e.worker,
        generation=e.generation,
        at=e.at,
        prev_digest=e.prev_digest,
    )


def seal(
    event: Event, *, seq: int, worker: str, generation: int, at: float, prev_digest: str
) -> tuple[StoredEvent, str]:
    """Number and chain ``event``; returns the stored event and its data JSON."""
    data = event.to_data()
    data_json = canonical_json(data)
    digest = event_digest(
        seq=seq,
        kind=event.kind,
        call_id=event.call_id,
        data_json=data_json,
        worker=worker,
        generation=generation,
        at=at,
        prev_digest=prev_digest,
    )
    stored = StoredEvent(
        seq=seq,
        kind=event.kind,
        call_id=event.call_id,
        data=data,
        worker=worker,
        generation=generation,
        at=at,
        prev_digest=prev_digest,
        digest=digest,
    )
    return stored, data_json
