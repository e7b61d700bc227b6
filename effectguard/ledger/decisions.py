"""Decisions about a call's effect: a reconcile (by a person, a lookup or the hook), and
an operator's authorization to resend an effect-unknown call (docs/contract.md §8)."""

from __future__ import annotations

from effectguard.errors import ReconcileError
from effectguard.ledger.base import Tx, Writer
from effectguard.ledger.operations import append
from effectguard.rules import evidence, workstate
from effectguard.rules.bodytext import encode_body
from effectguard.rules.events import (
    AttemptLateAnswer,
    BudgetCorrected,
    BudgetUnheld,
    CallReconciled,
    CallResendAuthorized,
    Event,
)
from effectguard.rules.guidance import (
    accept_evidence_command,
    applied_by_earlier_attempt,
    show_command,
)
from effectguard.rules.money import MAX_CALL_NANOS, nanos_to_usd
from effectguard.rules.workstate import WorkState


def reconcile(
    tx: Tx,
    writer: Writer,
    call_id: str,
    *,
    applied: bool,
    cost: int | None,
    note: str,
    by: str,
    result: bytes | None = None,
    attempt: int | None = None,
    automated: bool = False,
) -> WorkState:
    """Record a person's (or lookup's) decision on an effect-unknown or failed call.

    An effect-unknown call's hold is released and the cost (default: the hold) spent. A
    failed call was settled at its charge; the charge is corrected to the cost (default:
    unchanged), or to nothing when not applied, which frees its key for a new attempt.
    ``result`` is what the evidence recovered of an applied effect (docs/contract.md
    §4.1): kept in the decision, in the chain, and replayed to later keyed resends.
    Evidence is about one ``attempt``: a lookup that asked before a later attempt was
    sent cannot tell whether that one took effect, so it decides nothing. An ``automated``
    decision (a lookup's, the hook's) that a late answer kept goes against is refused
    (:func:`_check_evidence`): the provider's own answer outweighs it; a person decides.
    """
    if result is not None and not applied:
        raise ReconcileError("only an applied effect has a result to keep", call_id=call_id)
    state = tx.get_call(call_id)
    if state is None:
        raise ReconcileError(f"no call {call_id!r}", call_id=call_id)
    _check_reconcilable(state)
    _check_evidence(tx, state, attempt, applied if automated else None)
    if cost is not None and not 0 <= cost <= MAX_CALL_NANOS:
        raise ReconcileError(
            f"a cost must be between 0 and {nanos_to_usd(MAX_CALL_NANOS)} USD", call_id=call_id
        )
    budget_event: Event
    if state.stage == "failed":
        settled = state.cost or 0
        spent = (settled if cost is None else cost) if applied else 0
        budget_event = BudgetCorrected(
            call=call_id, budget=state.budget, settled=settled, actual=spent
        )
    else:
        spent = (state.held if cost is None else cost) if applied else 0
        budget_event = BudgetUnheld(
            call=call_id, budget=state.budget, amount=state.held, spent=spent
        )
    text, encoding = (None, "utf8") if result is None else encode_body(result)
    decision = CallReconciled(
        call=call_id,
        applied=applied,
        cost=spent,
        note=note,
        by=by,
        result=text,
        result_encoding=encoding,
    )
    events: list[Event] = [decision, budget_event]
    return append(tx, writer, events, {call_id: state})[call_id]


def _check_evidence(
    tx: Tx, state: WorkState, attempt: int | None, automated_verdict: bool | None
) -> None:
    """A :class:`ReconcileError` for evidence gathered about ``attempt`` once a later one
    has started, and for an automated verdict (applied or not) that a late answer kept
    goes against (:func:`evidence.verdict_contradicted`: the current attempt's, or for
    "not applied" an applied answer to any attempt)."""
    check_attempt(state, attempt)
    call_id, current = state.call_id, state.attempts
    if automated_verdict is None:
        return
    late = evidence.verdict_contradicted(tx.events_of(call_id), current, automated_verdict)
    if late is None:
        return
    advice = _decide_by(late, call_id, current, "by hand")
    raise ReconcileError(
        f"call {call_id}: the late answer kept for attempt {late.attempt} (status "
        f"{late.status}) says otherwise; a person decides it ({advice})",
        call_id=call_id,
    )


