"""A late answer as evidence, and what accepting it decides (docs/contract.md §6.1, §8). Pure.

When an attempt's answer reaches its worker after the ledger stopped taking that attempt's
outcome (the worker was fenced, or the attempt was already marked interrupted), the answer
cannot become the call's outcome: the store decided, and §7 keeps it so. It is still
the best evidence there is of what the provider did, so it is kept as an
``attempt.late_answer``: its status, what the provider's declaration says that status means,
a digest and size of the body (not the body), the usage and the cost it implies.

Accepting it (``reconcile --accept-evidence``) is an operator's decision with the same
meaning the answer would have had in time: an applied answer reconciles the call applied at
the cost it implies, a status the provider declares unprocessed reconciles it not applied,
and a status of unknown effect proves nothing, so it decides nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from effectguard.errors import ReconcileError
from effectguard.rules.events import (
    AttemptLateAnswer,
    AttemptObserved,
    CallReconciled,
    StoredEvent,
)
from effectguard.rules.guidance import (
    accept_evidence_command,
    applied_by_earlier_attempt,
    applied_command,
    contradicted_not_applied,
    next_shown,
    not_applied_against,
)
from effectguard.rules.lookups import digest
from effectguard.rules.money import nanos_to_usd
from effectguard.rules.settlement import Settlement
from effectguard.rules.workstate import STAGE_TABLE, NextOperation, WorkState

#: Values of ``attempt.late_answer``'s ``effect`` (the provider's declaration of its status).
EFFECTS = ("applied", "none", "unknown")


def late_answer(
    settlement: Settlement,
    body: bytes,
    *,
    effect: str,
    observed_by: str,
    generation: int,
    reason: str,
) -> AttemptLateAnswer:
    """The evidence event for an answer whose settlement the store refused.

    ``settlement`` is what the answer would have settled (:func:`rules.settlement.settle`);
    its observation gives the attempt, the status and the usage as reported.
    """
    observed = next(e for e in settlement.events if isinstance(e, AttemptObserved))
    return AttemptLateAnswer(
        call=observed.call,
        attempt=observed.attempt,
        status=observed.status,
        effect=effect,
        body_digest=digest(body),
        body_bytes=len(body),
        usage=observed.usage,
        usage_problem=observed.usage_problem,
        cost=settlement.actual if effect == "applied" else None,
        observed_by=observed_by,
        generation=generation,
        reason=reason[:300],
    )


def latest(events: Iterable[StoredEvent], attempt: int) -> AttemptLateAnswer | None:
    """The last late answer recorded for ``attempt`` among a call's events."""
    return _last_late(events, "attempt", attempt)


def applied_late(events: Iterable[StoredEvent]) -> AttemptLateAnswer | None:
    """The last late answer kept for any attempt of a call that the provider declares
    applied: whichever attempt it answers, the effect happened (:func:`resend_contradicted`)."""
    return _last_late(events, "effect", "applied")


def _last_late(
    events: Iterable[StoredEvent], field: str, value: object
) -> AttemptLateAnswer | None:
    """The last late answer among a call's events whose ``field`` is ``value``."""
    found = None
    for stored in events:
        if stored.kind == AttemptLateAnswer.kind and stored.data.get(field) == value:
            event = stored.event
            assert isinstance(event, AttemptLateAnswer)
            found = event
    return found


def applied_unknown(state: WorkState, events: Iterable[StoredEvent]) -> AttemptLateAnswer | None:
    """For an effect-unknown call, the late answer kept that says the provider applied it:
    its last attempt's own, which ``--accept-evidence`` decides the call by; else one kept
    for an earlier attempt (:func:`applied_late`): the call is applied, whichever attempt
    made the effect. Either way what a person is offered first is "applied", and "not
    applied" only behind a warning (:func:`applied_advice`), as the deciders' refusals
    advise (ledger/decisions.py)."""
    if state.stage != "effect_unknown":
        return None
    events = list(events)
    own = latest(events, state.attempts)
    return own if own is not None and own.effect == "applied" else applied_late(events)


def implied_usd(late: AttemptLateAnswer) -> str | None:
    """What ``late`` would have cost, in USD (None: it implies no cost)."""
    return None if late.cost is None else nanos_to_usd(late.cost)


def applied_first(call_id: str, attempt: int, late: AttemptLateAnswer) -> list[str]:
    """The decisions "applied" offered first for an effect-unknown call whose last attempt
    is ``attempt`` and that ``late`` (:func:`applied_unknown`) says was applied:
    ``--accept-evidence`` for an answer to ``attempt``, which it takes, then ``--applied``;
    for an earlier attempt's, ``--applied`` (``--accept-evidence`` takes only an answer to
    the last attempt, and refuses one that says not applied against this one)."""
    if late.attempt == attempt:
        return [accept_evidence_command(call_id, attempt), applied_command(call_id, attempt)]
    return [applied_by_earlier_attempt(call_id, attempt, implied_usd(late))]


