"""A streamed answer as the transport's caller reads it (docs/contract.md §3.8).

The guard's stream reads the upstream and records the call at its end. Its caller, an
SDK in the application, may stop reading in ways the guard never hears of, and none of
them may end the call as a stream cut short (``effect_unknown``) when the provider is
answering it whole:

* **A timeout or a cancellation while a chunk is awaited** (``asyncio.timeout`` around
  the loop, a web framework cancelling the handler whose client left, the caller's own
  ``read`` timeout). Raised inside the upstream read, it would end the read of the
  upstream itself. So each chunk is read in a task of its own; the caller waits for that
  task, and what ends its wait leaves the read running. Once the caller closes the
  stream, the read is awaited and the rest read into the ledger in the background.
* **A stream dropped without being closed**, read in part or not at all (an SDK stream
  the caller never iterated, a response that never reached a caller interrupted while it
  waited). Nothing of the guard's would ever be finalized, and the call would stay in
  flight until the transport closed. A finalizer closes it on the guard's loop, whatever
  thread the collector runs on.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

Keep = Callable[[asyncio.Future[Any]], None]


class _Reading:
    """What closing a caller's stream needs, apart from the stream object itself (the
    finalizer must not hold the object it finalizes)."""

    def __init__(self, stream: httpx.AsyncByteStream, keep: Keep) -> None:
        self.stream = stream
        self.keep = keep
        self.loop = asyncio.get_running_loop()
        #: A chunk's read that the caller stopped waiting for, still running.
        self.late: asyncio.Future[bytes] | None = None
        self.closed = False

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        late = self.late
        if late is None or late.done():
            await self.stream.aclose()
        else:
            self.keep(asyncio.ensure_future(self._close_after(late)))

    async def _close_after(self, late: asyncio.Future[bytes]) -> None:
        with contextlib.suppress(Exception):  # the guard has recorded how the stream ended
            await late
        await self.stream.aclose()

    def close_soon(self) -> None:
        """From the collector, on any thread: close on the loop, if it still runs."""
        with contextlib.suppress(RuntimeError):  # the loop was closed: nothing runs on it
            self.loop.call_soon_threadsafe(self._start_close)

    def _start_close(self) -> None:
        if not self.closed:
            self.keep(asyncio.ensure_future(self.close()))


class CallerStream(httpx.AsyncByteStream):
    """The guard's streamed answer as its caller reads it: each chunk within ``read_s``
    (None: no limit), else ``httpx.ReadTimeout`` as from a plain transport; a caller that
    stops waiting, closes or drops it never ends the upstream read."""

    def __init__(
        self,
        stream: httpx.AsyncByteStream,
        read_s: float | None,
        request: httpx.Request,
        keep: Keep,
        owner: object = None,
    ) -> None:
        """``keep`` holds a background task until it is done (the guard's recorder, so a
        shutdown waits for it). ``owner`` (the transport) is held while the stream lives:
        a transport collected unclosed closes itself, which must not happen under a
        stream still read after its client was dropped."""
        self._owner = owner
        self._reading = _Reading(stream, keep)
        self._read_s = read_s
        self._request = request
        finalizer = weakref.finalize(self, self._reading.close_soon)
        finalizer.atexit = False  # at exit the loop's own shutdown settles what it can
        self._finalizer = finalizer

    async def __aiter__(self) -> AsyncIterator[bytes]:
        reading = self._reading
        chunks = reading.stream.__aiter__()
        while True:
            # Left set while the caller waits: a cancellation or a timeout that ends the
            # wait leaves this read running, for close() to await.
            step = reading.late = asyncio.ensure_future(chunks.__anext__())
            done, _ = await asyncio.wait((step,), timeout=self._read_s)
            if not done:
                raise httpx.ReadTimeout(
                    f"no more of this stream came within its read timeout ({self._read_s:g} "
                    "s); the call goes on and is settled: resend with the same "
                    "Idempotency-Key for its answer",
                    request=self._request,
                )
            reading.late = None
            try:
                chunk = step.result()
            except StopAsyncIteration:
                return
            yield chunk

    async def aclose(self) -> None:
        self._finalizer.detach()
        await self._reading.close()
