"""A Stripe-like fake: ``POST /v1/payment_intents``, ``/v1/refunds`` (and any other
``POST /v1/...``, which makes a generic object) and the PaymentIntents metadata search,
as https://docs.stripe.com/idempotency and https://docs.stripe.com/api/payment_intents/search
describe them (read 2026-12-01).

* ``Idempotency-Key``: the first result under a key is saved, whatever it is (a 500
  included), and replayed to every later request with that key and the same parameters
  (``Idempotent-Replayed: true``); different parameters get 400 ``idempotency_error``; a
  request while the first is still executing gets 409. Keys are never pruned here (Stripe
  prunes after at least 24 hours: longer than any test).
* Bodies are form-encoded: Stripe documents form-encoded request bodies only
  (https://docs.stripe.com/api, read 2026-12-01 via the stored documentation index).
  What it does with another encoding is not documented; this fake refuses it with 400
  ``invalid_request_error`` before any work.
* ``x-fake-status: 500`` makes the request do its effect and then answer Stripe's 500
  ``api_error`` (which the key then saves), like a failure after the work.
  ``x-fake-status: 503`` answers 503 before anything (no effect, nothing saved under the
  key), like a server error ahead of the API: Stripe lists 502/503/504 as server errors
  and says only 500s are saved (https://docs.stripe.com/error-low-level, read 2026-12-01).
  ``x-fake-status: 429`` answers 429 ``rate_limit`` before anything, as Stripe's rate
  limiters run ahead of its idempotency layer (same page): no effect, nothing saved.
* The search (``query=metadata['effectguard_op']:'OP'``) shows an object only ``LAG_S``
  after it was created.
* Errors have Stripe's shape: ``{"error": {"type", "code"?, "message", "param"?}}``.
* ``Stripe-Account`` (or ``Stripe-Context``) acts in that account
  (https://docs.stripe.com/connect/authentication): its keys and its objects are its own,
  and a search finds only the account's objects.

Usage: ``python stripe_like.py RECEIPTS PORT LAG_S``.
"""

from __future__ import annotations

import re
import uuid
from typing import Any
from urllib.parse import parse_qsl

from aiohttp import web
from common import delay, serve, tool_from_argv

TOOL = tool_from_argv()
#: Idempotency key -> (the parameters, the saved status and body), or None while executing.
SAVED: dict[str, tuple[dict[str, Any], tuple[int, dict[str, Any]] | None]] = {}
#: What a create path makes; any other POST (a confirm, a capture, a customer, a payout
#: ...) makes an "object", deduplicated on its key like every Stripe POST.
KINDS = {"/v1/payment_intents": "payment_intent", "/v1/refunds": "refund"}
QUERY = re.compile(r"^metadata\['effectguard_op'\]:'([^']*)'$")


def error(status: int, kind: str, message: str, **extra: str) -> web.Response:
    return web.json_response({"error": {"type": kind, "message": message, **extra}}, status=status)


def params(body: bytes, content_type: str) -> dict[str, Any]:
    """Form fields (``metadata[k]=v`` folded into ``metadata``); any other body is refused."""
    if content_type != "application/x-www-form-urlencoded":
        raise ValueError(content_type)
    out: dict[str, Any] = {}
    for name, value in parse_qsl(body.decode(), keep_blank_values=True):
        nested = re.fullmatch(r"(\w+)\[(\w+)\]", name)
        if nested:
            out.setdefault(nested[1], {})[nested[2]] = value
        else:
            out[name] = value
    return out


def account(request: web.Request) -> str:
    """The account a request acts in: a connected or related one, else the platform's."""
    return (
        request.headers.get("Stripe-Context") or request.headers.get("Stripe-Account") or "platform"
    )


def authorized(request: web.Request) -> bool:
    return request.headers.get("Authorization", "").startswith("Bearer sk_")


async def create(request: web.Request) -> web.Response:
    """Create a PaymentIntent or a Refund, once per idempotency key."""
    await delay(request)
    if request.headers.get("x-fake-status") == "503":
        return error(503, "api_error", "The service is temporarily unavailable.")
    if request.headers.get("x-fake-status") == "429":
        return error(429, "invalid_request_error", "Too many requests.", code="rate_limit")
    if not authorized(request):
        return error(401, "invalid_request_error", "Invalid API Key provided.")
    body = await request.read()
    try:
        fields = params(body, request.content_type)
    except ValueError:
        return error(400, "invalid_request_error", "Invalid request body.")
    key = request.headers.get("Idempotency-Key")
    if key is not None:
        key = f"{account(request)}/{key}"  # each account has its own keys
    if key is not None and key in SAVED:
        first, saved = SAVED[key]
        if first != fields:
            return error(
                400,
                "idempotency_error",
                "Keys for idempotent requests can only be used with the same parameters "
                "they were first used with.",
            )
        if saved is None:
            return error(409, "idempotency_error", "There is currently another in-progress "
                         "request using this Idempotent Key.")  # fmt: skip
        status, answer = saved
        return web.json_response(answer, status=status, headers={"Idempotent-Replayed": "true"})
    if "amount" not in fields and request.path == "/v1/payment_intents":
        # Validation failures are not saved under the key (Stripe: "we don't save").
        return error(400, "invalid_request_error", "Missing required param: amount.",
                     code="parameter_missing", param="amount")  # fmt: skip
    if key is not None:
        SAVED[key] = (fields, None)
    status, answer = await _apply(request, body, fields)
    if key is not None:
        SAVED[key] = (fields, (status, answer))
    return web.json_response(answer, status=status)


async def _apply(request: web.Request, body: bytes, fields: dict[str, Any]) -> tuple[int, Any]:
    kind = KINDS.get(request.path, "object")
    metadata = fields.get("metadata") or {}
    op = metadata.get("effectguard_op") if isinstance(metadata, dict) else None
    obj = {
        "id": {"payment_intent": "pi_", "refund": "re_"}.get(kind, "obj_") + uuid.uuid4().hex[:24],
        "object": kind,
        "amount": int(fields.get("amount") or 0),
        "currency": fields.get("currency", "usd"),
        "metadata": metadata,
        "status": "requires_payment_method" if kind == "payment_intent" else "succeeded",
    }
    await TOOL.effect(request.path, op, body, obj["id"])
    if kind == "payment_intent" and op is not None:
        TOOL.index.add(f"{account(request)}/{op}", obj)
    if request.headers.get("x-fake-status") == "500":
        return 500, {"error": {"type": "api_error", "message": "An unknown error occurred."}}
    return 200, obj


async def search(request: web.Request) -> web.Response:
    """``GET /v1/payment_intents/search?query=metadata['effectguard_op']:'OP'``."""
    if not authorized(request):
        return error(401, "invalid_request_error", "Invalid API Key provided.")
    match = QUERY.match(request.query.get("query", ""))
    if match is None:
        return error(400, "invalid_request_error", "This fake understands one query shape.")
    found = TOOL.index.find(f"{account(request)}/{match[1]}")
    return web.json_response(
        {"object": "search_result", "url": request.path, "has_more": False, "data": found}
    )


def main() -> None:
    app = web.Application()
    app.router.add_get("/v1/payment_intents/search", search)
    app.router.add_post("/v1/payment_intents", create)
    app.router.add_post("/v1/refunds", create)
    app.router.add_post("/v1/{tail:.+}", create)
    serve(app)


if __name__ == "__main__":
    main()
