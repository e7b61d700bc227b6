"""A synchronous inner transport under the async guard (:class:`GuardTransport`'s ``inner``).

The guard runs on the portal's event loop; a sync transport's calls block, so each runs
on a worker thread. Sending and reading run on two pools of their own. On one pool, a
crowd of callers (more than twice its threads, each waiting for one of the inner
transport's pooled connections) took every thread, while the answers holding those
connections needed a thread to be read to their end and give them back: every call
waited for its pool timeout (the SDKs' default is 10 minutes). A read never waits for a
connection, so the read pool always makes progress, and each answer read frees one.

Both pools are daemon threads (:mod:`effectguard.ledger.daemonthreads`): a program that
ends without closing its transport is not held until its provider answers, and a thread
still calling after the main thread returned is served, as by plain httpx.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx

from effectguard.ledger.daemonthreads import DaemonThreads

#: Threads for a sync inner transport's blocking calls: one per connection its pool may
#: hold (httpx's default ``max_connections``). A call waits on its thread for as long as
#: the upstream takes (up to ``upstream_read_timeout_s``), so asyncio's small default
#: pool (cores + 4) would let a few slow upstreams hold up every other call.
SYNC_INNER_THREADS = 100


class _ThreadedStream(httpx.AsyncByteStream):
    """A sync inner response stream, read from the portal loop via worker threads."""

    def __init__(self, stream: httpx.SyncByteStream, threads: DaemonThreads) -> None:
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


class SyncInner(httpx.AsyncBaseTransport):
    """Adapts a sync inner transport to the async guard."""

    def __init__(self, inner: httpx.BaseTransport) -> None:
        self.inner = inner
        self._sends = DaemonThreads(SYNC_INNER_THREADS, "effectguard-upstream")
        self._reads = DaemonThreads(SYNC_INNER_THREADS, "effectguard-upstream-read")

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        sync_request = httpx.Request(
            request.method,
            request.url,
            headers=request.headers,
            content=request.content,
            extensions=request.extensions,
        )
        loop = asyncio.get_running_loop()
        response = await loop.run_in_executor(self._sends, self.inner.handle_request, sync_request)
        assert isinstance(response.stream, httpx.SyncByteStream)
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=_ThreadedStream(response.stream, self._reads),
            extensions=response.extensions,
            request=request,
        )

    async def aclose(self) -> None:
        # A thread of its own: both pools may be full of calls still waiting on their
        # upstream, and asyncio.to_thread's pool is one that interpreter exit refuses.
        closer = DaemonThreads(1, "effectguard-upstream-close")
        try:
            await asyncio.get_running_loop().run_in_executor(closer, self.inner.close)
        finally:
            closer.shutdown(wait=False)
            # Threads still reading (abandoned streams) end with their upstream, which
            # the inner's close just closed: waited for, bounded (docs/contract.md §1.2).
            self._sends.shutdown(wait=False)
            self._reads.shutdown(wait=False)
            for pool in (closer, self._sends, self._reads):
                await pool.ended()
