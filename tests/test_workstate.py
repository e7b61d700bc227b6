"""The work-state projection (contract.md §6): stages from plain event lists, rung order, purity."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from functools import reduce
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from effectguard.rules.events import (
    AttemptInterrupted,
    AttemptLateAnswer,
    AttemptNotSent,
    AttemptObserved,
    AttemptStarted,
    BudgetCorrected,
    BudgetHeld,
    BudgetReleased,
    BudgetReserved,
    BudgetSettled,
    BudgetUnheld,
    CallCompleted,
    CallManifest,
    CallReconciled,
    CallRefused,
    CallResendAuthorized,
    Event,
)
from effectguard.rules.settlement import hold_if_nothing, resend_proved_nothing, resends_unknown
from effectguard.rules.workstate import (
    RECONCILABLE,
    STAGE_TABLE,
    STAGES,
    TERMINAL,
    WorkState,
    apply,
    as_dict,
    work_state,
)

CALL = "call_1"
R = 5_000


def manifest(*, at: float = 100.0, key: str | None = "k1", window: float | None = None) -> Event:
    """A call.manifest for CALL."""
    return CallManifest(
        call=CALL,
        request_hash="h1",
        provider="openai",
        endpoint="/v1/chat/completions",
        method="POST",
        model="gpt-x",
        idempotency_key=key,
        budget="team/run",
        budget_root="team",
        effect_kind="billable",
        body="{}",
        provider_idempotency_window_s=window,
        at=at,
    )


def started(attempt: int = 1, worker: str = "w1", at: float = 100.0) -> Event:
    """attempt.started for CALL."""
    return AttemptStarted(call=CALL, attempt=attempt, worker=worker, generation=1, at=at)


def observed(
    status: int, *, attempt: int = 1, not_processed: bool = False, effect_unknown: bool = False
) -> Event:
    """attempt.observed for CALL."""
    return AttemptObserved(
        call=CALL,
        attempt=attempt,
        status=status,
        not_processed=not_processed,
        effect_unknown=effect_unknown,
        usage={"input_tokens": 3, "output_tokens": 4},
        usage_problem=None,
        headers={"content-type": "application/json"},
        body="{}",
    )


def interrupted(attempt: int = 1) -> Event:
    """attempt.interrupted for CALL."""
    return AttemptInterrupted(call=CALL, attempt=attempt, reason="lease expired", by="w2")


def reconciled(applied: bool, cost: int = R) -> Event:
    """call.reconciled for CALL."""
    return CallReconciled(
        call=CALL, applied=applied, cost=cost if applied else 0, note="n", by="op"
    )


def admitted() -> list[Event]:
    """The three events of a successful admission."""
    return [manifest(), BudgetReserved(call=CALL, budget="team/run", amount=R), started()]


def effect_unknown() -> list[Event]:
    """An admitted call whose attempt was interrupted."""
    return [*admitted(), interrupted(), BudgetHeld(call=CALL, budget="team/run", amount=R)]


ROWS: dict[str, tuple[list[Event], str, str]] = {
    "refused": (
        [manifest(), CallRefused(call=CALL, reason="budget_exceeded", status=402)],
        "none",
        "none",
    ),
    "in_flight": (admitted(), "unknown", "wait"),
    "not_sent": (
        [
            *admitted(),
            AttemptNotSent(call=CALL, attempt=1, reason="connect error"),
            BudgetReleased(call=CALL, budget="team/run", amount=R),
        ],
        "none",
        "resend",
    ),
    "effect_unknown": (effect_unknown(), "unknown", "reconcile"),
    "completed": (
        [
            *admitted(),
            observed(200),
            BudgetSettled(call=CALL, budget="team/run", reserved=R, actual=3_000),
            CallCompleted(call=CALL, outcome="completed"),
        ],
        "applied",
        "none",
    ),
    "not_processed": (
        [
            *admitted(),
            observed(429, not_processed=True),
            BudgetReleased(call=CALL, budget="team/run", amount=R),
            CallCompleted(call=CALL, outcome="not_processed"),
        ],
        "none",
        "resend",
    ),
    "failed": (
        [
            *admitted(),
            observed(500),
            BudgetSettled(call=CALL, budget="team/run", reserved=R, actual=R),
            CallCompleted(call=CALL, outcome="failed"),
        ],
        "applied",
        "none",
    ),
    "reconciled_applied": (
        [
            *effect_unknown(),
            reconciled(True),
            BudgetUnheld(call=CALL, budget="team/run", amount=R, spent=R),
        ],
        "applied",
        "none",
    ),
    "reconciled_not_applied": (
        [
            *effect_unknown(),
            reconciled(False),
            BudgetUnheld(call=CALL, budget="team/run", amount=R, spent=0),
        ],
        "none",
        "resend",
    ),
}


def test_rows_cover_every_stage_of_the_spec_table() -> None:
    """The parametrized rows below cover exactly the nine docs/contract.md §6 stages."""
    assert set(ROWS) == set(STAGES)
    assert len(STAGES) == 9


@pytest.mark.parametrize("stage", list(ROWS))
def test_spec_table_row(stage: str) -> None:
    """Each contract.md §6 row: the events give the stage, its effect and its next operation."""
    events, effect, next_operation = ROWS[stage]
    state = work_state(events)
    assert state.stage == stage
    assert state.effect == effect
    assert state.next_operation == next_operation
    assert STAGE_TABLE[state.stage] == (effect, next_operation)
    assert state.call_id == CALL


def test_no_events_is_new() -> None:
    """A call with no events is ``new`` and has no effect."""
    state = work_state([])
    assert state == WorkState()
    assert state.stage == "new"
    assert state.effect == "none"


def test_manifest_fields_are_projected() -> None:
    """The manifest's identity fields land in the state; money counters follow budget events."""
    assert work_state([manifest(window=3600.0)]).idempotency_window_s == 3600.0
    state = work_state(admitted())
    assert state.idempotency_window_s is None
    assert state.last_attempt_at == 100.0
    assert state.idempotency_key == "k1"
    assert state.request_hash == "h1"
    assert state.provider == "openai"
    assert state.model == "gpt-x"
    assert state.budget == "team/run"
    assert state.budget_root == "team"
    assert state.created_at == 100.0
    assert state.attempts == 1
    assert state.worker == "w1"
    assert state.reserved == R
    assert state.reserved_at_admission == R
    assert state.cost is None


