"""What an observed answer settles (docs/contract.md §3.6, §3.5). Pure.

Given the attempt, its reservation, the model's prices and what the provider answered,
:func:`settle` returns the events of the observation transaction and the outcome:

* a status the provider declares "not processed" releases the reservation;
* a status the provider declares a transient failure of unknown effect holds it
  (the call is ``effect_unknown`` until reconciled, never replayed);
* any other answer settles: at the cost of believed usage, or at the reservation
  (flagged) when usage is missing, negative or absurd (including usage that would cost
  more than one call may: ``MAX_CALL_NANOS``), or the status is an error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from effectguard.rules import usage as usages
from effectguard.rules.events import (
    AttemptInterrupted,
    AttemptObserved,
    AttemptStarted,
    BudgetHeld,
    BudgetReleased,
    BudgetSettled,
    BudgetUnheld,
    CallCompleted,
    Event,
)
from effectguard.rules.money import MAX_CALL_NANOS, Nanos
from effectguard.rules.prices import ModelPrice
from effectguard.rules.quickinit import quick_init
from effectguard.rules.workstate import WorkState, work_state


@quick_init
@dataclass(frozen=True, slots=True)
class Answer:
    """What the provider answered to one attempt, in storable form."""

    status: int
    not_processed: bool
    headers: dict[str, str]
    body: str
    body_encoding: str
    result: usages.UsageResult
    effect_unknown: bool = False


@quick_init
@dataclass(frozen=True, slots=True)
class Settlement:
    """The observation's events, the call's outcome and the money it settled.

    ``actual`` is None when the reservation was released (nothing charged);
    ``usage`` is the usage that was believed, if any.
    """

    events: tuple[Event, ...]
    outcome: str
    actual: Nanos | None
    usage: usages.Usage | None


def _held(observed: AttemptObserved, budget: str, reserve: Nanos, by: str) -> Settlement:
    """An answer of unknown effect: not completed; the call waits for a reconcile, as after
    a broken connection, and only attempt.interrupted leads into effect_unknown (contract.md §6)."""
    call_id, status = observed.call, observed.status
    why = f"the provider answered {status}, declared transient with unknown effect"
    interrupted = AttemptInterrupted(call=call_id, attempt=observed.attempt, reason=why, by=by)
    held = BudgetHeld(call=call_id, budget=budget, amount=reserve)
    return Settlement((observed, interrupted, held), "effect_unknown", None, None)


def _judged(
    result: usages.UsageResult, price: ModelPrice, output_cap: int | None
) -> usages.UsageResult:
    """``result``, not believed where its cost or its output cannot be (contract §3.7)."""
    usage = result.usage
    if not result.believed or usage is None:
        return result
    if output_cap and usage.output_tokens > usages.CAP_SLACK * output_cap:  # 0: no bound
        # The provider stops at the request's cap: output far past it is a miscount
        # (10^12 tokens for max_tokens 20 would charge millions of dollars). Some past it
        # is charged, as any overshoot is (contract §5.4): a count is not ours to judge.
        return usages.UsageResult(usage, usages.BEYOND_CAP)
    if usages.cost(price, usage) > MAX_CALL_NANOS:
        # Usage whose cost no counter should take from one call is absurd.
        return usages.UsageResult(usage, "absurd")
    return result


def settle(
    call_id: str,
    attempt: int,
    budget: str,
    reserve: Nanos,
    price: ModelPrice,
    answer: Answer,
    by: str = "",
    deferred: str | None = None,
    output_cap: int | None = None,
) -> Settlement:
    """The events that record ``answer`` and settle, release or hold the reservation.

    ``by`` names the worker, for the ``attempt.interrupted`` of an unknown effect.
    ``deferred`` flags a settlement whose real cost the provider bills later (a batch).
    ``output_cap``: the most output tokens the request allowed (usages.output_cap).
    """
    result = _judged(answer.result, price, output_cap)
    ok = 200 <= answer.status < 300
    believed = result.believed and ok
    observed = AttemptObserved(
        call=call_id,
        attempt=attempt,
        status=answer.status,
        not_processed=answer.not_processed,
        usage=result.usage.to_dict() if result.usage else None,
        usage_problem=None if believed else (result.problem or "missing"),
        headers=answer.headers,
        body=answer.body,
        body_encoding=answer.body_encoding,
        effect_unknown=answer.effect_unknown and not answer.not_processed,
    )
    if answer.not_processed:
        released = BudgetReleased(call=call_id, budget=budget, amount=reserve)
        done = CallCompleted(call=call_id, outcome="not_processed")
        return Settlement((observed, released, done), "not_processed", None, None)
    if observed.effect_unknown:
        return _held(observed, budget, reserve, by)
    usage = result.usage if believed else None
    actual = usages.cost(price, usage) if usage is not None else reserve
    flagged = None if believed else f"usage {result.problem or 'missing'}: settled at reservation"
    flagged = flagged or deferred
    tokens = None if usage is None else usage.input_tokens + usage.output_tokens
    settled = BudgetSettled(
        call=call_id,
        budget=budget,
        reserved=reserve,
        actual=actual,
        flagged=flagged,
        tokens=tokens,
    )
    outcome = "completed" if ok else "failed"
    done = CallCompleted(call=call_id, outcome=outcome)
    return Settlement((observed, settled, done), outcome, actual, usage)


def settle_hold(state: WorkState, events: Sequence[Event]) -> list[Event]:
    """``events`` of an attempt's outcome, plus the release of an earlier hold once a
    resend an operator authorized has settled (completed or failed).

    The earlier attempt's effect is still unknown and the operator accepted that it may
    have happened: its hold is spent, not dropped (the conservative charge stays).
    """
    out = list(events)
    done = [i for i, e in enumerate(out) if isinstance(e, CallCompleted)]
    completed = out[done[0]] if done else None
    settled = isinstance(completed, CallCompleted) and completed.outcome in ("completed", "failed")
    if not state.held or not settled:
        return out
    unheld = BudgetUnheld(
        call=state.call_id,
        budget=state.budget,
        amount=state.held,
        spent=state.held,
        periods=state.periods,
    )
    return [*out[: done[0]], unheld, *out[done[0] :]]


def resends_unknown(events: Sequence[Event]) -> bool:
    """Whether the call's current attempt resends an effect-unknown call on the
    provider's dedup key (docs/contract.md §4: inside the window, without an operator's
    authorization), read from the call's events up to and including that attempt's start.

    Such an attempt covers the earlier one's effect only by an answer: the provider's
    result under the key (a replay, or the one execution). Not sent, or refused before any
    work (a rate limit, a request still executing under the key), it proves nothing about
    the earlier attempt, whose effect stays unknown."""
    starts = [i for i, e in enumerate(events) if isinstance(e, AttemptStarted)]
    if not starts:
        return False
    before = work_state(events[: starts[-1]])
    return before.stage == "effect_unknown" and not before.resend_authorized


def hold_if_nothing(events: Sequence[Event]) -> list[Event]:
    """An outcome's ``events`` with the reservation **held** instead of released, for an
    attempt that proved nothing (``attempt.not_sent``, a not-processed status) while it
    resent an effect-unknown call (:func:`resends_unknown`): the call is effect_unknown
    again, and holds what the earlier attempt may have cost."""
    return [
        BudgetHeld(call=e.call, budget=e.budget, amount=e.amount)
        if isinstance(e, BudgetReleased)
        else e
        for e in events
    ]


def resend_proved_nothing(state: WorkState, events: Sequence[Event]) -> bool:
    """Whether ``state`` is effect_unknown only because an attempt that resent it on the
    provider's dedup key proved nothing (its reservation held by :func:`hold_if_nothing`):
    an automatic retry of that attempt is as safe as the resend was (docs/contract.md §3.5)."""
    if state.stage != "effect_unknown" or not resends_unknown(events):
        return False
    start = max(i for i, e in enumerate(events) if isinstance(e, AttemptStarted))
    # An interrupted attempt may have acted: only one that proved nothing is retried.
    return not any(isinstance(e, AttemptInterrupted) for e in events[start:])
