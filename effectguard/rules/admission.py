"""What to do with an incoming request, given the call it may repeat (docs/contract.md §4). Pure.

The store looks up the call that an ``Idempotency-Key`` (or a declared retry)
points at, projects it, and asks :func:`decide`. The answer is one of:
admit new work, start a new attempt of that call, replay its stored response,
join it while it is in flight, or refuse.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, Literal

from effectguard.errors import Refusal
from effectguard.rules import evidence
from effectguard.rules.bodyref import SpooledBody
from effectguard.rules.events import AttemptLateAnswer
from effectguard.rules.guidance import (
    decide_unknown,
    show_command,
    unknown_effect,
)
from effectguard.rules.quickinit import quick_init
from effectguard.rules.workstate import WorkState

Action = Literal["admit", "attempt", "provider_resend", "replay", "join", "refuse"]


@quick_init
@dataclass(frozen=True, slots=True)
class Decision:
    """The outcome of :func:`decide` (``refusal`` set only for ``refuse``)."""

    action: Action
    existing: WorkState | None = None
    refusal: Refusal | None = None


def _refuse(
    status: int, type_: str, message: str, state: WorkState, next_operation: str | None = None
) -> Decision:
    return Decision(
        "refuse",
        state,
        Refusal(
            status,
            type_,
            message,
            call_id=state.call_id,
            stage=state.stage,
            next_operation=next_operation or state.next_operation,
        ),
    )


def decide_keyed(
    existing: WorkState | None,
    request_hash: str,
    now: float,
    late: AttemptLateAnswer | None = None,
) -> Decision:
    """docs/contract.md §4's table for a request carrying an ``Idempotency-Key``.

    ``late``: a late answer kept for any of the call's attempts that says the provider
    applied it (evidence.applied_late), if any; read only for a call whose resend it
    forbids (evidence.may_be_contradicted): decided not applied, resting after a later
    attempt, or effect-unknown with a resend authorized. Inside the provider's own
    idempotency window the resend carries its dedup key and replays, so it is still sent.
    """
    if existing is None:
        return Decision("admit")
    s = existing
    if s.request_hash != request_hash:
        return _refuse(
            422,
            "idempotency_key_reused",
            f"this Idempotency-Key belongs to call {s.call_id}, a different request; "
            f"send it with a new key (see `{show_command(s.call_id)}`)",
            s,
        )
    if s.stage in ("completed", "failed"):
        return Decision("replay", s)
    if s.stage == "in_flight":
        return _refuse(
            409,
            "in_progress",
            f"call {s.call_id} with this key is in flight; wait for it and resend the same "
            f"request to receive its result (see `{show_command(s.call_id)}`)",
            s,
        )
    if s.stage == "effect_unknown":
        return _keyed_unknown(s, now, late)
    warning = evidence.resend_warning(s, late)
    if warning is not None:
        return refuse_contradicted(s, warning)
    if s.stage in ("not_sent", "not_processed", "reconciled_not_applied"):
        return Decision("attempt", s)
    if s.stage == "reconciled_applied":
        return _refuse(
            409,
            "reconciled_applied",
            f"call {s.call_id} was reconciled as applied, so it is not sent again; new work "
            f"needs a new Idempotency-Key (see `{show_command(s.call_id)}`)",
            s,
        )
    return Decision("admit")


def _keyed_unknown(s: WorkState, now: float, late: AttemptLateAnswer | None) -> Decision:
    """A keyed resend of an effect-unknown call: on the provider's dedup key inside its
    window; else only with a resend authorized, which a late 2xx voids (``late``)."""
    window = s.idempotency_window_s
    if window is not None and now - s.created_at <= window:
        return Decision("provider_resend", s)
    warning = evidence.resend_warning(s, late)
    if warning is not None:
        return refuse_contradicted(s, warning)
    if s.resend_authorized:
        # An operator accepted the duplicate risk: one new attempt; the hold stays.
        return Decision("attempt", s)
    return _refuse(409, "effect_unknown", unknown_effect(s.call_id), s)


def refuse_contradicted(s: WorkState, warning: str, retry: bool = False) -> Decision:
    """A keyed resend, the proxy's automatic retry (or, ``retry``, a key-less declared
    retry) of a call whose stage says it had no effect (decided not applied, or a later
    attempt not sent or not processed), or whose resend an operator authorized while its
    effect was unknown, that its late answer says the provider did apply:
    the stage calls for a resend, but a resend would make the effect again (``warning``,
    what ``show`` says, contract §4), so nothing is to be done."""
    free = ", so its key is free"
    if s.stage == "reconciled_not_applied":
        why = "was decided not applied"
    elif s.stage == "effect_unknown":
        why, free = "has one resend authorized", ""
    else:
        why = f"rests {s.stage} after its last attempt"
    if retry:
        said = f"this request retries call {s.call_id}, which {why}, but"
        new_work = "new work must not declare itself its retry"
    else:
        said = f"call {s.call_id} {why}{free}, but"
        new_work = "new work needs a new Idempotency-Key"
    return _refuse(
        409,
        "late_answer_applied",
        f"{said} {warning}; it is not sent again, and {new_work} (see `{show_command(s.call_id)}`)",
        s,
        next_operation=evidence.contradicted_next(s),
    )


def decide_retry(existing: WorkState | None, late: AttemptLateAnswer | None = None) -> Decision:
    """docs/contract.md §4 for a key-less request that declares itself a retry.

    ``existing`` is the unresolved call with the same request hash in the same
    budget scope within the retry window, if any; ``late``, for a call decided not
    applied, the late answer that says the provider applied it (ledger/retries).
    """
    if existing is None:
        return Decision("admit")
    warning = evidence.resend_warning(existing, late)
    if warning is not None:
        # Decided not applied, so its retry would be new work: the effect again.
        return refuse_contradicted(existing, warning, retry=True)
    if existing.stage in ("completed", "failed"):
        # Only a call whose caller left is matched settled (callpath/orphans): its answer.
        return Decision("replay", existing)
    if existing.stage in ("in_flight", "not_sent", "not_processed"):
        # A resting stage comes only as the call its caller left, between the owner's
        # automatic retries (ledger/retries): joined, it is waited out (callpath/join).
        return Decision("join", existing)
    if existing.stage == "reconciled_applied":
        # Decided while its caller was away: a retry is not new work, but the same effect.
        return _refuse(
            409,
            "reconciled_applied",
            f"this request retries call {existing.call_id}, which was reconciled as applied, "
            f"so it is not sent again (see `{show_command(existing.call_id)}`)",
            existing,
        )
    if existing.stage == "effect_unknown" and existing.resend_authorized:
        return Decision("attempt", existing)
    if existing.stage == "effect_unknown":
        return _refuse(
            409,
            "effect_unknown",
            f"this request retries call {existing.call_id}, whose effect is unknown; "
            f"{decide_unknown(existing.call_id)}",
            existing,
        )
    return Decision("admit")


@dataclass(frozen=True, slots=True)
class Sending:
    """How an attempt goes out, as its ``attempt.started`` records it: where it carries the
    call's operation id upstream (the endpoint's op_id, ``OpIdPlacement.label``; None: it
    carries none), and, for an endpoint with a lookup, the base URL it is sent to and the
    digest of the credential it carries (rules/digest.credential_digest; None: none). A
    lookup's "not found" says "not applied" only of an operation it searched for where,
    and in the account, the operation was sent (callpath/resolve)."""

    op_id_in: str | None = None
    sent_to: str | None = None
    key_digest: str | None = None


#: What an attempt of a request whose endpoint has neither op_id nor lookup records.
NOTHING_RECORDED: Final = Sending()


@quick_init
@dataclass(frozen=True, slots=True)
class AdmitRequest:
    """Everything admission needs to know about one request."""

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
    body_encoding: str
    stream: bool
    reserve: int
    is_retry: bool = False
    #: Token estimate (prompt bytes + output bound), counted against ``tpm`` limits.
    tokens: int = 0
    retry_of: str | None = None
    #: The call this key-less retry repeats whose caller left before its answer
    #: (callpath/orphans): matched even once it has settled, to replay its answer.
    orphan_of: str | None = None
    retry_window_s: float = 600.0
    provider_idempotency_window_s: float | None = None
    create_budgets: bool = True
    #: A body stored by reference (``body_encoding`` "sha256", rules/bodyref): the file
    #: the admission copies into the ledger's body store, in its own transaction.
    spool: SpooledBody | None = None
    #: The request's headers that scope its operation to an account (the lookup's
    #: ``scope_headers``), recorded in the manifest for the lookup to send again.
    headers: dict[str, str] = field(default_factory=dict)
    #: How each attempt goes out, recorded in its attempt.started.
    sending: Sending = NOTHING_RECORDED