def applied_advice(call_id: str, attempt: int, late: AttemptLateAnswer) -> str:
    """The decisions offered, ``|``-separated, for such a call: "applied" first
    (:func:`applied_first`); "not applied" still reachable (a person may know better) but
    only behind the warning that the evidence says otherwise."""
    against = not_applied_against(call_id, attempt, late.attempt, late.status)
    return " | ".join([*applied_first(call_id, attempt, late), against])


def recovered(events: Iterable[StoredEvent]) -> CallReconciled | None:
    """The call's last decision, if it is applied and kept a result that evidence (a
    lookup or the hook) recovered: what later keyed resends replay (docs/contract.md §4.1)."""
    found = None
    for stored in events:
        if stored.kind == CallReconciled.kind:
            event = stored.event
            assert isinstance(event, CallReconciled)
            found = event
    return found if found is not None and found.applied and found.result is not None else None


def contradicts(late: AttemptLateAnswer | None, applied: bool) -> bool:
    """Whether deciding ``applied`` goes against ``late``, the late answer kept for the
    attempt being decided: one the provider declares applied says the effect happened,
    one it declares unprocessed says it did not. A lookup or the hook never records such
    a decision; a person may (docs/contract.md §4.1)."""
    if late is None:
        return False
    return late.effect == ("none" if applied else "applied")


def verdict_contradicted(
    events: Iterable[StoredEvent], attempt: int, applied: bool
) -> AttemptLateAnswer | None:
    """The late answer that an automated verdict ``applied`` about ``attempt``, the call's
    last, goes against (None: none does). First the one kept for that attempt, when it
    says otherwise (:func:`contradicts`); then, against "not applied", one kept for any
    attempt that the provider declares applied: "not applied" is about the call, as
    :func:`resend_contradicted` reads it, and the provider's word that it applied attempt
    1 denies it for attempt 2 too. An earlier attempt's unprocessed answer says nothing
    of a later attempt, so it never denies "applied"."""
    events = list(events)
    late = latest(events, attempt)
    if contradicts(late, applied):
        return late
    return None if applied else applied_late(events)


#: The stages whose next operation is ``resend`` (docs/contract.md §6): each says the call
#: had no effect, so a late answer that says the provider applied it contradicts them all.
RESENDABLE: Final = frozenset(
    stage for stage, (_, next_op) in STAGE_TABLE.items() if next_op == "resend"
)


def authorized_resend(state: WorkState) -> bool:
    """Whether ``state`` is an effect-unknown call an operator authorized one resend of
    (contract.md §8): the one stage besides :data:`RESENDABLE` whose next step may be a
    resend, and so the one more a late applied answer contradicts."""
    return state.stage == "effect_unknown" and state.resend_authorized


def may_be_contradicted(state: WorkState) -> bool:
    """Whether ``state`` is one that a late applied answer could contradict, so that its
    events are worth reading (:func:`applied_late`): a call decided not applied, one
    resting ``not_sent``/``not_processed`` after a later attempt, or one with a resend
    authorized. A first attempt that proved nothing recorded its own outcome, so no late
    answer is kept for it: the hot path (a first attempt's 429, retried) reads nothing
    more; nor does an effect-unknown call nobody authorized a resend of (refused anyway)."""
    if state.stage == "reconciled_not_applied" or authorized_resend(state):
        return True
    return state.stage in RESENDABLE and state.attempts > 1


def resend_contradicted(state: WorkState, late: AttemptLateAnswer | None) -> bool:
    """Whether ``state`` says the call had no effect, its next operation ``resend``
    (decided not applied, or its last attempt not sent or not processed), or has a resend
    authorized (:func:`authorized_resend`), while ``late``, an answer to any of its
    attempts (:func:`applied_late`), says the provider applied it.
    The resend (or the retry as new work) that stage usually calls for (§6 ``resend``),
    or that the operator authorized, would make the effect a second time: every answer
    about the call says not to resend instead, and a resend, a declared retry or the
    proxy's own automatic retry is refused (docs/contract.md §3.4, §4, §8, §9). The
    authorization stays in the stored state (the fold is unchanged); these rules void it.

    Any attempt, not only the last: a decision not applied is about the call (its stage
    says the effect is ``none`` and frees it), and each attempt asked the provider for the
    same effect, so the provider's word that it applied attempt 1 contradicts a decision
    recorded after attempt 2 as much as one recorded after attempt 1; and a later
    attempt's 429 or not-sent says nothing of what attempt 1 did."""
    return (
        (state.stage in RESENDABLE or authorized_resend(state))
        and late is not None
        and late.attempt <= state.attempts
        and contradicts(late, False)
    )