def test_effect_unknown_moves_reservation_to_held() -> None:
    """An interrupted call with its hold has nothing reserved and R held."""
    state = work_state(effect_unknown())
    assert (state.reserved, state.held) == (0, R)


@pytest.mark.parametrize(
    ("stage", "cost"), [("reconciled_applied", R), ("reconciled_not_applied", 0)]
)
def test_reconciled_call_has_its_decided_cost_and_nothing_held(stage: str, cost: int) -> None:
    """A reconcile releases the hold to exactly zero and sets the cost it decided."""
    state = work_state(ROWS[stage][0])
    assert (state.held, state.cost, state.reserved) == (0, cost, 0)


def test_settlement_flag_is_kept() -> None:
    """A settlement's flag (usage not believed) stays on the call, even after a later one."""
    flagged = BudgetSettled(call=CALL, budget="team/run", reserved=R, actual=R, flagged="usage")
    plain = BudgetSettled(call=CALL, budget="team/run", reserved=0, actual=0)
    assert work_state([*admitted(), flagged]).flagged == "usage"
    assert work_state([*admitted(), flagged, plain]).flagged == "usage"
    assert work_state([*admitted(), plain]).flagged is None


def test_correcting_a_charge_of_zero() -> None:
    """A failed call settled at 0 (a free model) and corrected to C costs exactly C."""
    events = [
        *admitted(),
        observed(500),
        BudgetSettled(call=CALL, budget="team/run", reserved=R, actual=0),
        reconciled(True, 7),
        BudgetCorrected(call=CALL, budget="team/run", settled=0, actual=7),
    ]
    assert work_state(events).cost == 7


