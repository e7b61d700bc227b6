"""The work-state projection (docs/contract.md §6): a pure fold over one call's events.

``work_state(events)`` answers, from events alone, the call's stage, whether a
provider effect may have happened, and the next safe operation. It reads no
clock, no provider and no memory: ``in_flight`` becomes ``effect_unknown`` only
through a recorded ``attempt.interrupted``.

Terminal stages (``refused``, ``completed``, ``failed``, ``reconciled_applied``)
are rungs a call never climbs down from: whatever follows, a completed call
stays completed. The one way down is ``call.reconciled`` on a ``failed`` call: a
person decides whether its error answer had an effect (docs/contract.md §12).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from effectguard.rules.events import (
    AttemptInterrupted,
    AttemptNotSent,
    AttemptObserved,
    AttemptStarted,
    BudgetCorrected,
    BudgetHeld,
    BudgetReleased,
    BudgetReserved,
    BudgetSettled,
    BudgetUnheld,
    CallManifest,
    CallReconciled,
    CallRefused,
    CallResendAuthorized,
    Event,
)
from effectguard.rules.quickinit import quick_init

Stage = Literal[
    "new",
    "refused",
    "in_flight",
    "not_sent",
    "effect_unknown",
    "completed",
    "not_processed",
    "failed",
    "reconciled_applied",
    "reconciled_not_applied",
]
Effect = Literal["none", "unknown", "applied"]
NextOperation = Literal["none", "wait", "resend", "reconcile"]

STAGES: Final[tuple[Stage, ...]] = (
    "refused",
    "in_flight",
    "not_sent",
    "effect_unknown",
    "completed",
    "not_processed",
    "failed",
    "reconciled_applied",
    "reconciled_not_applied",
)

#: docs/contract.md §6: what each stage means for the effect and what is safe next.
STAGE_TABLE: Final[dict[Stage, tuple[Effect, NextOperation]]] = {
    "new": ("none", "none"),
    "refused": ("none", "none"),
    "in_flight": ("unknown", "wait"),
    "not_sent": ("none", "resend"),
    "effect_unknown": ("unknown", "reconcile"),
    "completed": ("applied", "none"),
    "not_processed": ("none", "resend"),
    "failed": ("applied", "none"),
    "reconciled_applied": ("applied", "none"),
    "reconciled_not_applied": ("none", "resend"),
}

TERMINAL: Final[frozenset[Stage]] = frozenset(
    {"refused", "completed", "failed", "reconciled_applied"}
)
#: Stages from which a new attempt may start.
RESUMABLE: Final[frozenset[Stage]] = frozenset(
    {"not_sent", "not_processed", "reconciled_not_applied", "effect_unknown"}
)
UNRESOLVED: Final[frozenset[Stage]] = frozenset({"in_flight", "effect_unknown"})
#: Stages a person (or a provider lookup) may correct with ``call.reconciled``: an unknown
#: effect, and an error answer booked as applied that may have done nothing (docs/contract.md §12).
RECONCILABLE: Final[frozenset[Stage]] = frozenset({"effect_unknown", "failed"})
#: Stages in which the call's cost is settled (from usage) or decided (by ``reconcile``).
SETTLED: Final[frozenset[Stage]] = frozenset(
    {"completed", "failed", "reconciled_applied", "reconciled_not_applied"}
)


@quick_init
@dataclass(frozen=True, slots=True)
class WorkState:
    """One call's state, folded from its events."""

    call_id: str = ""
    stage: Stage = "new"
    attempts: int = 0
    idempotency_key: str | None = None
    request_hash: str = ""
    provider: str = ""
    model: str | None = None
    budget: str = ""
    budget_root: str = ""
    created_at: float = 0.0
    last_attempt_at: float = 0.0
    reserved_at_admission: int = 0
    reserved: int = 0
    cost: int | None = None
    held: int = 0
    status: int | None = None
    worker: str = ""
    flagged: str | None = None
    idempotency_window_s: float | None = None
    #: The period of each ancestor budget not in ``total``, fixed when the call was admitted.
    periods: dict[str, str] = field(default_factory=dict)
    #: The current attempt's token estimate (what its rate window counted).
    tokens: int = 0
    #: An operator authorized one new attempt of this effect-unknown call (contract.md §8).
    resend_authorized: bool = False

    @property
    def effect(self) -> Effect:
        """Whether a provider effect may have happened (docs/contract.md §6)."""
        return STAGE_TABLE[self.stage][0]

    @property
    def next_operation(self) -> NextOperation:
        """The next safe operation (docs/contract.md §6)."""
        return STAGE_TABLE[self.stage][1]

    @property
    def settled_cost(self) -> int | None:
        """What the call cost once settled or decided (``cost_usd``, docs/contract.md §8);
        None in any other stage.

        ``cost`` folds every round of the call, and a decision or hold release that spends
        nothing makes it 0 (``reconcile --not-applied``; a keyed resend taking over a
        hold). A resend after that starts from the 0, which settles nothing of its own
        attempt: outside :data:`SETTLED` ``cost`` is only ever None or such a 0.
        """
        return self.cost if self.stage in SETTLED else None