def contradicted_next(state: WorkState) -> NextOperation:
    """The next operation every answer names for ``state`` once a late applied answer
    forbids its resend (:func:`resend_contradicted`): none, the stage's resend being what
    is forbidden; but an effect-unknown call still awaits its decision (reconcile), only
    its authorized resend is void."""
    return state.next_operation if state.stage == "effect_unknown" else "none"


def shown_next(state: WorkState, warning: str | None, owner_gone: str | None) -> str:
    """The next operation ``show``'s stage line and the operator page print for ``state``:
    :func:`~effectguard.rules.guidance.next_shown`'s, unless ``warning`` (its
    :func:`resend_warning`) forbids the resend its stage calls for (:func:`contradicted_next`)."""
    if warning is None:
        return next_shown(state.next_operation, owner_gone)
    return contradicted_next(state)


def resend_warning(
    state: WorkState, late: AttemptLateAnswer | None, kept: bool = True
) -> str | None:
    """What every answer about ``state`` says instead of its stage's ``resend`` when
    ``late`` contradicts the decision (:func:`resend_contradicted`); None otherwise.
    ``kept``: ``late`` is in the ledger (False: only the 502 that brought it says so)."""
    if late is None or not resend_contradicted(state, late):
        return None
    return contradicted_not_applied(
        late.attempt, late.status, kept, keyed=state.idempotency_key is not None, stage=state.stage
    )


@dataclass(frozen=True, slots=True)
class Acceptance:
    """What accepting a late answer decides: applied (at ``cost``; None: the hold) or not."""

    applied: bool
    cost: int | None
    note: str


def describe(evidence: AttemptLateAnswer) -> str:
    """One line naming the evidence: attempt, status, meaning, body digest, observer."""
    usage = evidence.usage or {}
    text = (
        f"late answer to attempt {evidence.attempt}: status {evidence.status} "
        f"(effect {evidence.effect}), body {evidence.body_digest} ({evidence.body_bytes} bytes)"
    )
    if usage and evidence.usage_problem is None:
        text += f", usage {usage.get('input_tokens', 0)} in / {usage.get('output_tokens', 0)} out"
    elif evidence.usage_problem:
        text += f", usage {evidence.usage_problem}"
    return text + f", observed by {evidence.observed_by} (generation {evidence.generation})"


def accept(
    call_id: str,
    evidence: AttemptLateAnswer | None,
    attempt: int,
    note: str | None,
    applied: AttemptLateAnswer | None = None,
) -> Acceptance:
    """The decision a late answer to the call's current ``attempt`` proves.

    Refused (:class:`ReconcileError`) when there is no such answer, or when the provider
    declares its status of unknown effect: then it proves nothing either way; and when it
    says not applied while ``applied``, the late answer kept for any attempt that the
    provider declares applied (:func:`applied_late`), says otherwise: the evidence as a
    whole says the call was applied (:func:`verdict_contradicted`), so accepting it cannot
    decide "not applied"; a person may, by hand (:func:`not_applied_against`).
    """
    if evidence is None:
        raise ReconcileError(
            f"call {call_id} has no late answer recorded for attempt {attempt}; "
            "decide it with --applied or --not-applied and a note",
            call_id=call_id,
        )
    said = f"accepted {describe(evidence)}" + (f"; {note}" if note else "")
    if evidence.effect == "applied":
        return Acceptance(True, evidence.cost, said)
    if evidence.effect == "none" and applied is not None:
        raise ReconcileError(
            f"call {call_id}: the late answer kept for attempt {attempt} (status "
            f"{evidence.status}) says not applied, but the late answer kept for attempt "
            f"{applied.attempt} (status {applied.status}) says the provider applied it, so "
            "the evidence does not decide it not applied; a person decides it ("
            f"{applied_by_earlier_attempt(call_id, attempt, implied_usd(applied))}; or "
            f"{not_applied_against(call_id, attempt, applied.attempt, applied.status)})",
            call_id=call_id,
        )
    if evidence.effect == "none":
        return Acceptance(False, None, said)
    raise ReconcileError(
        f"call {call_id}: the late answer's status {evidence.status} is one the provider "
        "declares of unknown effect; it proves nothing, so it decides nothing",
        call_id=call_id,
    )