def test_a_second_attempt_started_while_one_is_in_flight_is_ignored() -> None:
    """attempt.started during an in-flight attempt does not replace it (one attempt at a time)."""
    state = work_state([*admitted(), started(2, worker="w2", at=200.0)])
    assert (state.stage, state.attempts, state.worker, state.last_attempt_at) == (
        "in_flight",
        1,
        "w1",
        100.0,
    )


@pytest.mark.parametrize(
    ("status", "stage"), [(200, "completed"), (299, "completed"), (300, "failed")]
)
def test_only_2xx_completes(status: int, stage: str) -> None:
    """A 2xx answer completes the call; a 3xx (redirects are not followed) is failed."""
    assert work_state([*admitted(), observed(status)]).stage == stage


def test_completed_records_status_and_cost() -> None:
    """A settled call carries the response status and the actual cost."""
    state = work_state(ROWS["completed"][0])
    assert state.status == 200
    assert state.cost == 3_000
    assert state.reserved == 0


@pytest.mark.parametrize(
    "later",
    [
        [interrupted()],
        [reconciled(True)],
        [reconciled(False)],
        [observed(500)],
        [observed(429, not_processed=True)],
        [AttemptNotSent(call=CALL, attempt=1, reason="x")],
        [started(2), interrupted(2)],
        [CallRefused(call=CALL, reason="x", status=402)],
        [manifest(at=999.0)],
    ],
    ids=lambda evs: "+".join(e.kind for e in evs),
)
def test_completed_stays_completed(later: list[Event]) -> None:
    """A completed call stays completed whatever events follow."""
    state = work_state([*ROWS["completed"][0], *later])
    assert state.stage == "completed"
    assert state.status == 200
    assert state.created_at == 100.0


@pytest.mark.parametrize("stage", sorted(TERMINAL))
def test_terminal_stages_ignore_later_attempts(stage: str) -> None:
    """Terminal stages are not left by a later attempt.started, observed or interrupted."""
    events = ROWS[stage][0]
    state = work_state([*events, started(2), observed(200, attempt=2), interrupted(2)])
    assert state.stage == stage


def test_interrupt_of_an_older_attempt_is_ignored() -> None:
    """An attempt.interrupted for attempt 1 does not touch the in-flight attempt 2."""
    events = [
        *admitted(),
        AttemptNotSent(call=CALL, attempt=1, reason="connect error"),
        started(2),
        interrupted(1),
    ]
    state = work_state(events)
    assert state.stage == "in_flight"
    assert state.attempts == 2


def test_observation_of_an_older_attempt_is_ignored() -> None:
    """A late attempt.observed for attempt 1 does not complete attempt 2."""
    events = [
        *admitted(),
        AttemptNotSent(call=CALL, attempt=1, reason="connect error"),
        started(2),
        observed(200, attempt=1),
    ]
    assert work_state(events).stage == "in_flight"


@pytest.mark.parametrize(
    "stage",
    ["refused", "in_flight", "not_sent", "not_processed", "completed", "reconciled_applied"],
)
@pytest.mark.parametrize("applied", [True, False])
def test_reconcile_of_a_call_not_effect_unknown_or_failed_changes_nothing(
    stage: str, applied: bool
) -> None:
    """call.reconciled only acts on effect_unknown and failed; elsewhere nothing changes."""
    events = ROWS[stage][0]
    before = work_state(events)
    assert work_state([*events, reconciled(applied)]) == before
    assert {"effect_unknown", "failed"} == RECONCILABLE


