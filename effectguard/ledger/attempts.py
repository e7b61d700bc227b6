"""An attempt's outcome and the automatic retry after it, as operations over a :class:`Tx`
(docs/contract.md §3.5, §3.6), beside the admission in ledger/operations.

One rule joins them: an attempt that resent an effect-unknown call on the provider's
dedup key, and proved nothing (not sent, or a not-processed status), leaves the earlier
attempt's effect unknown. Its reservation is held, not released, and the call is
effect_unknown again (rules/settlement.resends_unknown); its automatic retry first
releases that hold, as the resend itself did (docs/contract.md §4).
"""

from __future__ import annotations

from collections.abc import Sequence

from effectguard.errors import FencedError, Refusal
from effectguard.ledger import rates, room
from effectguard.ledger.base import Tx, Writer
from effectguard.ledger.operations import Admitted, append, attempt_started, check_lease
from effectguard.ledger.retries import contradiction
from effectguard.rules import budget as budgets
from effectguard.rules import evidence, workstate
from effectguard.rules.admission import NOTHING_RECORDED, Sending, refuse_contradicted
from effectguard.rules.events import (
    BudgetReleased,
    BudgetReserved,
    BudgetUnheld,
    Event,
)
from effectguard.rules.settlement import (
    hold_if_nothing,
    resend_proved_nothing,
    resends_unknown,
    settle_hold,
)
from effectguard.rules.workstate import WorkState


def record(
    tx: Tx, writer: Writer, call_id: str, attempt: int, events: Sequence[Event]
) -> WorkState:
    """Record the outcome of ``attempt``: only while it is the call's current, in-flight one.

    A late result for an attempt that was already interrupted (by a sweeper that
    took over this worker) is refused, never recorded as success.
    """
    state = tx.get_call(call_id)
    if state is None or state.attempts != attempt or state.stage != "in_flight":
        stage = state.stage if state else "missing"
        raise FencedError(
            f"call {call_id} attempt {attempt} is no longer in flight (stage {stage}); "
            "its outcome is not recorded"
        )
    out = settle_hold(state, events)
    # Only a later attempt can be a resend, and only an outcome that proved nothing
    # releases a reservation: the call's history is read on that path alone (a first
    # attempt's 429 reads nothing more).
    proved_nothing = any(isinstance(e, BudgetReleased) for e in out)
    if proved_nothing and state.attempts > 1 and resends_unknown(_history(tx, call_id)):
        out = hold_if_nothing(out)
    return append(tx, writer, out, {call_id: state})[call_id]


def _history(tx: Tx, call_id: str) -> list[Event]:
    return [stored.event for stored in tx.events_of(call_id)]


def start_attempt(
    tx: Tx,
    writer: Writer,
    call_id: str,
    reserve: int,
    provider_key: str | None,
    sending: Sending = NOTHING_RECORDED,
) -> Admitted:
    """Start the next attempt of a call whose last attempt proved nothing happened.

    Used for automatic retries (docs/contract.md §3.4): only after ``not_sent`` or a declared
    not-processed status, with a fresh reservation checked against the budget and rates.
    ``sending``: how the attempt goes out, as its event records it (rules/admission).
    """
    state = tx.get_call(call_id)
    resumes = state is not None and resend_proved_nothing(state, _history(tx, call_id))
    if state is None or not (workstate.may_retry(state) or resumes):
        stage = state.stage if state else "missing"
        raise FencedError(f"call {call_id} is {stage}; no new attempt may start")
    contradicted = _contradicted(tx, state)
    if contradicted is not None:
        return Admitted("refuse", call_id, writer, refusal=contradicted)
    send_by = check_lease(tx, writer)
    # A retry of a resend that proved nothing takes over its hold, as the resend did.
    released = state.held if resumes else 0
    refusal = _refusal(tx, state, reserve - released)
    if refusal is not None:
        return Admitted("refuse", call_id, writer, refusal=refusal)
    attempt = state.attempts + 1
    events: list[Event] = []
    if released:
        unheld = BudgetUnheld(
            call=call_id, budget=state.budget, amount=released, spent=0, periods=state.periods
        )
        events.append(unheld)
    events += [
        BudgetReserved(
            call=call_id,
            budget=state.budget,
            amount=reserve,
            periods=state.periods,
            tokens=state.tokens,
        ),
        attempt_started(call_id, attempt, writer, provider_key, tx.now(), sending),
    ]
    states = append(tx, writer, events, {call_id: state})
    return Admitted(
        "attempt",
        call_id,
        writer,
        attempt,
        state=states[call_id],
        provider_idempotency_key=provider_key,
        send_by=send_by,
    )


def _contradicted(tx: Tx, state: WorkState) -> Refusal | None:
    """The 409 ``late_answer_applied`` for a retry of ``state``, resting not processed or
    not sent after a later attempt, that a late answer kept for an earlier attempt says
    the provider applied: the retry would make the effect again (contract.md §3.4, §4).
    The call rests as it is; show says do not resend. (A first attempt reads nothing.)"""
    warning = evidence.resend_warning(state, contradiction(tx, state))
    return None if warning is None else refuse_contradicted(state, warning).refusal


def _refusal(tx: Tx, state: WorkState, reserve: int) -> Refusal | None:
    """Why the budget or a rate limit refuses a new attempt of ``state`` reserving
    ``reserve`` (None: it may start)."""
    policies = tx.get_policies(budgets.ancestors(state.budget))
    refusal = rates.rate_refusal(tx, policies, state.budget, state.call_id, state.tokens, tx.now())
    return refusal or room.retry_refusal(tx, state, reserve)
