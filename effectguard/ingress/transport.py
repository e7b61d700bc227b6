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
import dataclasses
import os
import threading
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import httpx

from effectguard.callpath.crash import NO_CRASH, CrashPoints
from effectguard.callpath.guard import Guard
from effectguard.callpath.hooks import ReconcileHook
from effectguard.callpath.httpxshape import httpx_send
from effectguard.callpath.runtime import Runtime, RuntimeConfig
from effectguard.callpath.wire import BUDGET_HEADER, error_response
from effectguard.config import defaults
from effectguard.config.settings import GuardSettings, keys_from_environment
from effectguard.errors import ConfigError, Refusal
from effectguard.ingress.clienttimeout import (
    CallerPacedStream,
    caller_read,
    caller_wait,
    upstream_timeout,
)
from effectguard.ingress.observers import tracing
from effectguard.ledger import Ledger
from effectguard.providers import Provider, load_providers, provider_for, upstream_argument
from effectguard.telemetry.observer import Observer, combine

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

T = TypeVar("T")

ProvidersArg = Mapping[str, Provider] | Sequence[str | Path] | None


def _providers(providers: ProvidersArg, upstreams: Mapping[str, str] | None) -> dict[str, Provider]:
    if providers is None or isinstance(providers, Sequence):
        dirs = [Path(p) for p in providers or ()]
        return load_providers(dirs, upstreams)
    out = dict(providers)
    for name, url in (upstreams or {}).items():
        if name not in out:
            known = ", ".join(sorted(out))
            raise ConfigError(f"{upstream_argument(name)}: unknown provider (known: {known})")
        out[name] = dataclasses.replace(out[name], base_url=url.rstrip("/"))
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
        self.inner = inner or httpx.AsyncHTTPTransport()
        self.budget = budget
        self.refuse_unmatched = refuse_unmatched
        declared = _providers(providers, upstreams)
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
        self._opening: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def guard(self) -> Guard:
        """The guard, started on first use (in the caller's event loop)."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif loop is not self._loop:
            # Its heartbeat, its background settlements and its connections live on the
            # loop it started on: on another one a call could be sent and never settled.
            raise RuntimeError(
                "an AsyncGuardTransport runs on the event loop it was first used on until "
                "it is closed: close it (aclose) before using it from another event loop "
                "(each asyncio.run), make one per loop, or use GuardTransport"
            )
        if self._guard is None:
            if self._opening is None:
                self._opening = asyncio.Lock()
            async with self._opening:
                if self._guard is None:
                    self._guard = await self._runtime.start()
        return self._guard

    @property
    def ledger(self) -> Ledger:
        """The ledger this transport writes."""
        return self._runtime.ledger

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        guard = await self.guard()
        target = str(request.url.copy_with(query=None, fragment=None))
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
        paced = caller_read(given)
        if paced is not None and paced < read_s and not response.is_stream_consumed:
            # Past read_s the upstream leg's own timeout ends the stream first.
            stream = response.stream
            assert isinstance(stream, httpx.AsyncByteStream)
            response.stream = CallerPacedStream(stream, paced, request, guard.recorder.keep)
        return response

    async def aclose(self) -> None:
        # Like httpx's own transports it may be used again after this (an
        # ``async with httpx.AsyncClient(transport=t)`` per request closes it each time):
        # the guard then starts again, on whichever event loop uses it next.
        self._loop = None
        if self._guard is not None:
            await self._runtime.stop()
            self._guard = None
        await self.inner.aclose()


class _Portal:
    """A private event loop on a daemon thread, for running the async guard from sync code."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="effectguard-portal", daemon=True
        )
        self._thread.start()
        self._scheduled: set[asyncio.Task[Any]] = set()

    def run(self, coro: Any) -> Any:
        if self.closed:
            coro.close()
            # After close(), or in a child process forked after the first use (the
            # portal's thread did not come along): waiting would wait for ever.
            raise RuntimeError(
                "this GuardTransport is closed, or was opened before this process forked: "
                "make a new one"
            )
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result()

    def run_or_schedule(self, coro: Any) -> None:
        """Run ``coro`` and wait for it; on the portal's own thread, schedule it instead.

        The garbage collector may finalize an abandoned stream on any thread, the
        portal's too, and the stream's close then calls here: waiting on the portal's
        loop from inside it would wait on itself, and every request would hang."""
        if threading.current_thread() is not self._thread:
            self.run(coro)
            return
        task = self.loop.create_task(coro)
        self._scheduled.add(task)  # a task only the loop refers to may be collected
        task.add_done_callback(self._scheduled.discard)

    def close(self) -> None:
        # A stream its reader stopped early leaves async generators open on this loop
        # (the guard's response body, the inner transport's): their aclose() has to run
        # here, before the loop stops. Left to the collector, it is scheduled on a loop
        # that never runs again, and Python 3.13 warns that it was never awaited.
        self.run(self.loop.shutdown_asyncgens())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()

    @property
    def closed(self) -> bool:
        return self.loop.is_closed() or not self._thread.is_alive()


