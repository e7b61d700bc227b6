"""Event records: what the ledger stores, append-only, hash-chained.

An ``Event`` is a frozen value (one dataclass per kind). The store wraps it in a
``StoredEvent`` with a gap-free sequence number, the writer's worker id and
fencing generation, the time it was written, its predecessor's digest and its
own. Money is integer nano-dollars; bodies are stored as text (rules/bodytext).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, ClassVar

from effectguard.rules.canonical import canonical_json as canonical_json  # re-exported
from effectguard.rules.digest import event_digest as event_digest  # re-exported
from effectguard.rules.quickinit import quick_init

GENESIS_DIGEST = "0" * 64

_KINDS: dict[str, type[Event]] = {}


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """Base of every event kind. ``kind`` is the stable name stored in the ledger."""

    kind: ClassVar[str] = ""

    @property
    def call_id(self) -> str | None:
        """The call this event belongs to, if any."""
        return None

    def to_data(self) -> dict[str, Any]:
        """The event's fields as a JSON-ready dict (without ``kind``)."""
        names, values = _field_reader(type(self))
        return dict(zip(names, values(self), strict=True))


@dataclass(frozen=True, slots=True, kw_only=True)
class CallEvent(Event):
    """An event that belongs to one call."""

    call: str

    @property
    def call_id(self) -> str | None:
        return self.call


