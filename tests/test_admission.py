"""Idempotency decisions (contract.md §4), pure: decide_keyed and decide_retry over WorkStates."""

from __future__ import annotations

import dataclasses

import pytest
from eventkit import late_200

from effectguard.providers import load_providers
from effectguard.rules.admission import Decision, decide_keyed, decide_retry
from effectguard.rules.events import (
    AttemptStarted,
    BudgetReserved,
    CallManifest,
)
from effectguard.rules.guidance import show_command
from effectguard.rules.settlement import Answer, settle
from effectguard.rules.usage import UsageResult
from effectguard.rules.workstate import STAGES, WorkState, work_state

HASH = "h" * 64
OTHER = "o" * 64
CREATED = 1_000.0


def state(stage: str, *, window: float | None = None, request_hash: str = HASH) -> WorkState:
    """A stored call in ``stage`` created at CREATED."""
    return WorkState(
        call_id="call_x",
        stage=stage,  # type: ignore[arg-type]
        attempts=1,
        idempotency_key="key-1",
        request_hash=request_hash,
        budget="team",
        budget_root="team",
        created_at=CREATED,
        idempotency_window_s=window,
    )


def assert_refused(decision: Decision, status: int, type_: str, existing: WorkState) -> None:
    """The decision refuses with ``status``/``type_`` and names the existing call's state."""
    assert decision.action == "refuse"
    assert decision.existing == existing
    refusal = decision.refusal
    assert refusal is not None
    assert (refusal.status, refusal.type) == (status, type_)
    assert refusal.call_id == existing.call_id
    assert isinstance(refusal.message, str) and refusal.message  # SDKs show it to a person
    # ... and it names the command that shows this very call (so the exception text is enough).
    assert show_command(existing.call_id) in refusal.message
    assert refusal.stage == existing.stage
    assert refusal.next_operation == existing.next_operation


@pytest.mark.parametrize("stage", ["new", "refused"])
def test_key_of_a_refused_call_admits_new_work(stage: str) -> None:
    """A key whose call was refused before dispatch (or never written) is free: admit."""
    decision = decide_keyed(state(stage), HASH, CREATED)
    assert decision == Decision("admit")


def test_new_key_is_admitted() -> None:
    """No call holds the key: admit and dispatch."""
    decision = decide_keyed(None, HASH, CREATED)
    assert decision == Decision("admit")
    assert decision.refusal is None


@pytest.mark.parametrize("stage", ["completed", "failed"])
def test_finished_call_with_same_hash_is_replayed(stage: str) -> None:
    """A completed (or failed: its answer is the stored error) call with the same hash replays."""
    existing = state(stage)
    decision = decide_keyed(existing, HASH, CREATED + 10**6)
    assert decision.action == "replay"
    assert decision.existing == existing
    assert decision.refusal is None


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("window", [None, 3600.0])
def test_different_hash_is_refused_in_any_state(stage: str, window: float | None) -> None:
    """Any stage, a different request hash under the same key: 422 idempotency_key_reused."""
    existing = state(stage, window=window)
    decision = decide_keyed(existing, OTHER, CREATED)
    assert_refused(decision, 422, "idempotency_key_reused", existing)


def test_in_flight_is_refused_in_progress() -> None:
    """A call in flight under the key: 409 in_progress, next operation wait."""
    existing = state("in_flight")
    decision = decide_keyed(existing, HASH, CREATED)
    assert_refused(decision, 409, "in_progress", existing)
    assert decision.refusal is not None and decision.refusal.next_operation == "wait"


@pytest.mark.parametrize("now", [CREATED, CREATED + 10**6])
def test_effect_unknown_without_provider_idempotency_is_refused(now: float) -> None:
    """Effect unknown and no declared provider idempotency: 409 effect_unknown, never resent."""
    existing = state("effect_unknown")
    decision = decide_keyed(existing, HASH, now)
    assert_refused(decision, 409, "effect_unknown", existing)
    assert decision.refusal is not None and decision.refusal.next_operation == "reconcile"


@pytest.mark.parametrize("elapsed", [0.0, 30.0, 60.0])
def test_effect_unknown_inside_the_provider_window_is_resent(elapsed: float) -> None:
    """Effect unknown, provider idempotency declared, within the window (inclusive): resend."""
    existing = state("effect_unknown", window=60.0)
    decision = decide_keyed(existing, HASH, CREATED + elapsed)
    assert decision.action == "provider_resend"
    assert decision.existing == existing
    assert decision.refusal is None


@pytest.mark.parametrize("elapsed", [60.001, 61.0, 10**6])
def test_effect_unknown_past_the_provider_window_is_refused(elapsed: float) -> None:
    """Effect unknown past the provider's dedup window: 409 effect_unknown."""
    existing = state("effect_unknown", window=60.0)
    decision = decide_keyed(existing, HASH, CREATED + elapsed)
    assert_refused(decision, 409, "effect_unknown", existing)


