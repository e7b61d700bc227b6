"""A Stripe-like fake: ``POST /v1/payment_intents``, ``/v1/refunds``, ``/v1/customers``,
``/v1/charges``, ``/v1/invoices`` (and any other ``POST /v1/...``, which makes a generic
object) and the metadata search of PaymentIntents, Customers, Charges and Invoices, as
https://docs.stripe.com/idempotency and https://docs.stripe.com/api/payment_intents/search
describe them (read 2026-12-01), and /api/customers/search, /api/charges/search and
/api/invoices/search (read 2026-12-04): each search answers a ``search_result`` whose
``data`` holds only that resource's objects, empty when nothing matches.

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
  after it was created, with the metadata it was created with.
* ``POST /_fake/search-answer`` (form field ``answer``) makes every later search answer
  otherwise, for tests of answers that prove nothing: ``503`` (Stripe's error shape),
  ``html`` (a 200 HTML page from something in the way), ``no-data`` (a 200 JSON object
  without ``data``), ``other-op`` (a 200 search result whose one object carries another
  operation's id); ``stripe`` puts it back.
* Errors have Stripe's shape: ``{"error": {"type", "code"?, "message", "param"?}}``.
* ``Stripe-Account`` (or ``Stripe-Context``) acts in that account
  (https://docs.stripe.com/connect/authentication): its keys and its objects are its own,
  and a search finds only the account's objects.

Usage: ``python stripe_like.py RECEIPTS PORT LAG_S``.
"""

from __future__ import annotations

import base64
import re
import uuid
from typing import Any
from urllib.parse import parse_qsl

from aiohttp import web
from common import delay, serve, tool_from_argv

TOOL = tool_from_argv()
#: Idempotency key -> (the parameters, the saved status and body), or None while executing.
SAVED: dict[str, tuple[dict[str, Any], tuple[int, dict[str, Any]] | None]] = {}
#: What a create path makes, and its id prefix; any other POST (a confirm, a capture, a
#: payout ...) makes an "object", deduplicated on its key like every Stripe POST.
KINDS = {
    "/v1/payment_intents": ("payment_intent", "pi_"),
    "/v1/refunds": ("refund", "re_"),
    "/v1/customers": ("customer", "cus_"),
    "/v1/charges": ("charge", "ch_"),
    "/v1/invoices": ("invoice", "in_"),
}
#: The searchable resources (https://docs.stripe.com/search): search path -> object kind.
SEARCHABLE = {
    "/v1/payment_intents/search": "payment_intent",
    "/v1/customers/search": "customer",
    "/v1/charges/search": "charge",
    "/v1/invoices/search": "invoice",
}
#: How every search answers: as Stripe does, or one of the answers that prove nothing.
ANSWER = {"mode": "stripe"}
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
    """A secret key as a bearer token, or as the HTTP Basic user name with no password
    (https://docs.stripe.com/api/authentication: both are accepted)."""
    given = request.headers.get("Authorization", "")
    if given.startswith("Basic "):
        try:
            given = "Bearer " + base64.b64decode(given[6:], validate=True).decode()
        except ValueError:
            return False
    return given.startswith("Bearer sk_")


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
    kind, prefix = KINDS.get(request.path, ("object", "obj_"))
    metadata = fields.get("metadata") or {}
    op = metadata.get("effectguard_op") if isinstance(metadata, dict) else None
    obj = {"id": prefix + uuid.uuid4().hex[:24], "object": kind, **_shape(kind, fields)}
    obj["metadata"] = metadata
    at = await TOOL.effect(request.path, op, body, obj["id"])
    if kind in SEARCHABLE.values() and op is not None:
        TOOL.index.add(f"{kind}/{account(request)}/{op}", obj, at)
    if request.headers.get("x-fake-status") == "500":
        return 500, {"error": {"type": "api_error", "message": "An unknown error occurred."}}
    return 200, obj


def _shape(kind: str, fields: dict[str, Any]) -> dict[str, Any]:
    """A few of the fields Stripe's object of ``kind`` has (its reference's example)."""
    if kind == "customer":
        return {"email": fields.get("email"), "name": fields.get("name")}
    if kind == "invoice":
        return {"customer": fields.get("customer"), "status": "draft"}
    status = "requires_payment_method" if kind == "payment_intent" else "succeeded"
    amount = int(fields.get("amount") or 0)
    return {"amount": amount, "currency": fields.get("currency", "usd"), "status": status}


async def search(request: web.Request) -> web.Response:
    """``GET /v1/{resource}/search?query=metadata['effectguard_op']:'OP'``: the objects of
    that resource, in the request's account, that carry OP."""
    if not authorized(request):
        return error(401, "invalid_request_error", "Invalid API Key provided.")
    match = QUERY.match(request.query.get("query", ""))
    if match is None:
        return error(400, "invalid_request_error", "This fake understands one query shape.")
    kind = SEARCHABLE[request.path]
    found = TOOL.index.find(f"{kind}/{account(request)}/{match[1]}")
    mode = ANSWER["mode"]
    if mode == "503":
        return error(503, "api_error", "The service is temporarily unavailable.")
    if mode == "html":
        return web.Response(text="<html><body>OK</body></html>", content_type="text/html")
    if mode == "no-data":
        return web.json_response({"object": "search_result", "url": request.path})
    if mode == "other-op":
        found = [{"id": "obj_other", "object": kind, "metadata": {"effectguard_op": "other"}}]
    return web.json_response(
        {"object": "search_result", "url": request.path, "has_more": False, "data": found}
    )


async def search_answer(request: web.Request) -> web.Response:
    """Set how every later search answers (a test's knob, not Stripe's)."""
    ANSWER["mode"] = str((await request.post())["answer"])
    return web.json_response(ANSWER)


def main() -> None:
    app = web.Application()
    for path in SEARCHABLE:
        app.router.add_get(path, search)
    app.router.add_post("/_fake/search-answer", search_answer)
    app.router.add_post("/v1/payment_intents", create)
    app.router.add_post("/v1/refunds", create)
    app.router.add_post("/v1/{tail:.+}", create)
    serve(app)


if __name__ == "__main__":
    main()