_FIELDS: Final = tuple(f.name for f in dataclasses.fields(WorkState))
_INDEX: Final = {name: i for i, name in enumerate(_FIELDS)}
_values: Final = operator.attrgetter(*_FIELDS)


def as_dict(state: WorkState) -> dict[str, Any]:
    """The state's fields by name (what the SQL stores keep as JSON)."""
    return dict(zip(_FIELDS, _values(state), strict=True))


def replace(state: WorkState, **changes: Any) -> WorkState:
    """``dataclasses.replace`` for :class:`WorkState`, without its per-call introspection.

    Every durable write folds a few events through this, so it is on each
    request's path; ``dataclasses.replace`` costs about 1.8 times as much.
    """
    values = list(_values(state))
    for name, value in changes.items():
        values[_INDEX[name]] = value
    return WorkState(*values)


def apply(state: WorkState, event: Event) -> WorkState:
    """Fold one event into ``state``. Events of other calls must not be passed."""
    fold = _FOLDS.get(type(event))
    return state if fold is None else fold(state, event)


# -- the call's own events


def _manifest(state: WorkState, event: CallManifest) -> WorkState:
    if state.stage != "new":
        return state
    return replace(
        state,
        call_id=event.call,
        stage="in_flight",
        idempotency_key=event.idempotency_key,
        request_hash=event.request_hash,
        provider=event.provider,
        model=event.model,
        budget=event.budget,
        budget_root=event.budget_root,
        created_at=event.at,
        idempotency_window_s=event.provider_idempotency_window_s,
    )


def _refused(state: WorkState, event: CallRefused) -> WorkState:
    # Only a call that never started an attempt is refused. Every terminal stage but
    # ``refused`` itself has an attempt, so this never leaves a terminal rung (a guard for
    # that here was dead code: mutation testing showed no test could tell).
    return state if state.attempts else replace(state, stage="refused")


def _reconciled(state: WorkState, event: CallReconciled) -> WorkState:
    # Reconciling climbs down from the terminal ``failed``: only a person does that. A
    # decision replaces any resend still authorized.
    if state.stage not in RECONCILABLE:
        return state
    stage: Stage = "reconciled_applied" if event.applied else "reconciled_not_applied"
    return replace(state, stage=stage, resend_authorized=False)


def _resend_authorized(state: WorkState, event: CallResendAuthorized) -> WorkState:
    if state.stage != "effect_unknown":
        return state
    return replace(state, resend_authorized=True)


# -- money: what the call holds against its budget


def _reserved(state: WorkState, event: BudgetReserved) -> WorkState:
    first = state.reserved_at_admission or event.amount
    periods = state.periods or event.periods  # every later reservation repeats them
    return replace(
        state,
        reserved=state.reserved + event.amount,
        reserved_at_admission=first,
        periods=periods,
        tokens=event.tokens,
    )


def _released(state: WorkState, event: BudgetReleased) -> WorkState:
    return replace(state, reserved=max(0, state.reserved - event.amount))


def _settled(state: WorkState, event: BudgetSettled) -> WorkState:
    return replace(
        state,
        reserved=max(0, state.reserved - event.reserved),
        cost=(state.cost or 0) + event.actual,
        flagged=event.flagged or state.flagged,
    )