def test_zero_window_only_covers_the_same_instant() -> None:
    """A declared window of 0 s is a window (not "no window"): only now == created_at resends."""
    existing = state("effect_unknown", window=0.0)
    assert decide_keyed(existing, HASH, CREATED).action == "provider_resend"
    assert decide_keyed(existing, HASH, CREATED + 0.5).action == "refuse"


@pytest.mark.parametrize("stage", ["not_sent", "not_processed", "reconciled_not_applied"])
def test_resumable_call_gets_a_new_attempt(stage: str) -> None:
    """Not sent / not processed / reconciled not-applied, same hash: a new attempt, same key."""
    existing = state(stage)
    decision = decide_keyed(existing, HASH, CREATED + 10**6)
    assert decision.action == "attempt"
    assert decision.existing == existing
    assert decision.refusal is None


def test_reconciled_applied_is_refused() -> None:
    """A call reconciled as applied: 409 reconciled_applied, never sent again."""
    existing = state("reconciled_applied")
    decision = decide_keyed(existing, HASH, CREATED)
    assert_refused(decision, 409, "reconciled_applied", existing)


def test_provider_window_does_not_resend_other_stages() -> None:
    """A declared provider window never turns in_flight or reconciled_applied into a resend."""
    for stage in ("in_flight", "reconciled_applied"):
        decision = decide_keyed(state(stage, window=3600.0), HASH, CREATED)
        assert decision.action == "refuse"


# -- key-less retries ---------------------------------------------------------------


def test_retry_of_nothing_is_new_work() -> None:
    """A declared retry with no unresolved call to match is admitted as new work."""
    assert decide_retry(None) == Decision("admit")


def test_retry_of_in_flight_call_joins_it() -> None:
    """A declared retry of an in-flight call waits for and receives that call's result."""
    existing = state("in_flight")
    decision = decide_retry(existing)
    assert decision.action == "join"
    assert decision.existing == existing
    assert decision.refusal is None


@pytest.mark.parametrize("window", [None, 3600.0])
def test_retry_of_effect_unknown_call_is_refused(window: float | None) -> None:
    """A declared retry of a call whose effect is unknown: 409 effect_unknown."""
    existing = state("effect_unknown", window=window)
    assert_refused(decide_retry(existing), 409, "effect_unknown", existing)


SETTLED = ("completed", "failed")
RESTING = ("not_sent", "not_processed")


@pytest.mark.parametrize(
    "stage",
    [
        s
        for s in STAGES
        if s not in ("in_flight", "effect_unknown", "reconciled_applied", *SETTLED, *RESTING)
    ],
)
def test_retry_of_a_resolved_call_is_new_work(stage: str) -> None:
    """A retry matching only a resolved call is independent work (admitted)."""
    assert decide_retry(state(stage)).action == "admit"


@pytest.mark.parametrize("stage", RESTING)
def test_retry_of_a_resting_call_its_caller_left_joins_it(stage: str) -> None:
    """A call resting between its owner's automatic retries reaches decide_retry only as
    the one the retry's own caller left (ledger/retries): the retry joins it, which waits
    out the back-off (callpath/join), instead of being sent beside the owner's retry."""
    existing = state(stage)
    assert decide_retry(existing) == Decision("join", existing)


def test_retry_of_a_call_decided_applied_is_refused() -> None:
    """A call decided applied reaches decide_retry only as the one the retry names or
    its caller left (ledger/retries): 409 reconciled_applied, never a second effect."""
    existing = state("reconciled_applied")
    assert_refused(decide_retry(existing), 409, "reconciled_applied", existing)


@pytest.mark.parametrize("attempt", [1, 2])
def test_a_contradicted_not_applied_call_is_neither_resent_nor_retried(attempt: int) -> None:
    """A call decided not applied after attempt 2, and a late 200 kept for attempt
    ``attempt`` (the last, or an earlier one: the provider applied the call either way):
    its keyed resend and its key-less declared retry are refused 409 late_answer_applied
    with next_operation none. Without such an answer both are what the decision allows."""
    existing = dataclasses.replace(state("reconciled_not_applied"), attempts=2)
    late = late_200("call_x", attempt)
    for decision in (
        decide_keyed(existing, HASH, CREATED, late),
        decide_retry(existing, late),
    ):
        refusal = decision.refusal
        assert (decision.action, decision.existing) == ("refuse", existing)
        assert refusal is not None and (refusal.status, refusal.type) == (
            409,
            "late_answer_applied",
        )
        assert (refusal.call_id, refusal.stage, refusal.next_operation) == (
            "call_x",
            "reconciled_not_applied",
            "none",
        )
        assert f"late answer kept for attempt {attempt} (status 200)" in refusal.message
        assert show_command("call_x") in refusal.message
    assert decide_keyed(existing, HASH, CREATED) == Decision("attempt", existing)
    assert decide_retry(existing) == Decision("admit")