@pytest.mark.parametrize(
    ("applied", "cost", "stage"),
    [(False, 0, "reconciled_not_applied"), (True, 1_234, "reconciled_applied")],
)
def test_reconciling_a_failed_call_corrects_its_cost(applied: bool, cost: int, stage: str) -> None:
    """A failed call reconciled: its stage follows the decision, its cost the correction."""
    events = [
        *ROWS["failed"][0],
        reconciled(applied, cost),
        BudgetCorrected(call=CALL, budget="team/run", settled=R, actual=cost),
    ]
    state = work_state(events)
    assert (state.stage, state.cost, state.status) == (stage, cost, 500)
    assert (state.reserved, state.held) == (0, 0)


def test_failed_reconciled_not_applied_takes_a_new_attempt() -> None:
    """Reconciled not applied frees the key: a new attempt goes in flight, and can complete."""
    events = [
        *ROWS["failed"][0],
        reconciled(False),
        BudgetCorrected(call=CALL, budget="team/run", settled=R, actual=0),
        started(2),
    ]
    assert (work_state(events).stage, work_state(events).attempts) == ("in_flight", 2)
    assert work_state([*events, observed(200, attempt=2)]).stage == "completed"


def transient_unknown(attempt: int = 1) -> list[Event]:
    """What the observation of a declared transient status of unknown effect records."""
    return [
        observed(500, attempt=attempt, effect_unknown=True),
        AttemptInterrupted(call=CALL, attempt=attempt, reason="answered 500", by="w1"),
        BudgetHeld(call=CALL, budget="team/run", amount=R),
    ]


def test_transient_status_of_unknown_effect_is_effect_unknown_and_held() -> None:
    """A 500 declared 'unknown': effect_unknown, reserve held, its status kept, no cost."""
    state = work_state([*admitted(), *transient_unknown()])
    assert (state.stage, state.effect, state.next_operation) == (
        "effect_unknown",
        "unknown",
        "reconcile",
    )
    assert (state.status, state.reserved, state.held, state.cost) == (500, 0, R, None)


def test_observed_answer_of_unknown_effect_alone_leaves_the_call_in_flight() -> None:
    """Only the attempt.interrupted recorded with it leads into effect_unknown (contract.md §6)."""
    events = [*admitted(), observed(500, effect_unknown=True)]
    assert work_state(events).stage == "in_flight"
    assert work_state(events).status == 500


def test_only_interrupted_leads_from_in_flight_to_effect_unknown() -> None:
    """Without attempt.interrupted an in-flight call stays in flight, however old it is."""
    events = [manifest(at=0.0), started(at=0.0)]
    assert work_state(events).stage == "in_flight"
    assert work_state([*events, interrupted()]).stage == "effect_unknown"


@pytest.mark.parametrize("stage", ["not_sent", "not_processed", "reconciled_not_applied"])
def test_resumable_stage_goes_back_in_flight_on_a_new_attempt(stage: str) -> None:
    """A resend from a resumable stage is a new attempt in flight."""
    state = work_state([*ROWS[stage][0], started(2)])
    assert state.stage == "in_flight"
    assert state.attempts == 2


def test_provider_resend_from_effect_unknown_is_a_new_attempt() -> None:
    """effect_unknown + attempt.started (provider resend inside its window) is in flight."""
    state = work_state([*effect_unknown(), started(2), observed(200, attempt=2)])
    assert state.stage == "completed"
    assert state.attempts == 2


def test_refusal_after_an_attempt_is_ignored() -> None:
    """call.refused only refuses a call that never started an attempt."""
    state = work_state([*admitted(), CallRefused(call=CALL, reason="x", status=402)])
    assert state.stage == "in_flight"


def test_a_call_keeps_the_periods_of_its_first_reservation_and_its_latest_tokens() -> None:
    """periods are fixed by the first budget.reserved; tokens are the latest attempt's."""
    first = BudgetReserved(
        call=CALL, budget="team/run", amount=R, tokens=40, periods={"team": "2026-12"}
    )
    later = BudgetReserved(call=CALL, budget="team/run", amount=R, tokens=7, periods={})
    state = work_state([manifest(), first])
    assert (state.periods, state.tokens) == ({"team": "2026-12"}, 40)
    state = work_state([manifest(), first, later])
    assert (state.periods, state.tokens) == ({"team": "2026-12"}, 7)


