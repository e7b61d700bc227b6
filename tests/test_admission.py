"""SPEC §4 idempotency decisions, pure: decide_keyed and decide_retry over WorkState values."""

from __future__ import annotations

import pytest

from effectguard.rules.admission import Decision, decide_keyed, decide_retry
from effectguard.rules.workstate import STAGES, WorkState

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
    assert refusal.stage == existing.stage
    assert refusal.next_operation == existing.next_operation


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


@pytest.mark.parametrize("stage", [s for s in STAGES if s not in ("in_flight", "effect_unknown")])
def test_retry_of_a_resolved_call_is_new_work(stage: str) -> None:
    """A retry matching only a resolved call is independent work (admitted)."""
    assert decide_retry(state(stage)).action == "admit"
