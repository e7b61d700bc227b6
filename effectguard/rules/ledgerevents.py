"""The events about the ledger rather than one call: proxy keys, writers, archive cuts.

Import them from :mod:`effectguard.rules.events`, which registers every kind.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from effectguard.rules.eventbase import Event


@dataclass(frozen=True, slots=True, kw_only=True)
class KeyCreated(Event):
    """An operator made proxy key ``name``: only its SHA-256 is stored, never the key.

    ``models`` / ``providers`` restrict what the key may call (None: anything);
    ``expires_at`` (seconds since the epoch) ends it like a revocation.
    """

    kind: ClassVar[str] = "key.created"
    name: str
    sha256: str
    budget_root: str
    expires_at: float | None = None
    models: list[str] | None = None
    providers: list[str] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class KeyRevoked(Event):
    """An operator revoked proxy key ``name``: it is refused from now on."""

    kind: ClassVar[str] = "key.revoked"
    name: str


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerRegistered(Event):
    """A process registered as a writer with a new fencing generation."""

    kind: ClassVar[str] = "worker.registered"
    worker: str
    generation: int
    host: str
    pid: int


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerTakenOver(Event):
    """A dead worker's lease was taken over; its writes are fenced from now on."""

    kind: ClassVar[str] = "worker.taken_over"
    worker: str
    generation: int
    by: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class LedgerArchived(Event):
    """Events ``first_seq..last_seq`` left the live ledger for an archive file.

    ``last_digest`` is the digest of event ``last_seq``: the first live event after the
    cut links to it. ``state`` is what the archived events leave behind for a verifier
    (workers, budget counters per period, policies, keys), so that ``verify`` can
    start at the cut; ``archive_sha256`` names the archive file's events.
    """

    kind: ClassVar[str] = "ledger.archived"
    first_seq: int
    last_seq: int
    prev_digest: str
    last_digest: str
    events: int
    calls: int
    keys: int
    archive: str
    archive_sha256: str
    state: dict[str, Any] = field(default_factory=dict)