def authorized() -> list[Event]:
    """An effect-unknown call whose resend an operator authorized, its new attempt started."""
    return [
        *effect_unknown(),
        CallResendAuthorized(call=CALL, note="n", by="op"),
        BudgetReserved(call=CALL, budget="team/run", amount=R),
        started(attempt=2),
    ]


@pytest.mark.parametrize(
    "outcome",
    [
        [observed(200, attempt=2)],
        [observed(500, attempt=2)],
        [interrupted(attempt=2)],
    ],
    ids=["completed", "failed", "interrupted"],
)
def test_a_resend_authorization_is_spent_by_an_attempt_that_may_have_had_its_effect(
    outcome: list[Event],
) -> None:
    """call.resend_authorized sets resend_authorized (a bool: the stores keep it as JSON);
    it stands while its attempt is in flight, and an outcome that may be an effect (or a
    person's decision) spends it."""
    events = [*effect_unknown(), CallResendAuthorized(call=CALL, note="n", by="op")]
    assert work_state(events).resend_authorized is True
    assert work_state(authorized()).stage == "in_flight"
    assert work_state([*authorized(), *outcome]).resend_authorized is False
    # A person's decision before the attempt replaces the authorization.
    decided = work_state([*events, reconciled(applied=False)])
    assert (decided.stage, decided.resend_authorized) == ("reconciled_not_applied", False)


@pytest.mark.parametrize(
    "nothing",
    [
        [AttemptNotSent(call=CALL, attempt=2, reason="refused to connect")],
        [observed(429, attempt=2, not_processed=True)],
    ],
    ids=["not_sent", "not_processed"],
)
def test_an_authorized_resend_that_did_nothing_leaves_the_earlier_effect_unknown(
    nothing: list[Event],
) -> None:
    """The authorized attempt proved nothing about the first one: the call is effect_unknown
    again, with its hold and its authorization (it once read not_sent / not_processed,
    effect "none", with the first attempt's hold stuck and reconcile refused)."""
    release = BudgetReleased(call=CALL, budget="team/run", amount=R)
    state = work_state([*authorized(), *nothing, release])
    assert (state.stage, state.effect, state.next_operation) == (
        "effect_unknown",
        "unknown",
        "reconcile",
    )
    assert (state.held, state.reserved, state.resend_authorized) == (R, 0, True)
    # A person can still decide it; the decision spends the authorization.
    decided = work_state([*authorized(), *nothing, release, reconciled(applied=True)])
    assert (decided.stage, decided.resend_authorized) == ("reconciled_applied", False)


def provider_resend() -> list[Event]:
    """An effect-unknown call resent on the provider's dedup key: its hold released for the
    new attempt's reservation (contract.md §4), the attempt started."""
    return [
        *effect_unknown(),
        BudgetUnheld(call=CALL, budget="team/run", amount=R, spent=0),
        BudgetReserved(call=CALL, budget="team/run", amount=R),
        started(attempt=2),
    ]


@pytest.mark.parametrize(
    "nothing",
    [
        [AttemptNotSent(call=CALL, attempt=2, reason="refused to connect")],
        [observed(429, attempt=2, not_processed=True)],
    ],
    ids=["not_sent", "not_processed"],
)
def test_a_provider_resend_that_did_nothing_is_held_and_leaves_the_call_unknown(
    nothing: list[Event],
) -> None:
    """A resend on the provider key that proved nothing says nothing about the first
    attempt: the ledger holds its reservation (settlement.hold_if_nothing), and the call is
    effect_unknown again with that hold (it once read not_processed, effect "none", holding
    nothing). A call that was never unknown releases as before."""
    assert resends_unknown(provider_resend())
    released = [*nothing, BudgetReleased(call=CALL, budget="team/run", amount=R)]
    state = work_state([*provider_resend(), *hold_if_nothing(released)])
    assert (state.stage, state.effect, state.held, state.reserved) == (
        "effect_unknown",
        "unknown",
        R,
        0,
    )
    assert resend_proved_nothing(state, [*provider_resend(), *hold_if_nothing(released)])
    plain = [manifest(), BudgetReserved(call=CALL, budget="team/run", amount=R), started()]
    assert not resends_unknown(plain)
    assert not resends_unknown(authorized())  # the operator's resend keeps its own hold


