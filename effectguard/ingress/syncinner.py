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
import concurrent.futures
import socket
from collections.abc import AsyncIterator

import httpx

from effectguard.ledger.daemonthreads import DaemonThreads

#: Threads for a sync inner transport's blocking calls: one per connection its pool may
#: hold (httpx's default ``max_connections``). A call waits on its thread for as long as
#: the upstream takes (up to ``upstream_read_timeout_s``), so asyncio's small default
#: pool (cores + 4) would let a few slow upstreams hold up every other call.
SYNC_INNER_THREADS = 100
#: How long closing a stream waits for the read it woke to end (it ends at once: this
#: bounds only a read that the socket's shutdown did not reach).
WAKE_WAIT_S = 1.0


class _ThreadedStream(httpx.AsyncByteStream):
    """A sync inner response stream, read from the portal loop via worker threads.

    Closed part-way (an answer cut off at its bound, a caller gone), a read under way on a
    worker thread is woken first: it would otherwise hold its thread and its connection
    until its upstream's next bytes, up to the read timeout, long after the answer was
    given up. Its socket is shut down (the connection is spent anyway: a response closed
    before its end closes it), which ends the blocked read at once; then the stream is
    closed, as before, once no read is under way on it."""

    def __init__(
        self, stream: httpx.SyncByteStream, threads: DaemonThreads, network: object = None
    ) -> None:
        self._stream = stream
        self._threads = threads
        #: httpcore's ``network_stream`` extension, where the inner transport gives one.
        self._network = network
        #: The read under way on a worker thread, if any.
        self._reading: concurrent.futures.Future[bytes | None] | None = None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        it = iter(self._stream)
        while True:
            self._reading = self._threads.submit(next, it, None)
            chunk = await asyncio.wrap_future(self._reading)
            if chunk is None:
                return
            yield chunk

    async def aclose(self) -> None:
        reading = self._reading
        if reading is not None and not reading.done() and _wake(self._network):
            woken = asyncio.wrap_future(reading)
            await asyncio.wait([woken], timeout=WAKE_WAIT_S)
            if woken.done() and not woken.cancelled():
                woken.exception()  # the read's error, the shutdown's doing: nobody's to hear
            else:
                woken.cancel()
        await asyncio.get_running_loop().run_in_executor(self._threads, self._stream.close)


def _wake(network: object) -> bool:
    """Shut down the socket under httpcore's ``network`` stream, waking a read blocked on
    it; False where there is none to shut down (another inner transport, HTTP/2).

    The plain socket's own shutdown, even under TLS: ``SSLSocket.shutdown`` would also drop
    the TLS state the blocked read is using."""
    get_extra_info = getattr(network, "get_extra_info", None)
    sock = get_extra_info("socket") if callable(get_extra_info) else None
    if not isinstance(sock, socket.socket):
        return False
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        return False  # closed already: no read can be blocked on it
    return True


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
            stream=_ThreadedStream(
                response.stream, self._reads, response.extensions.get("network_stream")
            ),
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
