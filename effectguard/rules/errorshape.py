"""The shape of a refusal's body and the retry headers each provider's SDK reads.

A refusal must reach the application as its SDK's usual exception (docs/contract.md §9):
an SDK that cannot parse the body crashes instead (postmarker reads ``ErrorCode`` and
``Message``), and one that reads its own retry header ignores ``x-should-retry``
(stripe-python obeys ``Stripe-Should-Retry`` and otherwise retries every 409 and 5xx).
A provider declaration names its shape (``error_shape``); these rules build it. Pure.
"""

from __future__ import annotations

from typing import Any, Final, Literal

from effectguard.errors import Refusal

ErrorShape = Literal["openai", "anthropic", "stripe", "postmark", "github"]
ERROR_SHAPES: Final = ("openai", "anthropic", "stripe", "postmark", "github")

#: Postmark's ``ErrorCode`` of an effectguard refusal: this base plus the HTTP status
#: (9402 budget_exceeded, 9409 in_progress or effect_unknown, 9503 ledger_unavailable ...).
#: Postmark's own API error codes are far below it (docs/contract.md §9).
POSTMARK_CODE_BASE: Final = 9000

#: Retry headers an SDK reads instead of ``x-should-retry``, by shape.
_RETRY_HEADERS: Final[dict[str, str]] = {"stripe": "stripe-should-retry"}


def shape_of_dialect(dialect: str) -> ErrorShape:
    """The shape a declaration that names none answers in: its dialect's."""
    return "anthropic" if dialect == "anthropic" else "openai"


def retry_headers(shape: str, should_retry: bool) -> dict[str, str]:
    """``x-should-retry`` and the shape's own retry header, both saying ``should_retry``."""
    value = "true" if should_retry else "false"
    headers = {"x-should-retry": value}
    if (own := _RETRY_HEADERS.get(shape)) is not None:
        headers[own] = value
    return headers


def shape_retry_header(shape: str) -> str | None:
    """The retry header the shape's SDK reads besides ``x-should-retry``, if any."""
    return _RETRY_HEADERS.get(shape)


def detail(refusal: Refusal, *, code: bool) -> dict[str, Any]:
    """effectguard's own account of a refusal: its type, message and call fields."""
    found: dict[str, Any] = {"type": refusal.type, "message": refusal.message}
    if code:
        found["code"] = refusal.type
    for name in ("param", "call_id", "stage", "next_operation"):
        value = getattr(refusal, name)
        if value is not None:
            found[name] = value
    return found


def error_body(shape: str, refusal: Refusal) -> dict[str, Any]:
    """A refusal in ``shape``. Every shape keeps effectguard's ``type`` readable: in
    ``error`` (openai, anthropic, stripe) or in ``effectguard`` (postmark, github), and at
    the head of the message where the SDK keeps nothing else (postmark)."""
    if shape == "anthropic":
        return {"type": "error", "error": detail(refusal, code=False)}
    if shape == "postmark":
        return {
            "ErrorCode": POSTMARK_CODE_BASE + refusal.status,
            "Message": f"{refusal.type}: {refusal.message}",
            "effectguard": detail(refusal, code=False),
        }
    if shape == "github":
        return {
            "message": refusal.message,
            "status": str(refusal.status),
            "effectguard": detail(refusal, code=False),
        }
    # OpenAI's shape is Stripe's too: {"error": {"type", "code", "message", "param"}}.
    return {"error": detail(refusal, code=True)}