@dataclass(frozen=True, slots=True, kw_only=True)
class CallManifest(CallEvent):
    """What was intended: the request as admitted (secrets stripped)."""

    kind: ClassVar[str] = "call.manifest"
    request_hash: str
    provider: str
    endpoint: str
    method: str
    model: str | None
    idempotency_key: str | None
    budget: str
    budget_root: str
    effect_kind: str
    body: str
    body_encoding: str = "utf8"
    headers: dict[str, str] = field(default_factory=dict)
    stream: bool = False
    retry_of: str | None = None
    provider_idempotency_window_s: float | None = None
    at: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class CallRefused(CallEvent):
    """The guard refused the request before dispatch (no reservation made)."""

    kind: ClassVar[str] = "call.refused"
    reason: str
    status: int
    message: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetReserved(CallEvent):
    """``amount`` reserved on ``budget`` and all its ancestors."""

    kind: ClassVar[str] = "budget.reserved"
    budget: str
    amount: int
    #: The attempt's token estimate (prompt bytes + output bound), for ``tpm`` limits.
    tokens: int = 0
    #: The period of each ancestor budget that is not ``total``, fixed at admission.
    periods: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetSettled(CallEvent):
    """The reservation ``reserved`` is released and ``actual`` is spent."""

    kind: ClassVar[str] = "budget.settled"
    budget: str
    reserved: int
    actual: int
    flagged: str | None = None
    #: Input + output tokens the provider reported (None: not believed), for ``tpm``.
    tokens: int | None = None
    #: The period of each ancestor budget that is not ``total``, fixed at admission.
    periods: dict[str, str] = field(default_factory=dict)

    @property
    def overshoot(self) -> int:
        """How far the actual cost went past the reservation (0 if it did not)."""
        return max(0, self.actual - self.reserved)


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetReleased(CallEvent):
    """The reservation is released with nothing spent (not sent, not processed)."""

    kind: ClassVar[str] = "budget.released"
    budget: str
    amount: int
    #: The period of each ancestor budget that is not ``total``, fixed at admission.
    periods: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetHeld(CallEvent):
    """The effect is unknown: the reservation moves to ``held``."""

    kind: ClassVar[str] = "budget.held"
    budget: str
    amount: int
    #: The period of each ancestor budget that is not ``total``, fixed at admission.
    periods: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetUnheld(CallEvent):
    """A reconcile resolves a hold: ``held -= amount``, ``spent += spent``."""

    kind: ClassVar[str] = "budget.unheld"
    budget: str
    amount: int
    spent: int
    #: The period of each ancestor budget that is not ``total``, fixed at admission.
    periods: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetCorrected(CallEvent):
    """A reconcile corrects a settled charge: ``spent -= settled``, ``spent += actual``.

    A ``failed`` call was settled at ``settled`` (its reservation); reconciled not applied,
    ``actual`` is 0 and the money comes back; applied with cost C, ``actual`` is C.
    """

    kind: ClassVar[str] = "budget.corrected"
    budget: str
    settled: int
    actual: int
    #: The period of each ancestor budget that is not ``total``, fixed at admission.
    periods: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetLimitSet(Event):
    """An operator set a budget node's policy: its limit (``None``: none), period and rates."""

    kind: ClassVar[str] = "budget.limit_set"
    path: str
    limit: int | None
    #: The rest of the node's policy (events written before periods existed lack them).
    period: str = "total"
    tz: str = "UTC"
    rpm: int | None = None
    tpm: int | None = None
    concurrency: int | None = None


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
class AttemptStarted(CallEvent):
    """Attempt ``attempt`` is about to be dispatched by ``worker``.

    Where the attempt writes the call's operation id (``op_id_in``, e.g. ``form
    metadata[effectguard_op]``), and for an endpoint with a lookup where and with which
    credential it is sent (``sent_to``, ``key_digest``: rules/digest): a lookup's "not
    found" proves "not applied" only of what it searched for there (rules/searched). Each
    is absent from the data when None: such an event's data is what it always was.
    """

    kind: ClassVar[str] = "attempt.started"
    attempt: int
    worker: str
    generation: int
    provider_idempotency_key: str | None = None
    at: float = 0.0
    op_id_in: str | None = None
    sent_to: str | None = None
    key_digest: str | None = None

    def to_data(self) -> dict[str, Any]:
        data = Event.to_data(self)
        # The shape of every attempt.started before these were kept: absent, not null.
        for name in ("op_id_in", "sent_to", "key_digest"):
            if data[name] is None:
                del data[name]
        return data


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptNotSent(CallEvent):
    """The connection never opened: no byte of the request left."""

    kind: ClassVar[str] = "attempt.not_sent"
    attempt: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptObserved(CallEvent):
    """The upstream answered; the response is stored exactly as received.

    ``not_processed``: the provider declares the status "not processed" (no effect).
    ``effect_unknown``: the provider declares the status a transient server failure after
    which the effect is unknown (e.g. a 500): the answer proves nothing either way, and an
    ``attempt.interrupted`` is recorded with it.
    """

    kind: ClassVar[str] = "attempt.observed"
    attempt: int
    status: int
    not_processed: bool
    usage: dict[str, int] | None
    usage_problem: str | None
    headers: dict[str, str]
    body: str
    body_encoding: str = "utf8"
    effect_unknown: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptInterrupted(CallEvent):
    """The request may have been sent but no answer was observed."""

    kind: ClassVar[str] = "attempt.interrupted"
    attempt: int
    reason: str
    by: str


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptLateAnswer(CallEvent):
    """Evidence: the provider's answer to ``attempt`` reached the worker that sent it after
    the ledger stopped taking that attempt's outcome (it was fenced, or the attempt was
    already interrupted). Moves no stage and no money; ``reconcile --accept-evidence`` may
    decide the call by it (docs/contract.md §6.1, §8).

    ``effect`` is what the provider's declaration says the status means (``applied``,
    ``none``, ``unknown``); ``cost`` is what the answer would have settled had it come in
    time (None: it would have charged nothing, or its effect is unknown). ``observed_by`` and
    ``generation`` name the registration that dispatched the attempt; the event itself is
    written by a registration the store still accepts.
    """

    kind: ClassVar[str] = "attempt.late_answer"
    attempt: int
    status: int
    effect: str
    body_digest: str
    body_bytes: int
    usage: dict[str, int] | None
    usage_problem: str | None
    cost: int | None
    observed_by: str
    generation: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CallCompleted(CallEvent):
    """The call is finished with ``outcome`` (completed, failed, not_processed)."""

    kind: ClassVar[str] = "call.completed"
    outcome: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CallReconciled(CallEvent):
    """A person, a provider lookup or the hook decided whether an unknown effect happened.

    ``result`` (with ``result_encoding``, as a body's) is what the evidence recovered of an
    applied effect, replayed to later keyed resends; absent from the data when None.
    """

    kind: ClassVar[str] = "call.reconciled"
    applied: bool
    cost: int
    note: str
    by: str
    result: str | None = None
    result_encoding: str = "utf8"

    def to_data(self) -> dict[str, Any]:
        data = Event.to_data(self)
        if self.result is None:  # the shape a decision had before results were kept
            del data["result"], data["result_encoding"]
        return data


@dataclass(frozen=True, slots=True, kw_only=True)
class CallResendAuthorized(CallEvent):
    """An operator authorized one new attempt of an effect-unknown call, accepting that
    the effect may then happen twice. The hold stays until that attempt settles."""

    kind: ClassVar[str] = "call.resend_authorized"
    note: str
    by: str


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


_READERS: dict[type[Event], tuple[tuple[str, ...], Callable[[Event], tuple[Any, ...]]]] = {}


def _field_reader(
    cls: type[Event],
) -> tuple[tuple[str, ...], Callable[[Event], tuple[Any, ...]]]:
    # dataclasses.fields() walks the class on every call; sealing an event is on
    # every request's durable path, so each kind's field names are read once.
    reader = _READERS.get(cls)
    if reader is None:
        names = tuple(f.name for f in dataclasses.fields(cls))
        get = attrgetter(*names)
        values = get if len(names) > 1 else (lambda event: (get(event),))
        reader = _READERS[cls] = (names, values)
    return reader


# Every kind defined above; events are built on every request's path, hence quick_init.
_KINDS.update(
    (cls.kind, quick_init(cls))
    for cls in list(globals().values())
    if isinstance(cls, type) and issubclass(cls, Event) and cls.kind
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