#: Threads for a sync inner transport's blocking calls: one per connection its pool may
#: hold (httpx's default ``max_connections``). A call waits on its thread for as long as
#: the upstream takes (up to ``upstream_read_timeout_s``), so asyncio's small default
#: pool (cores + 4) would let a few slow upstreams hold up every other call.
SYNC_INNER_THREADS = 100


class _ThreadedStream(httpx.AsyncByteStream):
    """A sync inner response stream, read from the portal loop via worker threads."""

    def __init__(self, stream: httpx.SyncByteStream, threads: ThreadPoolExecutor) -> None:
        self._stream = stream
        self._threads = threads

    async def __aiter__(self) -> AsyncIterator[bytes]:
        it = iter(self._stream)
        loop = asyncio.get_running_loop()
        while True:
            chunk = await loop.run_in_executor(self._threads, next, it, None)
            if chunk is None:
                return
            yield chunk

    async def aclose(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._threads, self._stream.close)


class _SyncInner(httpx.AsyncBaseTransport):
    """Adapts a sync inner transport to the async guard."""

    def __init__(self, inner: httpx.BaseTransport) -> None:
        self.inner = inner
        self._threads = ThreadPoolExecutor(SYNC_INNER_THREADS, "effectguard-upstream")

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        sync_request = httpx.Request(
            request.method,
            request.url,
            headers=request.headers,
            content=request.content,
            extensions=request.extensions,
        )
        loop = asyncio.get_running_loop()
        response = await loop.run_in_executor(
            self._threads, self.inner.handle_request, sync_request
        )
        assert isinstance(response.stream, httpx.SyncByteStream)
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=_ThreadedStream(response.stream, self._threads),
            extensions=response.extensions,
            request=request,
        )

    async def aclose(self) -> None:
        await asyncio.to_thread(self.inner.close)
        # Threads still reading (abandoned streams) end with their upstream; not waited for.
        self._threads.shutdown(wait=False)


class _PortalStream(httpx.SyncByteStream):
    """The guard's async response stream, read from sync code through the portal."""

    def __init__(self, portal: _Portal, response: httpx.Response) -> None:
        self._portal = portal
        self._response = response

    def __iter__(self) -> Iterator[bytes]:
        chunks = self._response.aiter_raw()
        while True:
            try:
                yield self._portal.run(chunks.__anext__())
            except StopAsyncIteration:
                return

    def close(self) -> None:
        self._portal.run_or_schedule(self._response.aclose())


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
        self._portal = _Portal()
        self._async = AsyncGuardTransport(
            _SyncInner(inner or httpx.HTTPTransport()),
            ledger=ledger,
            budget=budget,
            providers=providers,
            upstreams=upstreams,
            refuse_unmatched=refuse_unmatched,
            settings=settings,
            observer=observer,
            crash=crash,
            otel=otel,
            reconcile_hook=reconcile_hook,  # async: it runs on the portal's loop
        )

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
        if response.is_stream_consumed:  # the guard already holds the whole body
            return httpx.Response(
                response.status_code,
                headers=response.headers,
                content=response.content,
                extensions=response.extensions,
                request=request,
            )
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=_PortalStream(self._portal, response),
            extensions=response.extensions,
            request=request,
        )

    def close(self) -> None:
        if self._portal.closed:  # a second close: the loop that would run it is gone
            return
        self._portal.run(self._async.aclose())
        self._portal.close()
