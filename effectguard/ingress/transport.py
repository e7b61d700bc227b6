"""The in-process way in: httpx transports that wrap another transport (docs/contract.md §1).

::

    client = openai.AsyncOpenAI(http_client=httpx.AsyncClient(
        transport=effectguard.AsyncGuardTransport(budget="team-a")))

A request is matched to the provider whose base URL it targets; anything else
passes through untouched (or is refused with ``refuse_unmatched=True``).
:class:`GuardTransport` is the synchronous twin: it runs the same async guard on
a private event loop thread, so it works from plain code and from many threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import httpx

from effectguard.callpath.crash import NO_CRASH, CrashPoints
from effectguard.callpath.dispatches import MARKING_WAIT_S
from effectguard.callpath.guard import Guard
from effectguard.callpath.hooks import ReconcileHook
from effectguard.callpath.httpxshape import httpx_send
from effectguard.callpath.runtime import Runtime, RuntimeConfig
from effectguard.callpath.wire import BUDGET_HEADER, error_response
from effectguard.config import defaults
from effectguard.config.settings import GuardSettings, keys_from_environment
from effectguard.errors import ConfigError, Refusal
from effectguard.ingress.callerstream import CallerStream
from effectguard.ingress.clienttimeout import caller_read, caller_wait, upstream_timeout
from effectguard.ingress.observers import tracing
from effectguard.ingress.originpools import Origin, async_pools, origin_of, sync_pools
from effectguard.ingress.portal import Portal
from effectguard.ingress.syncinner import SyncInner
from effectguard.ledger import Ledger
from effectguard.providers import Provider, load_providers, provider_for, upstream_argument
from effectguard.providers.baseurl import checked_base_url
from effectguard.telemetry.observer import Observer, combine

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

T = TypeVar("T")

ProvidersArg = Mapping[str, Provider] | Sequence[str | Path] | None

CLOSING = (
    "this AsyncGuardTransport is closing: calls made while aclose() runs are refused, "
    "nothing was sent; use it again once aclose() has returned"
)
FORKED = (
    "this AsyncGuardTransport was first used before this process forked: its threads, "
    "ledger connections and worker registration are the parent's; nothing was sent. "
    "Make a new one in this process (a SQLite ledger the parent still has open cannot be "
    "opened here: docs/contract.md §3.8)"
)
#: Why a call still under way when a close stops waiting (a stream still read, an answer
#: still awaited) is interrupted: a closed ledger could not record its end, and left in
#: flight its key would answer 409 in_progress.
CLOSED_MID_CALL = (
    f"the transport closed before the call ended; it waited {defaults.DRAIN_TIMEOUT_S:g} s"
)
#: Runtimes a forked child inherited and closed: kept, never collected here, since
#: collecting them would close the parent's ledger connections from this process.
_INHERITED: list[Runtime] = []


def _providers(providers: ProvidersArg, upstreams: Mapping[str, str] | None) -> dict[str, Provider]:
    if providers is None or isinstance(providers, Sequence):
        dirs = [Path(p) for p in providers or ()]
        return load_providers(dirs, upstreams)
    out = dict(providers)
    for name, url in (upstreams or {}).items():
        if name not in out:
            known = ", ".join(sorted(out))
            raise ConfigError(f"{upstream_argument(name)}: unknown provider (known: {known})")
        checked = checked_base_url(url, upstream_argument(name))
        out[name] = dataclasses.replace(out[name], base_url=checked)
    return out


class AsyncGuardTransport(httpx.AsyncBaseTransport):
    """An async httpx transport that puts every billable provider call on the ledger."""

    def __init__(
        self,
        inner: httpx.AsyncBaseTransport | None = None,
        *,
        ledger: str | Ledger = defaults.LEDGER,
        budget: str | None = None,
        providers: ProvidersArg = None,
        upstreams: Mapping[str, str] | None = None,
        refuse_unmatched: bool = False,
        settings: GuardSettings | None = None,
        observer: Observer | None = None,
        crash: CrashPoints = NO_CRASH,
        otel: bool | TracerProvider = False,
        reconcile_hook: ReconcileHook | None = None,
    ) -> None:
        """``otel``: one OpenTelemetry span per call (True: the global tracer provider;
        or a ``TracerProvider``), with the ``effectguard[otel]`` extra installed.
        ``reconcile_hook``: the application's answer to "did this unknown call happen?"
        (see :mod:`effectguard.callpath.hooks`)."""
        declared = _providers(providers, upstreams)
        # By default a pool per provider's origin: one hung provider cannot hold every
        # connection.
        self.inner = inner or async_pools(_origins(declared))
        self.budget = budget
        self.refuse_unmatched = refuse_unmatched
        config = RuntimeConfig(
            ledger_url=ledger if isinstance(ledger, str) else ledger.store.url,
            providers=declared,
            guard=settings or GuardSettings(),
            crash=crash,
            observer=combine(observer, tracing(otel)),
            # Read once, here at the edge: the sweeper's lookups carry no client credential.
            credentials=keys_from_environment(declared, os.environ),
            reconcile_hook=reconcile_hook,
            send=httpx_send(self.inner.handle_async_request),
        )
        self._runtime = Runtime(config, None if isinstance(ledger, str) else ledger)
        self._guard: Guard | None = None
        #: The start every first caller waits for (see :meth:`guard`).
        self._starting: asyncio.Task[Guard] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        #: The process it started in: a forked child has none of its threads or locks.
        self._pid: int | None = None
        #: Done when the close under way ends (None: no close under way).
        self._closing: asyncio.Future[None] | None = None
        #: One future per call inside :meth:`handle_async_request`, done when it returns.
        self._calls: set[asyncio.Future[None]] = set()
        #: Stops the runtime if the transport is collected unclosed (set at first use).
        self._dropped: weakref.finalize[..., AsyncGuardTransport] | None = None

    async def guard(self) -> Guard:
        """The guard, started on first use (in the caller's event loop)."""
        if self._loop is not None and self._loop.is_closed() and self._pid == os.getpid():
            # Its loop ended with it open (a second ``asyncio.run``), cancelling its calls
            # (each recorded how far it got) and heartbeat: closed, it starts again here.
            await self.aclose()
        self._bind()
        if self._guard is not None:
            return self._guard
        if self._starting is None or self._starting.done():  # done here: it failed, again
            self._starting = asyncio.ensure_future(self._runtime.start())
            self._starting.add_done_callback(self._started)
        # Shielded: a caller that goes away (a timeout, a cancelled task) stops only its
        # own wait. Cancelling the start itself would make every caller waiting with it
        # start again, registering a worker each time, and callers with short timeouts
        # could keep the transport from ever starting.
        guard = await asyncio.shield(self._starting)
        if self._closing is not None:  # closed while it started: the close stops it
            raise RuntimeError(CLOSING)
        return guard

    def _bind(self) -> None:
        """Tie the transport to the caller's loop and process, or refuse the call."""
        if self._pid is not None and self._pid != os.getpid():
            # Its threads did not come along, and its ledger connections, worker id and
            # lock are the parent's: a call would be sent and recorded as the parent's.
            raise RuntimeError(FORKED)
        if self._closing is not None:
            # Taken now, it would start the guard again under the close (keeping the
            # worker registration the close just released), or meet a closed ledger.
            raise RuntimeError(CLOSING)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            # Under trio (or anyio on trio) asyncio says only "no running event loop".
            raise RuntimeError(
                "an AsyncGuardTransport needs a running asyncio event loop (asyncio.run, "
                "uvloop) and none runs here (trio?): use GuardTransport, which runs its own "
                "loop thread, from a worker thread (trio.to_thread.run_sync)"
            ) from None
        if self._loop is None:
            self._loop, self._pid = loop, os.getpid()
            # Dropped unclosed (a client made per request in a server, never closed), it
            # would keep its heartbeat, ledger threads and connections for as long as the
            # loop runs: it stops them once collected, as plain httpx frees a dropped
            # client's sockets. Not at exit: a program ending unclosed exits at once.
            self._dropped = weakref.finalize(
                self, _stop_dropped, loop, self._pid, self._runtime, self.inner
            )
            self._dropped.atexit = False
        elif loop is not self._loop:
            # Its heartbeat, its background settlements and its connections live on the
            # loop it started on: on another one a call could be sent and never settled.
            raise RuntimeError(
                "an AsyncGuardTransport runs on the event loop it was first used on while "
                "that loop runs, until it is closed: close it (aclose) before using it from "
                "another running event loop (another thread's), make one per loop, or use "
                "GuardTransport (one that an ended asyncio.run left open starts again here)"
            )

    def _started(self, starting: asyncio.Task[Guard]) -> None:
        if not starting.cancelled() and starting.exception() is None:
            self._guard = starting.result()

    @property
    def ledger(self) -> Ledger:
        """The ledger this transport writes."""
        return self._runtime.ledger

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        guard = await self.guard()
        # Counted from here (no await since the check in guard()): a close waits for it.
        done = asyncio.get_running_loop().create_future()
        self._calls.add(done)
        try:
            return await self._handle(guard, request)
        finally:
            self._calls.discard(done)
            done.set_result(None)

    async def _handle(self, guard: Guard, request: httpx.Request) -> httpx.Response:
        target = _routing_url(request.url)
        provider = provider_for(guard.providers.values(), request.method, target)
        if provider is None:
            if self.refuse_unmatched:
                refusal = Refusal(
                    404, "unknown_provider", f"no provider declared for {request.url}"
                )
                return error_response("openai", refusal, request)
            return await self.inner.handle_async_request(request)
        await request.aread()
        requested = request.headers.get(BUDGET_HEADER)  # empty: refused as a bad path
        budget = (self.budget or "default") if requested is None else requested
        given = request.extensions.get("timeout")
        wait = caller_wait(given)
        read_s = guard.settings.upstream_read_timeout_s
        request.extensions = {**request.extensions, "timeout": upstream_timeout(given, read_s)}
        try:
            async with asyncio.timeout(wait):
                response = await guard.handle(
                    provider, request, self.inner.handle_async_request, budget=budget
                )
        except Refusal as refusal:
            return error_response(provider.error_shape, refusal, request)
        except TimeoutError:
            # Only the caller's wait ended: the call goes on and is settled (contract.md §3.8).
            raise httpx.ReadTimeout(
                f"no answer began within this request's timeout ({wait:g} s); the call "
                "goes on and is settled: resend with the same Idempotency-Key for its answer",
                request=request,
            ) from None
        if not isinstance(response.stream, httpx.ByteStream):  # else the body is held whole
            # A caller that stops waiting, closes or drops the stream must not end its
            # upstream read (callerstream). Past read_s the upstream leg's own timeout
            # ends the stream first: no need to pace the caller beyond it.
            paced = caller_read(given)
            stream = response.stream
            assert isinstance(stream, httpx.AsyncByteStream)
            read_limit = paced if paced is not None and paced < read_s else None
            response.stream = CallerStream(
                stream, read_limit, request, guard.recorder.keep, owner=self
            )
        return response

    async def aclose(self) -> None:
        """Refuse new calls, let the calls under way finish (up to 30 s in all, with the
        background settlements), then stop the guard and close ``inner``.

        Like httpx's own transports it may be used again once this has returned (an
        ``async with httpx.AsyncClient(transport=t)`` per request closes it each time):
        the guard then starts again, on whichever event loop uses it next.
        """
        if self._pid is not None and self._pid != os.getpid():
            # A child forked after the first use: the runtime is the parent's. Stopping it
            # would wait on threads that did not come along and write through the parent's
            # connections; it is left alone, and the transport stays refused here.
            if self._runtime not in _INHERITED:
                _INHERITED.append(self._runtime)
            return
        if self._closing is not None:  # a second close: the first one does the work
            await asyncio.shield(self._closing)
            return
        self._closing = asyncio.get_running_loop().create_future()
        if self._dropped is not None:
            self._dropped.detach()
        try:
            await self._stop()
        finally:
            closing, self._closing = self._closing, None
            self._loop = self._pid = None
            closing.set_result(None)

    async def _stop(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + defaults.DRAIN_TIMEOUT_S
        if self._starting is not None:
            if not self._starting.done():
                await asyncio.wait({self._starting})  # then stopped below, if it started
            self._starting = None
        if self._calls:
            # Calls taken before the close began finish first, so their answers are
            # recorded: the runtime's drain knows only calls already dispatched.
            await asyncio.wait(set(self._calls), timeout=deadline - loop.time())
        ended = self._loop is not None and self._loop.is_closed()
        if self._guard is not None:
            left = max(0.0, deadline - loop.time())
            await self._runtime.stop(left, CLOSED_MID_CALL, self._settle_calls)
            self._guard = None
        if self._calls:
            # Their callers, cut off by the stop, are answered before the close returns
            # (the sync transport's close then ends its loop: it would cancel them).
            await asyncio.wait(set(self._calls), timeout=MARKING_WAIT_S)
        try:
            await self.inner.aclose()
        except RuntimeError:
            if not ended:
                raise
            # Its kept-alive connections belong to the ended loop, which closing one needs
            # ("Event loop is closed"): dropped with the pools, closed when collected.

    async def _settle_calls(self) -> None:
        """Once the guard sends nothing more, wait (bounded) for the calls not yet
        dispatched when the close stopped waiting (an admission still committing, a
        resend still deciding, a retry joining another's call) to end while the ledger is
        open: one admitted now is recorded not sent, and its caller told so."""
        if self._calls:
            await asyncio.wait(set(self._calls), timeout=MARKING_WAIT_S)


#: The stops of collected transports, held until done: a task only its loop refers to
#: may be collected before it ends.
_STOPPING: set[asyncio.Task[None]] = set()


def _stop_dropped(
    loop: asyncio.AbstractEventLoop, pid: int, runtime: Runtime, inner: httpx.AsyncBaseTransport
) -> None:
    """Stop a collected AsyncGuardTransport's runtime and inner transport on its loop.

    The collector may run this on any thread: the work is handed to the loop. A loop that
    has ended (``asyncio.run`` returned) has nothing left to run it on, and its pools'
    threads end with them; in a child forked after the first use the runtime is the
    parent's and is left alone, as ``aclose()`` there leaves it."""
    if pid != os.getpid() or loop.is_closed():
        return

    async def stop() -> None:
        if runtime.guard is not None:
            await runtime.stop(defaults.DRAIN_TIMEOUT_S, CLOSED_MID_CALL)
        await inner.aclose()

    def start() -> None:
        task = loop.create_task(stop())
        _STOPPING.add(task)
        task.add_done_callback(_STOPPING.discard)

    with contextlib.suppress(RuntimeError):  # the loop closed since the check
        loop.call_soon_threadsafe(start)


class _PortalStream(httpx.SyncByteStream):
    """The guard's async response stream, read from sync code through the portal."""

    def __init__(self, owner: GuardTransport, response: httpx.Response) -> None:
        # Held, not only its portal: a stream read after its client was dropped (a raw
        # ``client.send(..., stream=True)``) keeps the transport from being collected,
        # which would close it under the reader (see ``_close_dropped``).
        self._owner = owner
        self._portal = owner._portal
        self._response = response

    def __iter__(self) -> Iterator[bytes]:
        chunks = self._response.aiter_raw()
        while True:
            try:
                yield self._portal.run(chunks.__anext__())
            except StopAsyncIteration:
                return

    def close(self) -> None:
        if self._portal.closed:
            # Its transport was closed first (leaving ``with OpenAI(...)`` before the
            # stream's generator is collected), and that close settled every stream it
            # had: there is nothing left to close, and no loop to close it on.
            return
        try:
            self._portal.run_or_schedule(self._response.aclose())
        except RuntimeError:
            if not self._portal.closed:
                raise
            # Its transport began closing meanwhile: that close reads it to its end.


def _origins(declared: Mapping[str, Provider]) -> list[Origin]:
    """The origins of the declared providers: each gets a connection pool of its own."""
    return [origin_of(httpx.URL(p.base_url)) for p in declared.values()]


class GuardTransport(httpx.BaseTransport):
    """The synchronous transport: same guard, same ledger, usable from many threads."""

    def __init__(
        self,
        inner: httpx.BaseTransport | None = None,
        *,
        ledger: str | Ledger = defaults.LEDGER,
        budget: str | None = None,
        providers: ProvidersArg = None,
        upstreams: Mapping[str, str] | None = None,
        refuse_unmatched: bool = False,
        settings: GuardSettings | None = None,
        observer: Observer | None = None,
        crash: CrashPoints = NO_CRASH,
        otel: bool | TracerProvider = False,
        reconcile_hook: ReconcileHook | None = None,
    ) -> None:
        self._portal = Portal()
        declared = _providers(providers, upstreams)  # once: the async one takes them as is
        self._async = AsyncGuardTransport(
            sync_pools(_origins(declared)) if inner is None else SyncInner(inner),
            ledger=ledger,
            budget=budget,
            providers=declared,
            refuse_unmatched=refuse_unmatched,
            settings=settings,
            observer=observer,
            crash=crash,
            otel=otel,
            reconcile_hook=reconcile_hook,  # async: it runs on the portal's loop
        )
        # A transport dropped unclosed (a client made per request, never closed) would
        # keep its loop thread, the ledger's threads and connections and a live worker
        # heartbeat until the process ends: plain httpx frees a dropped client's sockets
        # when it is collected, so this one closes itself then. Not at exit: a program
        # that ends unclosed exits at once (docs/contract.md §3.8), so atexit is off.
        self._dropped = weakref.finalize(self, _close_dropped, self._portal, self._async)
        self._dropped.atexit = False

    @property
    def ledger(self) -> Ledger:
        """The ledger this transport writes."""
        return self._async.ledger

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.read()
        async_request = httpx.Request(
            request.method,
            request.url,
            headers=request.headers,
            content=request.content,
            extensions=request.extensions,
        )
        response: httpx.Response = self._portal.run(self._async.handle_async_request(async_request))
        stream = response.stream
        if not isinstance(stream, httpx.ByteStream):  # else the guard holds the whole body
            stream = _PortalStream(self, response)
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=stream,
            extensions=response.extensions,
            request=request,
        )

    def close(self) -> None:
        """Refuse new calls at once, let those under way finish (up to 30 s), then stop.

        Only the first close does this (a transport shared by several clients closes
        with the first of them); a close made meanwhile, from another thread, waits for
        it and returns, and a later one returns at once."""
        self._dropped.detach()
        self._portal.close(self._async.aclose())


def _routing_url(url: httpx.URL) -> str:
    """``url`` as it is matched against the declared base URLs: without its query, and
    without what names the same host another way. Credentials in the URL
    (``https://sk_test_...:@api.stripe.com``: httpx sends them as Basic auth, the way
    Stripe takes its key) and the root's trailing dot (``api.stripe.com.``, the same
    host to DNS) made a request for a declared provider match none, and pass on
    unguarded: no manifest, no reservation, no deduplication. (httpx has already
    lowered the host's case and dropped a default port.)"""
    host = url.host
    if host.endswith(".") and host.strip("."):
        host = host.rstrip(".")
    return str(url.copy_with(userinfo=b"", host=host, query=None, fragment=None))


def _close_dropped(portal: Portal, transport: AsyncGuardTransport) -> None:
    """Close a collected GuardTransport's portal and guard, on a thread of its own.

    The collector runs this on whichever thread it is collecting on: the portal's own
    (where waiting on the portal's loop would wait on itself), or a caller's thread,
    which must not wait up to 30 s for the close to drain calls it knows nothing of."""
    threading.Thread(
        target=lambda: portal.close(transport.aclose()), name="effectguard-close", daemon=True
    ).start()
