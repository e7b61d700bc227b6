"""What a shutdown tells the caller of a call it cut off once the call had ended (the
503 ``shutting_down`` of contract §9): a rule, tested without a proxy. The proxy's own
answer is tested in tests/test_second_signal.py."""

from __future__ import annotations

import pytest

from effectguard.rules.guidance import after_cut_off


@pytest.mark.parametrize("keyed", [True, False])
@pytest.mark.parametrize("stage", ["not_sent", "not_processed"])
def test_a_call_that_took_no_effect_may_be_resent(stage: str, keyed: bool) -> None:
    advice, safe = after_cut_off("call_1", stage, keyed)
    assert safe
    assert ("same Idempotency-Key" in advice) == keyed, advice
    assert keyed or "the resend is a new call" in advice


def test_a_keyed_call_that_ended_is_resent_for_its_result() -> None:
    advice, safe = after_cut_off("call_1", "completed", keyed=True)
    assert not safe
    assert advice == "resend it with the same Idempotency-Key to receive its result"


@pytest.mark.parametrize("stage", ["completed", "failed", "missing"])
def test_a_key_less_call_that_ended_is_not_resent_for_its_result(stage: str) -> None:
    """Without a key a resend is a new call, a second effect: its result is read instead."""
    advice, safe = after_cut_off("call_1", stage, keyed=False)
    assert not safe
    assert "new call" in advice and "effectguard show call_1" in advice, advice
    assert "Idempotency-Key to receive" not in advice