@pytest.mark.parametrize("stage", SETTLED)
def test_retry_of_a_settled_call_its_caller_left_is_its_replay(stage: str) -> None:
    """A settled call reaches decide_retry only as the one the retry's own caller left
    (ledger/retries, callpath/orphans): the retry gets its answer, not a second effect."""
    existing = state(stage)
    assert decide_retry(existing) == Decision("replay", existing)


# -- a provider's error answer, from its declaration to the keyed resend (contract.md §12) ---------

PROVIDERS = load_providers()


def _after_answer(provider: str, status: int) -> WorkState:
    """The call a keyed request left behind when the provider answered ``status``."""
    declared = PROVIDERS[provider]
    price = declared.price_for("gpt-4o-mini" if provider == "openai" else "claude-haiku-4-5")
    assert price is not None
    effect = declared.answer_effect(status)
    answer = Answer(
        status=status,
        not_processed=effect == "none",
        headers={},
        body='{"error": {}}',
        body_encoding="utf8",
        result=UsageResult(None, "missing"),
        effect_unknown=effect == "unknown",
    )
    admitted = [
        CallManifest(
            call="call_x",
            request_hash=HASH,
            provider=provider,
            endpoint="/v1/x",
            method="POST",
            model=None,
            idempotency_key="key-1",
            budget="team",
            budget_root="team",
            effect_kind="billable",
            body="{}",
            at=CREATED,
        ),
        BudgetReserved(call="call_x", budget="team", amount=500),
        AttemptStarted(call="call_x", attempt=1, worker="w", generation=1, at=CREATED),
    ]
    settled = settle("call_x", 1, "team", 500, price, answer, by="w")
    return work_state([*admitted, *settled.events])


TRANSIENT = [(p, s) for p in ("openai", "anthropic") for s in sorted(PROVIDERS[p].transient)]


@pytest.mark.parametrize(("provider", "status"), TRANSIENT)
def test_keyed_resend_after_a_declared_transient_status_is_never_a_replay(
    provider: str, status: int
) -> None:
    """After a declared transient status a keyed resend is a new attempt or 409 effect_unknown."""
    existing = _after_answer(provider, status)
    decision = decide_keyed(existing, HASH, CREATED + 1)
    meaning = PROVIDERS[provider].transient[status]
    if meaning == "none":
        assert existing.stage == "not_processed"
        assert (decision.action, existing.reserved, existing.held) == ("attempt", 0, 0)
    else:
        assert existing.stage == "effect_unknown"
        assert (existing.reserved, existing.held, existing.cost) == (0, 500, None)
        assert_refused(decision, 409, "effect_unknown", existing)


def test_bundled_declarations_name_the_documented_transient_statuses() -> None:
    """OpenAI declares 500 and 503, Anthropic 500 and 529: each with a meaning."""
    assert TRANSIENT == [("openai", 500), ("openai", 503), ("anthropic", 500), ("anthropic", 529)]


@pytest.mark.parametrize(("provider", "status"), [("openai", 502), ("anthropic", 504)])
def test_undeclared_error_status_is_failed_and_replayed(provider: str, status: int) -> None:
    """An error status the provider does not declare is failed (applied) and replayed."""
    existing = _after_answer(provider, status)
    assert (existing.stage, existing.cost) == ("failed", 500)
    assert decide_keyed(existing, HASH, CREATED + 1).action == "replay"


def test_an_authorized_resend_of_an_unknown_call_is_one_new_attempt() -> None:
    """An effect-unknown call with an operator's resend authorization is attempted (keyed or
    declared retry); without it, it is refused; the attempt spends the authorization."""
    from effectguard.rules.admission import decide_keyed, decide_retry
    from effectguard.rules.workstate import WorkState, replace

    unknown = WorkState(call_id="c", stage="effect_unknown", request_hash="h", attempts=1)
    authorized = replace(unknown, resend_authorized=True)
    assert decide_keyed(unknown, "h", 0.0).action == "refuse"
    assert decide_keyed(authorized, "h", 0.0).action == "attempt"
    assert decide_retry(unknown).action == "refuse"
    assert decide_retry(authorized).action == "attempt"


def test_an_authorized_resend_is_an_attempt_of_that_very_call() -> None:
    """The attempt decision for an authorized resend carries the call it resends (the
    store starts the new attempt on it)."""
    from effectguard.rules.workstate import replace

    authorized = replace(state("effect_unknown"), resend_authorized=True)
    assert decide_keyed(authorized, HASH, CREATED + 1) == Decision("attempt", authorized)
    assert decide_retry(authorized) == Decision("attempt", authorized)
