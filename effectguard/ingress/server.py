"""The proxy way in: an ASGI app routing ``/{provider}/{path}`` through the guard.

``create_app(settings)`` builds the app; its lifespan opens the ledger, becomes
a worker and sets the configured budget limits; on shutdown it lets background
settlements finish. The app is a plain ASGI callable (no framework): the hot
path is one dict lookup, one body read and the guard.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

import httpx

from effectguard.callpath.crash import CrashPoints
from effectguard.callpath.crash import from_environment as crash_from_environment
from effectguard.callpath.exchange import Reply, header_value
from effectguard.callpath.exchange import Send as UpstreamSend
from effectguard.callpath.guard import Guard
from effectguard.callpath.hooks import load_hook
from effectguard.callpath.httpxshape import httpx_send
from effectguard.callpath.runtime import Runtime, RuntimeConfig
from effectguard.callpath.stream import GuardedStream
from effectguard.callpath.ticket import Ticket
from effectguard.callpath.wire import BUDGET_HEADER, error_headers
from effectguard.config.settings import ServeSettings
from effectguard.errors import EffectguardError, LedgerError, Refusal
from effectguard.ingress import spool
from effectguard.ingress.admin import operator_page
from effectguard.ingress.aioleg import AiohttpLeg
from effectguard.ingress.fallback import InternalErrorBoundary, context_of
from effectguard.ingress.frontdoor import client_gone, cut_off, on_client_lost
from effectguard.ingress.keyring import Grant, KeyRing, bearer_token, refuse_browsers
from effectguard.ingress.limitseed import seed_limits
from effectguard.ingress.listeners import MetricsListener, listen_socket
from effectguard.ingress.observers import proxy_observer
from effectguard.ingress.openness import warn_at_start
from effectguard.ingress.outbound import OutboundRequests
from effectguard.ingress.redirects import guarded_redirect
from effectguard.ingress.replywriter import write_reply
from effectguard.ingress.requestchecks import ambiguous_framing, route_of
from effectguard.ledger.base import probe
from effectguard.providers import Provider
from effectguard.rules import budget as budgets
from effectguard.rules.errorshape import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

log = logging.getLogger("effectguard.ingress.server")


class ProxyApp:
    """The ASGI application."""

    def __init__(
        self,
        settings: ServeSettings,
        *,
        inner: httpx.AsyncBaseTransport | None = None,
        crash: CrashPoints | None = None,
        metrics: Any = None,
        metrics_socket: socket.socket | None = None,
        routes: Mapping[int, str] | None = None,
    ) -> None:
        self.settings = settings
        self._routes = dict(routes or {})  # local port -> provider (provider_ports)
        self._metrics_socket = metrics_socket  # bound by serve(); else bound at startup
        self._inner = inner
        self.metrics = metrics
        self.startup_error: Exception | None = None  # what stopped the start (its exit code)
        spec = settings.guard.reconcile_hook
        hook = load_hook(spec) if spec is not None else None
        #: The upstream leg: aiohttp (its session opens on first use), or a test's httpx
        #: transport. Built first: the startup sweep's lookups use it.
        self._leg: AiohttpLeg | None = None
        self._send: UpstreamSend
        if inner is not None:
            self._send = httpx_send(inner.handle_async_request)
        else:
            self._leg = AiohttpLeg.configured(settings)
            self._send = self._leg.send
        self.runtime = Runtime(
            RuntimeConfig(
                ledger_url=settings.ledger,
                providers=settings.providers,
                guard=settings.guard,
                crash=crash if crash is not None else crash_from_environment(),
                observer=proxy_observer(metrics, settings.otel),
                lease_s=settings.lease_s,
                heartbeat_s=settings.heartbeat_s,
                sweep_s=settings.sweep_s,
                credentials=settings.provider_keys,
                reconcile_hook=hook,
                send=self._send,
            )
        )
        self.guard: Guard | None = None
        #: Why a request still running when the server stops is cut off (its 504 and the
        #: call's interrupt reason say it): the drain's end, unless serve() is told that
        #: a second signal stopped it at once (:meth:`stopping_at_once`).
        self.cut_off_reason = "the proxy's drain timeout ended"
        self.keyring = KeyRing(settings.keys, settings.key_refresh_s)
        self.outbound = OutboundRequests(settings, self.keyring)
        self._metrics_server: Any = None
        self._handle_http = InternalErrorBoundary(self._http, self._count_internal_error)
        # The operator page (ingress/admin); not mounted at all without an admin key.
        self.admin = operator_page(
            settings.admin, self.runtime.ledger, settings.ledger, settings.providers
        )

    # -- lifespan -------------------------------------------------------------
    async def startup(self) -> None:
        """Open the ledger, register as a worker, apply configured budget limits."""
        self.guard = await self.runtime.start()
        if self.settings.budget_limits:
            await seed_limits(self.runtime.ledger, self.settings.budget_limits, self.guard.writer)
        await self.keyring.start(self.runtime.ledger)
        warn_at_start(self.settings, self.keyring)
        if swept := spool.sweep(self.settings.spool_dir):
            log.warning("removed %d upload spool files left by processes that died", swept)
        if self.metrics is not None:
            # Before the first request: a declared model's first call shows in the rates.
            self.metrics.declare((p.name, p.models) for p in self.settings.providers.values())
            self.metrics.attach(self.runtime.ledger, self.settings.ledger)
            if (port := self.settings.metrics_port) is not None:
                # /metrics on its own listener (e.g. an internal interface), in a thread.
                sock = self._metrics_socket or listen_socket(self.settings.metrics_host, port)
                self._metrics_server = MetricsListener(sock, self.metrics.registry)
                self._metrics_server.start()

    async def shutdown(self) -> None:
        """Let background settlements finish (streams still read then are cut off), then close."""
        if self._metrics_server is not None:
            self._metrics_server.stop()
        await self.keyring.stop()
        await self.runtime.stop(self.settings.drain_timeout_s, self.cut_off_reason)
        if self._inner is not None:
            await self._inner.aclose()
        if self._leg is not None:
            await self._leg.aclose()

    def stopping_at_once(self) -> None:
        """A second signal stops the server at once: nothing it cuts off blames the drain."""
        self.cut_off_reason = "a second signal stopped the proxy without draining"
        if self.guard is not None:
            self.guard.stop_at_once(self.cut_off_reason)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._handle_http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            try:
                message = await receive()
            except asyncio.CancelledError:
                # A second signal stops without draining: uvicorn skips the lifespan shutdown
                # and the loop's teardown cancels this wait. A documented stop, no traceback.
                log.info("stopped without draining (a second signal)")
                return
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:
                    self.startup_error = exc
                    if isinstance(exc, (EffectguardError, OSError)):
                        # A known cause (the ledger unreachable, a lock file): one line.
                        log.error("startup failed: %s", exc)
                    else:
                        log.exception("startup failed")
                    with contextlib.suppress(Exception):  # close what did open
                        await self.shutdown()
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- requests ---------------------------------------------------------------
    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        # A provider's own listener (provider_ports) sends every path to that provider.
        fixed = self._routes.get((scope.get("server") or ("", 0))[1]) if self._routes else None
        if fixed is None and self._owns(scope):
            await self._own(scope, receive, send)
            return
        if ambiguous_framing(scope["headers"]):
            # RFC 9112 §6.3: a request with both Content-Length and Transfer-Encoding is a
            # smuggling attempt; answer it and close, so no second request hides behind it.
            refusal = Refusal(400, "invalid_request", "Content-Length with Transfer-Encoding")
            headers = [(k.encode(), v.encode()) for k, v in error_headers(refusal).items()]
            headers.append((b"connection", b"close"))
            await _raw(send, 400, headers, json.dumps(error_body("openai", refusal)).encode())
            return
        try:
            name, upstream_path = route_of(scope, fixed)
            provider = self.settings.providers.get(name)
            if provider is None:
                raise Refusal(404, "unknown_provider", f"no provider named {name!r}")
        except Refusal as unrouted:
            # On a provider's own listener the provider is known, and so is its shape.
            known = self.settings.providers.get(fixed) if fixed is not None else None
            self._count_refusal(known.name if known else "", unrouted)
            await _refusal(send, known.error_shape if known else "openai", unrouted)
            return
        context_of(scope).error_shape = provider.error_shape
        try:
            mount = "" if fixed is not None else f"/{name}"  # the proxy's path for it
            await self._proxy(scope, receive, send, provider, upstream_path, mount)
        except Refusal as refusal:
            if refusal.status in (401, 403, 413):  # the guard counts its own refusals
                self._count_refusal(provider.name, refusal)
            ticket = context_of(scope).ticket
            self._orphaned(scope, ticket)  # a client gone before its refusal: 499, as any answer
            try:
                await _refusal(send, provider.error_shape, refusal)
            finally:
                self._report(ticket)
        except asyncio.CancelledError:
            # uvicorn cancels requests still running when the drain timeout ends (SIGTERM).
            context = context_of(scope)
            if context.response_started:  # a stream under way: cut (never a clean end);
                if cut_off(scope):  # its call settles in the background as it can
                    return
                raise
            await self._cut_off(send, provider, context.ticket)

    def _owns(self, scope: Scope) -> bool:
        """Whether ``scope`` is for one of the proxy's own routes (/healthz, /metrics, the
        operator page), checked without an await: every proxied request asks. An operator
        page request with ambiguous framing is not: it is refused as any request is."""
        path: str = scope["path"]
        if path == "/healthz":
            return True
        if path == "/metrics":
            return self.metrics is not None and self.settings.metrics_port is None
        admin = self.admin
        return admin is not None and admin.owns(path) and not ambiguous_framing(scope["headers"])

    async def _own(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer one of the proxy's own routes (:meth:`_owns`)."""
        path: str = scope["path"]
        if path == "/healthz":
            ok = await self.runtime.ledger.store.writable() and await self._not_fenced()
            await _json(send, 200 if ok else 503, {"ledger": "writable" if ok else "unavailable"})
        elif path == "/metrics":
            await self._metrics(scope, send)
        elif self.admin is not None:
            await self.admin(scope, receive, send)

    async def _cut_off(self, send: Send, provider: Provider, ticket: Ticket) -> None:
        """Answer a request cut off by the end of the drain: 504 ``effect_unknown`` if admitted
        (between two attempts: the provider's last answer, contract.md §3.5). The response is
        complete when this returns, so the cancellation ends here: the client has its answer."""
        assert self.guard is not None
        if ticket.call_id is None:
            why = "the proxy shut down before this request was sent"
            answer: Refusal | Reply = Refusal(503, "shutting_down", why, retryable=True)
        else:
            answer = await self.guard.cut_off(ticket, self.cut_off_reason)
        try:
            if isinstance(answer, Reply):  # cut off between attempts: the provider's answer
                await write_reply(send, answer, lambda: False, lambda: False)
            else:
                await _refusal(send, provider.error_shape, answer)
        finally:
            if ticket.report is not None:  # what the client got, not "it left"
                if isinstance(answer, Reply):
                    ticket.report.status = answer.status
                else:
                    ticket.report.refused(answer)
            self._report(ticket)

    async def _metrics(self, scope: Scope, send: Send) -> None:
        """``/metrics``; once proxy keys exist, only for a key allowed to read it; before,
        not for a web browser."""
        assert self.metrics is not None
        try:
            if self.keyring.required:
                headers = httpx.Headers(scope["headers"])
                presented = headers.get("effectguard-key") or headers.get("authorization", "")
                key = self.keyring.authenticate(bearer_token(presented))
                if not key.metrics:
                    raise Refusal(403, "metrics_forbidden", "this key may not read /metrics")
            else:
                refuse_browsers(scope["headers"])
        except Refusal as refusal:
            await _refusal(send, "openai", refusal)
            return
        await self.metrics.refresh()
        body, content_type = self.metrics.render()
        await _raw(send, 200, [(b"content-type", content_type.encode())], body)

    def _count_internal_error(self) -> None:
        if self.metrics is not None:
            self.metrics.observer.internal_error()

    def _count_refusal(self, provider: str, refusal: Refusal) -> None:
        if self.metrics is not None:
            self.metrics.observer.refused(provider, refusal.type)

    async def _not_fenced(self) -> bool:
        """Whether the store still accepts this worker's writes (a fenced worker never will)."""
        if self.guard is None:
            return False
        try:
            await self.runtime.ledger.store.write(self.guard.writer, probe)
        except LedgerError:
            return False
        return True

    def _authorize(
        self, provider: Provider, headers: list[tuple[bytes, bytes]]
    ) -> tuple[str, str | None, Grant | None]:
        """The budget and budget root this request may spend, and its key (docs/contract.md §1)."""
        # An empty header (a client's unset "$BUDGET") is a bad path, refused like any
        # other: taken as absent it would quietly spend the default budget.
        requested = header_value(headers, BUDGET_HEADER)
        if not self.keyring.required:
            refuse_browsers(headers)
            return budgets.DEFAULT_BUDGET if requested is None else requested, None, None
        presented = header_value(headers, "effectguard-key")
        if presented is None:
            # The provider's credential header, else ``Authorization``: the anthropic SDK
            # sends its ``api_key`` as ``x-api-key`` or as a bearer token, by version.
            credential = (
                header_value(headers, provider.key_header)
                or header_value(headers, "authorization")
                or ""
            )
            presented = bearer_token(credential) if credential else None
        key = self.keyring.authenticate(presented)
        budget = key.budget_root if requested is None else requested
        if not budgets.is_under(budget, key.budget_root):
            raise Refusal(
                403, "budget_forbidden", f"this key may only spend under {key.budget_root!r}"
            )
        return budget, key.budget_root, key

    async def _proxy(
        self, scope: Scope, receive: Receive, send: Send, provider: Provider, path: str, mount: str
    ) -> None:
        assert self.guard is not None
        raw_headers: list[tuple[bytes, bytes]] = scope["headers"]
        budget, root, key = self._authorize(provider, raw_headers)
        body = await self.outbound.body(receive, raw_headers)
        watch = on_client_lost(scope)
        try:
            if key is not None:
                key.check(provider.name, body, header_value(raw_headers, "content-type"))
            request = self.outbound.request(scope, provider, path, raw_headers, body)
            ticket = context_of(scope).ticket
            ticket.key = key.name if key is not None else None
            ticket.report_later = True  # its access line waits until the answer is written
            orphans = self.guard.orphans
            watch(lambda lost: (ticket.leave if lost else ticket.sending_closed)(orphans))
            reply = await self.guard.serve(
                provider, request, self._send, budget=budget, budget_root=root, ticket=ticket
            )
            if 300 <= reply.status < 400:  # an SDK that follows it must come back through us
                guarded_redirect(reply, request.url, provider.base_url, mount)

            def gone() -> bool:
                if self._orphaned(scope, ticket):
                    return True
                if reply.body is not None:
                    watch(None)  # its answer goes out now: a close after it is no leaving
                return False

            try:
                await write_reply(send, reply, gone, lambda: cut_off(scope))
            finally:
                if not isinstance(reply.stream, GuardedStream):  # that reports at its end
                    self._report(ticket)
        finally:
            watch(None)  # answered (or refused): a later close is no leaving
            body.discard()

    def _report(self, ticket: Ticket) -> None:
        """Hand on a report once its answer is written (499 already, if its client left)."""
        if ticket.report is not None and self.guard is not None:
            self.guard.recorder.report(ticket.report)

    def _orphaned(self, scope: Scope, ticket: Ticket) -> bool:
        """Before the end of an answer or a stream's next chunk: whether its client has
        gone. If so its access line says 499 (a stream's report is made at its end, by
        whoever reads the stream to it). Its retry was handed the call when the connection
        was lost (``ticket.leave``, watched in :meth:`_proxy`): the same signal.

        A client that closed its sending side first (a half-close, or a close: the wire
        does not say which) is still written its answer, and logged 499, as nginx logs a
        client that closed before its answer: a timed-out SDK's close is by far the more
        common, and a 200 would read as a delivery the proxy cannot know of."""
        if ticket.report is not None and ticket.may_have_left:
            ticket.report.status = 499
        if not client_gone(scope):
            return False
        if ticket.report is not None:
            ticket.report.status = 499
        return True


async def _raw(send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _json(send: Send, status: int, payload: Any) -> None:
    await _raw(send, status, [(b"content-type", b"application/json")], json.dumps(payload).encode())


async def _refusal(send: Send, shape: str, refusal: Refusal) -> None:
    headers = [(k.encode(), v.encode()) for k, v in error_headers(refusal, shape).items()]
    await _raw(send, refusal.status, headers, json.dumps(error_body(shape, refusal)).encode())


def create_app(settings: ServeSettings, **kwargs: Any) -> ProxyApp:
    """The ASGI app for ``settings`` (see :class:`ProxyApp` for keyword arguments)."""
    return ProxyApp(settings, **kwargs)