def check_attempt(state: WorkState, attempt: int | None) -> None:
    """A :class:`ReconcileError` when ``attempt`` (what a person examined, or what a
    lookup asked about) is no longer the call's last: what was checked says nothing
    about the newer one."""
    call_id, current = state.call_id, state.attempts
    if attempt is not None and current != attempt:
        # Say what was not done and what to do: the person examined an attempt that a
        # resend has since followed, and must look at the newer one before deciding.
        raise ReconcileError(
            f"call {call_id}: this decision is about attempt {attempt}, but attempt "
            f"{current} began since, so nothing was decided (what was checked says nothing "
            f"of attempt {current}); look at it with `{show_command(call_id)}`, then "
            "decide anew about that attempt",
            call_id=call_id,
        )


def _check_reconcilable(state: WorkState) -> None:
    """A :class:`ReconcileError` unless ``state`` is a stage a decision applies to."""
    call_id = state.call_id
    if state.stage == "in_flight":
        # A worker's file lock proves its process gone at once, but only to a process on
        # its host (on PostgreSQL, of its OS user too): elsewhere the lease does, and a
        # call taken over for its lease alone is decided by a second run (§7).
        raise ReconcileError(
            f"call {call_id} is in_flight: its worker is still working on it, or stopped "
            "less than a lease ago; nothing was decided. Wait, then "
            f"`{show_command(call_id)}`: `effectguard reconcile` takes the call over once "
            "its worker is known gone: run on the worker's host (on PostgreSQL, as its OS "
            "user), at once when its process is gone, and decides it; else once its lease "
            "has run out (`lease_s`, 15 s by default), and then a second run decides it, "
            "once you have looked for a late answer",
            call_id=call_id,
        )
    if state.stage not in workstate.RECONCILABLE:
        raise ReconcileError(
            f"call {call_id} is {state.stage}, not effect_unknown or failed; nothing to reconcile",
            call_id=call_id,
        )


def authorize_resend(
    tx: Tx, writer: Writer, call_id: str, *, note: str, by: str, attempt: int | None = None
) -> WorkState:
    """An operator authorizes exactly one new attempt of an effect-unknown call
    (contract.md §8), only while ``attempt`` (if given) is still its last."""
    state = effect_unknown_call(
        tx, call_id, "only an unknown effect is resent on an operator's word"
    )
    check_attempt(state, attempt)
    if state.resend_authorized:
        raise ReconcileError(f"call {call_id} already has a resend authorized", call_id=call_id)
    _check_not_applied_late(tx, state)
    event = CallResendAuthorized(call=call_id, note=note, by=by)
    return append(tx, writer, [event], {call_id: state})[call_id]


def _check_not_applied_late(tx: Tx, state: WorkState) -> None:
    """A :class:`ReconcileError` when a late answer kept for any attempt of ``state`` says
    the provider applied it: the resend would make the effect a second time (the rules
    would void the authorization at once, evidence.resend_contradicted); the person
    decides the call by that answer instead. Read only on this operator's path."""
    late = evidence.applied_late(tx.events_of(state.call_id))
    if late is None:
        return
    call_id, current = state.call_id, state.attempts
    advice = _decide_by(late, call_id, current, "--applied by hand")
    raise ReconcileError(
        f"call {call_id}: a late answer kept for attempt {late.attempt} (status "
        f"{late.status}) says the provider applied it, so a resend would make the effect "
        f"again and none is authorized; decide it by that answer ({advice})",
        call_id=call_id,
    )


def effect_unknown_call(tx: Tx, call_id: str, why: str) -> WorkState:
    """The call ``call_id`` if it is effect_unknown; else a :class:`ReconcileError` that
    says what it is and ``why`` only an unknown effect is decided this way."""
    state = tx.get_call(call_id)
    if state is None:
        raise ReconcileError(f"no call {call_id!r}", call_id=call_id)
    if state.stage != "effect_unknown":
        raise ReconcileError(
            f"call {call_id} is {state.stage}, not effect_unknown; {why}", call_id=call_id
        )
    return state


def _decide_by(late: AttemptLateAnswer, call_id: str, current: int, by_hand: str) -> str:
    """The command that decides ``call_id`` (its last attempt ``current``) by ``late``:
    ``--accept-evidence`` for an answer to the last attempt (or ``by_hand``), else the
    ``--applied`` one, since ``--accept-evidence`` takes only an answer to the last."""
    if late.attempt == current:
        return f"`{accept_evidence_command(call_id, current)}`, or {by_hand}"
    return applied_by_earlier_attempt(call_id, current, evidence.implied_usd(late))
