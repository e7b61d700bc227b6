"""The last answer: an unexpected exception becomes a provider-shaped 500 (docs/contract.md §12).

:class:`InternalErrorBoundary` wraps the proxy's HTTP handler like an ASGI
middleware. When the handler raises anything but cancellation, the client gets
``500`` with type ``internal_error`` in the route's error shape, ``x-should-retry:
false`` (the request may have been admitted; the call id, when there is one,
says which call to look at), and the call id. The exception is logged once, in
one line; its traceback only at DEBUG, so a hostile input cannot flood the log.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from effectguard.callpath.ticket import Ticket
from effectguard.callpath.wire import error_headers
from effectguard.errors import Refusal
from effectguard.rules.errorshape import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

#: The scope key under which the handler finds this request's :class:`RequestContext`.
CONTEXT_KEY = "effectguard.request"

log = logging.getLogger("effectguard.ingress.fallback")


@dataclass
class RequestContext:
    """What the handler learns about a request that an error answer needs."""

    error_shape: str = "openai"
    ticket: Ticket = field(default_factory=Ticket)
    #: Whether ``http.response.start`` went out (after it, no other answer can be given).
    response_started: bool = False


def context_of(scope: Scope) -> RequestContext:
    """This request's context (one is made if the boundary did not run)."""
    context = scope.get(CONTEXT_KEY)
    if context is None:
        context = scope[CONTEXT_KEY] = RequestContext()
    assert isinstance(context, RequestContext)
    return context


class InternalErrorBoundary:
    """ASGI wrapper: unexpected exceptions become a 500 ``internal_error`` (logged, counted)."""

    def __init__(self, app: App, on_error: Callable[[], None]) -> None:
        self.app = app
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        context = scope[CONTEXT_KEY] = RequestContext()

        async def tracking_send(message: Message) -> None:
            await send(message)
            # Only once it went out: a head the server refused leaves room for the 500.
            if message["type"] == "http.response.start":
                context.response_started = True

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            call_id = context.ticket.call_id or getattr(exc, "call_id", None)
            where = f"{scope.get('method', '?')} {scope.get('path', '?')[:200]!r}"
            log.error(
                "internal error on %s%s: %s: %s",
                where,
                f" (call {call_id})" if call_id else "",
                type(exc).__name__,
                str(exc)[:300],
            )
            log.debug("internal error traceback", exc_info=exc)
            self.on_error()
            # Once a response started, the client's stream just ends: nothing else can be said.
            if not context.response_started:
                await send_internal_error(send, context.error_shape, call_id)


async def send_internal_error(send: Send, shape: str, call_id: str | None) -> None:
    """The 500 ``internal_error`` answer."""
    refusal = Refusal(
        500,
        "internal_error",
        "effectguard failed unexpectedly while handling this request"
        + (f"; see call {call_id} (effectguard show {call_id})" if call_id else ""),
        call_id=call_id,
    )
    body = json.dumps(error_body(shape, refusal)).encode()
    headers = [(k.encode(), v.encode()) for k, v in error_headers(refusal, shape).items()]
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": 500, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