def _held(state: WorkState, event: BudgetHeld) -> WorkState:
    # Held after an attempt that proved nothing: it resent an effect-unknown call, whose
    # earlier effect is still unknown (rules/settlement.hold_if_nothing).
    stage: Stage = "effect_unknown" if state.stage in _NOTHING else state.stage
    return replace(
        state,
        stage=stage,
        reserved=max(0, state.reserved - event.amount),
        held=state.held + event.amount,
    )


_NOTHING: Final = frozenset({"not_sent", "not_processed"})


def _unheld(state: WorkState, event: BudgetUnheld) -> WorkState:
    return replace(
        state, held=max(0, state.held - event.amount), cost=(state.cost or 0) + event.spent
    )


def _corrected(state: WorkState, event: BudgetCorrected) -> WorkState:
    return replace(state, cost=(state.cost or 0) - event.settled + event.actual)


# -- attempts: only the current, in-flight attempt's outcome moves the stage


def _started(state: WorkState, event: AttemptStarted) -> WorkState:
    if state.stage in TERMINAL or (state.stage == "in_flight" and state.attempts):
        return state
    return replace(
        state,
        stage="in_flight",
        attempts=event.attempt,
        last_attempt_at=event.at,
        worker=event.worker,
    )


def _current(state: WorkState, attempt: int) -> bool:
    return attempt == state.attempts and state.stage == "in_flight"


def _not_sent(state: WorkState, event: AttemptNotSent) -> WorkState:
    if not _current(state, event.attempt):
        return state
    return replace(state, stage=_no_effect("not_sent", state))


def may_retry(state: WorkState) -> bool:
    """Whether an automatic retry may follow the last attempt, which proved nothing
    happened: ``not_sent``, not processed, or an operator's authorized resend that did
    neither (the call is effect_unknown and still authorized, contract.md §8)."""
    return state.stage in ("not_sent", "not_processed") or (
        state.stage == "effect_unknown" and state.resend_authorized
    )


def _no_effect(stage: Stage, state: WorkState) -> Stage:
    """The stage after an attempt that provably did nothing (``not_sent``, ``not_processed``).

    An attempt an operator authorized for an effect-unknown call (contract.md §8) proves
    nothing about the earlier attempt: the call is effect_unknown again, keeps its hold,
    and the authorization stands for the next resend, since no effect was spent on it.
    """
    return "effect_unknown" if state.resend_authorized else stage


def _observed(state: WorkState, event: AttemptObserved) -> WorkState:
    if not _current(state, event.attempt):
        return state
    if event.effect_unknown and not event.not_processed:
        # An answer that proves nothing (a declared transient status of unknown effect):
        # the attempt.interrupted recorded with it makes the call effect_unknown.
        return replace(state, status=event.status)
    if event.not_processed:
        return replace(state, stage=_no_effect("not_processed", state), status=event.status)
    stage: Stage = "completed" if 200 <= event.status < 300 else "failed"
    # An authorization is spent by an attempt that may have had its effect.
    return replace(state, stage=stage, status=event.status, resend_authorized=False)


def _interrupted(state: WorkState, event: AttemptInterrupted) -> WorkState:
    if not _current(state, event.attempt):
        return state
    return replace(state, stage="effect_unknown", resend_authorized=False)


#: How each kind of event moves a call's state (``call.completed`` and others: not at all).
_FOLDS: Final[dict[type[Any], Callable[[WorkState, Any], WorkState]]] = {
    CallManifest: _manifest,
    CallRefused: _refused,
    CallReconciled: _reconciled,
    CallResendAuthorized: _resend_authorized,
    BudgetReserved: _reserved,
    BudgetReleased: _released,
    BudgetSettled: _settled,
    BudgetHeld: _held,
    BudgetUnheld: _unheld,
    BudgetCorrected: _corrected,
    AttemptStarted: _started,
    AttemptNotSent: _not_sent,
    AttemptObserved: _observed,
    AttemptInterrupted: _interrupted,
}


def work_state(events: Iterable[Event]) -> WorkState:
    """Project a call's events (in ledger order) into its :class:`WorkState`."""
    state = WorkState()
    for event in events:
        state = apply(state, event)
    return state