def test_a_provider_resend_that_was_interrupted_is_not_retried_automatically() -> None:
    """Interrupted, the resend may itself have acted: no automatic retry follows it."""
    events = [*provider_resend(), interrupted(attempt=2)]
    events.append(BudgetHeld(call=CALL, budget="team/run", amount=R))
    state = work_state(events)
    assert state.stage == "effect_unknown"
    assert not resend_proved_nothing(state, events)


def late_answer(status: int = 200) -> Event:
    """attempt.late_answer for CALL's first attempt."""
    return AttemptLateAnswer(
        call=CALL,
        attempt=1,
        status=status,
        effect="applied",
        body_digest="sha256:00",
        body_bytes=2,
        usage=None,
        usage_problem=None,
        cost=R,
        observed_by="w1",
        generation=1,
        reason="fenced",
    )


@pytest.mark.parametrize(
    "events",
    [
        admitted(),
        effect_unknown(),
        [*effect_unknown(), reconciled(False)],
    ],
    ids=["in_flight", "effect_unknown", "reconciled_not_applied"],
)
def test_a_late_answer_is_evidence_and_moves_nothing(events: list[Event]) -> None:
    """attempt.late_answer changes no stage, status or money (contract.md §6.1)."""
    assert work_state([*events, late_answer()]) == work_state(events)


def test_as_dict_names_every_field() -> None:
    """as_dict is the state's fields by name (what the SQL stores keep)."""
    state = work_state(effect_unknown())
    assert as_dict(state) == {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}


def test_projection_reads_no_clock() -> None:
    """work_state runs with every clock patched to fail, and gives the same answer twice."""
    events = ROWS["reconciled_applied"][0]
    boom = mock.Mock(side_effect=AssertionError("the projection read a clock"))
    with (
        mock.patch.object(time, "time", boom),
        mock.patch.object(time, "monotonic", boom),
        mock.patch.object(time, "time_ns", boom),
    ):
        first = work_state(events)
        second = work_state(list(events))
    assert first == second
    assert boom.call_count == 0


# -- hypothesis --------------------------------------------------------------

attempts = st.integers(min_value=1, max_value=3)
amounts = st.integers(min_value=0, max_value=10_000)

call_events: st.SearchStrategy[Event] = st.one_of(
    st.builds(started, attempts),
    st.builds(
        observed,
        st.sampled_from([200, 201, 400, 429, 500, 503]),
        attempt=attempts,
        not_processed=st.booleans(),
        effect_unknown=st.booleans(),
    ),
    st.builds(interrupted, attempts),
    st.builds(lambda a: AttemptNotSent(call=CALL, attempt=a, reason="x"), attempts),
    st.builds(reconciled, st.booleans(), amounts),
    st.builds(lambda o: CallCompleted(call=CALL, outcome=o), st.sampled_from(["completed", "x"])),
    st.builds(lambda: CallRefused(call=CALL, reason="budget_exceeded", status=402)),
    st.builds(lambda a: BudgetReserved(call=CALL, budget="team/run", amount=a), amounts),
    st.builds(lambda a: BudgetReleased(call=CALL, budget="team/run", amount=a), amounts),
    st.builds(lambda a: BudgetHeld(call=CALL, budget="team/run", amount=a), amounts),
    st.builds(
        lambda a, s: BudgetUnheld(call=CALL, budget="team/run", amount=a, spent=s), amounts, amounts
    ),
    st.builds(
        lambda r, a: BudgetSettled(call=CALL, budget="team/run", reserved=r, actual=a),
        amounts,
        amounts,
    ),
    st.builds(
        lambda s, a: BudgetCorrected(call=CALL, budget="team/run", settled=s, actual=a),
        amounts,
        amounts,
    ),
    st.builds(manifest, at=st.floats(min_value=0, max_value=1e9)),
)

