"""The pure rules of effectguard/rules/errorshape.py: each provider's refusal shape
(docs/contract.md §9), read as its SDK reads it."""

from __future__ import annotations

import pytest

from effectguard.callpath.wire import error_headers, final_answer
from effectguard.errors import Refusal
from effectguard.rules.errorshape import error_body

UNKNOWN = Refusal(
    409,
    "effect_unknown",
    "call c1 has an unknown effect",
    call_id="c1",
    stage="effect_unknown",
    next_operation="reconcile",
)


def test_openai_and_stripe_nest_the_refusal_in_error_with_a_code() -> None:
    for shape in ("openai", "stripe"):
        error = error_body(shape, UNKNOWN)["error"]
        assert (error["type"], error["code"]) == ("effect_unknown", "effect_unknown")
        assert error["call_id"] == "c1"
        assert error["next_operation"] == "reconcile"


def test_anthropic_has_no_code() -> None:
    body = error_body("anthropic", UNKNOWN)
    assert body["type"] == "error" and "code" not in body["error"]


def test_postmark_has_an_error_code_above_postmarks_and_the_type_in_its_message() -> None:
    body = error_body("postmark", UNKNOWN)
    assert body["ErrorCode"] == 9409
    assert body["Message"] == "effect_unknown: call c1 has an unknown effect"
    assert body["effectguard"] == {
        "type": "effect_unknown",
        "message": "call c1 has an unknown effect",
        "call_id": "c1",
        "stage": "effect_unknown",
        "next_operation": "reconcile",
    }


def test_github_has_its_message_and_status() -> None:
    body = error_body("github", UNKNOWN)
    assert (body["message"], body["status"]) == (UNKNOWN.message, "409")
    assert body["effectguard"]["type"] == "effect_unknown"


@pytest.mark.parametrize("retryable", [True, False])
def test_stripe_is_told_in_its_own_header_too(retryable: bool) -> None:
    said = "true" if retryable else "false"
    refusal = Refusal(503, "ledger_unavailable", "down", retryable=retryable)
    assert error_headers(refusal, "stripe")["stripe-should-retry"] == said
    assert error_headers(refusal, "stripe")["x-should-retry"] == said
    assert "stripe-should-retry" not in error_headers(refusal, "openai")


def test_a_final_answer_replaces_stripes_own_retry_advice() -> None:
    given = [(b"stripe-should-retry", b"true"), (b"x-should-retry", b"true"), (b"a", b"1")]
    assert sorted(final_answer(given, "stripe")) == [
        (b"a", b"1"),
        (b"stripe-should-retry", b"false"),
        (b"x-should-retry", b"false"),
    ]
    assert (b"stripe-should-retry", b"true") in final_answer(given, "openai")
