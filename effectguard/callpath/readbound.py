"""A read-only answer's body, bounded as a whole as a guarded call's is (callpath/exchange
``read_body``, callpath/stream): a plain answer must arrive whole within
``upstream_read_timeout_s`` of its headers, an event stream within
``upstream_stream_timeout_s`` (0: no bound).

``read_timeout_s`` bounds each wait for the next bytes, not the answer: without these
bounds an upstream that trickles a read's answer, never silent for that long, held the
request (a front-door slot, an upstream connection, the client) for as long as it kept
sending.

A plain answer is held, up to :data:`HELD_BYTES`, before its headers go out, so that one
not whole in time is still answered as a read that failed after sending is (504
``upstream_failed``, which a client may retry: a read has no effect to repeat). An answer
larger than that (a file's content) is forwarded as it comes, from what was held, and like
a stream is cut off with ``httpx.ReadTimeout`` at its bound: its headers are gone by then.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx

from effectguard.callpath.exchange import Upstream, UpstreamBody, answer_too_slow

#: The most of a plain read-only answer held before its headers go out. A listing or a
#: retrieved object is far smaller and comes at once; past this (a download) the answer is
#: forwarded as it comes, as before, so a read never holds much memory.
HELD_BYTES = 1 << 20


class BoundedBody(UpstreamBody):
    """An upstream answer's body forwarded as it comes (after any ``held`` chunks), cut off
    with ``httpx.ReadTimeout`` if it has not ended by ``deadline`` (the loop's clock; None:
    no bound). ``why`` is the timeout's message.

    One timer for the whole body, as a guarded stream has (nothing per chunk): at the
    deadline it cancels the read under way, if any, which then raises ``why``; a read not
    under way then (the client being written to) raises it when it is next asked for."""

    def __init__(
        self,
        upstream: Upstream,
        deadline: float | None,
        why: str,
        held: tuple[bytes, ...] = (),
        chunks: AsyncIterator[bytes] | None = None,
    ) -> None:
        super().__init__(upstream)
        self._deadline, self._why, self._held = deadline, why, held
        self._chunks = chunks
        self._expired = False
        #: The task awaiting the upstream's next chunk, while it does.
        self._reader: asyncio.Task[object] | None = None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for held in self._held:
            yield held
        chunks = self._chunks or aiter(self._upstream.aiter_raw())
        timer = None
        if self._deadline is not None:
            timer = asyncio.get_running_loop().call_at(self._deadline, self._expire)
        try:
            while (chunk := await self._next(chunks)) is not None:
                yield chunk
        finally:
            if timer is not None:
                timer.cancel()

    def _expire(self) -> None:
        self._expired = True
        if self._reader is not None:
            self._reader.cancel()

    async def _next(self, chunks: AsyncIterator[bytes]) -> bytes | None:
        if self._expired:
            raise httpx.ReadTimeout(self._why)
        self._reader = reader = asyncio.current_task()
        try:
            return await anext(chunks)
        except StopAsyncIteration:
            return None
        except asyncio.CancelledError:
            # The deadline's cancel alone becomes the timeout (as asyncio.timeout does);
            # one from elsewhere as well (the client gone, a shutdown) stays a cancel.
            if self._expired and reader is not None and reader.uncancel() == 0:
                raise httpx.ReadTimeout(self._why) from None
            raise
        finally:
            self._reader = None


def bounded(upstream: Upstream, seconds: float, setting: str) -> BoundedBody:
    """A body forwarded as it comes, cut off ``seconds`` after now (0: never), past
    ``setting`` (the name the timeout's message gives)."""
    deadline = asyncio.get_running_loop().time() + seconds if seconds > 0 else None
    return BoundedBody(upstream, deadline, answer_too_slow(setting, seconds))


async def held_plain(upstream: Upstream, seconds: float) -> bytes | BoundedBody:
    """A plain answer's body: its bytes, whole, if it ends within ``seconds`` and
    :data:`HELD_BYTES`; past that size, the body to forward as it comes, still bounded.
    Past ``seconds`` before either, ``httpx.ReadTimeout``."""
    deadline = asyncio.get_running_loop().time() + seconds
    why = answer_too_slow("read_timeout_s", seconds)
    chunks = aiter(upstream.aiter_raw())
    held: list[bytes] = []
    size = 0
    bound = asyncio.timeout_at(deadline)  # one timer while the body is held
    try:
        async with bound:
            async for chunk in chunks:
                held.append(chunk)
                size += len(chunk)
                if size > HELD_BYTES:
                    return BoundedBody(upstream, deadline, why, tuple(held), chunks)
    except TimeoutError:
        if not bound.expired():
            raise  # not the bound's: another timeout, under it
        raise httpx.ReadTimeout(why) from None
    return b"".join(held)