#: A call's events: a manifest first, then anything a store could append for it.
valid_sequences = st.builds(
    lambda head, tail: [head, *tail], st.builds(manifest), st.lists(call_events, max_size=25)
)


def _fold(state: WorkState, events: Sequence[Event]) -> WorkState:
    return reduce(apply, events, state)


@settings(max_examples=300, deadline=None)
@given(st.lists(call_events, max_size=25), st.lists(call_events, max_size=25))
def test_projection_is_a_deterministic_fold(a: list[Event], b: list[Event]) -> None:
    """work_state is deterministic, and work_state(a + b) is the fold of b continued from a."""
    assert work_state(a + b) == work_state(list(a + b))
    assert work_state(a + b) == _fold(work_state(a), b)


@settings(max_examples=300, deadline=None)
@given(valid_sequences)
def test_stage_is_always_a_spec_stage(events: list[Event]) -> None:
    """After a manifest, every prefix projects to a docs/contract.md §6 stage with its table row."""
    state = WorkState()
    for event in events:
        state = apply(state, event)
        assert state.stage in STAGE_TABLE
        assert state.stage in STAGES
        assert (state.effect, state.next_operation) == STAGE_TABLE[state.stage]
        assert state.reserved >= 0
        assert state.held >= 0


@settings(max_examples=300, deadline=None)
@given(valid_sequences)
def test_terminal_rungs_are_never_left(events: list[Event]) -> None:
    """Once a prefix is terminal, every longer prefix has the same stage.

    The one way down: a ``failed`` call reconciled by a person (``call.reconciled``).
    """
    state = WorkState()
    terminal_stage = None
    for event in events:
        before, state = state, apply(state, event)
        if terminal_stage == "failed" and state.stage != "failed":
            assert isinstance(event, CallReconciled)
            assert state.stage == (
                "reconciled_applied" if event.applied else "reconciled_not_applied"
            )
            terminal_stage = state.stage if state.stage in TERMINAL else None
        elif terminal_stage is not None:
            assert state.stage == terminal_stage, (before.stage, event)
        elif state.stage in TERMINAL:
            terminal_stage = state.stage


@settings(max_examples=300, deadline=None)
@given(valid_sequences)
def test_effect_unknown_only_through_interrupted(events: list[Event]) -> None:
    """The step into effect_unknown is an attempt.interrupted for the current attempt, or
    the hold the ledger writes after an attempt that proved nothing while it resent an
    unknown call (contract.md §4.1; verify names such a hold on any other call)."""
    state = WorkState()
    for event in events:
        after = apply(state, event)
        if after.stage == "effect_unknown" and state.stage != "effect_unknown":
            if isinstance(event, BudgetHeld):
                assert state.stage in ("not_sent", "not_processed")
            else:
                assert isinstance(event, AttemptInterrupted)
                assert event.attempt == state.attempts
                assert state.stage == "in_flight"
        state = after


@settings(max_examples=300, deadline=None)
@given(valid_sequences, st.data())
def test_late_answers_anywhere_change_no_projection(
    events: list[Event], data: st.DataObject
) -> None:
    """Late answers inserted anywhere in a call's events leave every projection as it was."""
    where = data.draw(st.lists(st.integers(0, len(events)), max_size=3))
    mixed = list(events)
    for index in sorted(where, reverse=True):
        mixed.insert(index, late_answer(data.draw(st.sampled_from([200, 400, 500]))))
    assert work_state(mixed) == work_state(events)
