"""The events of one call's life: its manifest, its attempts and how it ended.

Import them from :mod:`effectguard.rules.events`, which registers every kind.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from effectguard.rules.eventbase import CallEvent, Event


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
