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
    no bound). ``why`` is the timeout's message."""

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

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for held in self._held:
            yield held
        chunks = self._chunks or aiter(self._upstream.aiter_raw())
        while (chunk := await _next(chunks, self._deadline, self._why)) is not None:
            yield chunk


def bounded_stream(upstream: Upstream, seconds: float) -> BoundedBody:
    """An event stream's body, cut off ``seconds`` after now (0: never)."""
    deadline = asyncio.get_running_loop().time() + seconds if seconds > 0 else None
    return BoundedBody(upstream, deadline, answer_too_slow("stream_timeout_s", seconds))


async def held_plain(upstream: Upstream, seconds: float) -> bytes | BoundedBody:
    """A plain answer's body: its bytes, whole, if it ends within ``seconds`` and
    :data:`HELD_BYTES`; past that size, the body to forward as it comes, still bounded.
    Past ``seconds`` before either, ``httpx.ReadTimeout``."""
    deadline = asyncio.get_running_loop().time() + seconds
    why = answer_too_slow("read_timeout_s", seconds)
    chunks = aiter(upstream.aiter_raw())
    held: list[bytes] = []
    size = 0
    while (chunk := await _next(chunks, deadline, why)) is not None:
        held.append(chunk)
        size += len(chunk)
        if size > HELD_BYTES:
            return BoundedBody(upstream, deadline, why, tuple(held), chunks)
    return b"".join(held)


async def _next(chunks: AsyncIterator[bytes], deadline: float | None, why: str) -> bytes | None:
    """The next chunk, None at the end; past ``deadline``, ``httpx.ReadTimeout(why)``."""
    bound = asyncio.timeout_at(deadline)
    try:
        async with bound:
            return await anext(chunks)
    except StopAsyncIteration:
        return None
    except TimeoutError:
        if not bound.expired():
            raise  # not the bound's: another timeout, under it
        raise httpx.ReadTimeout(why) from None
