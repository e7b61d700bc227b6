"""The httpx edge of the guard's shapes (:mod:`effectguard.callpath.exchange`).

The in-process transports, the reconcile command and tests speak httpx: a
request comes in as an ``httpx.Request``, goes upstream through an httpx
transport, and the answer leaves as an ``httpx.Response``. These adapters convert
at that edge only; the guard in between never sees an httpx object.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx

from effectguard.callpath.exchange import Headers, Outbound, Reply, ReplyStream, Send
from effectguard.rules.bodyref import CHUNK_BYTES

HttpxSend = Callable[[httpx.Request], Awaitable[httpx.Response]]


def outbound_from_httpx(request: httpx.Request) -> Outbound:
    """``request`` (already read) as the guard's :class:`Outbound`."""
    url = request.url
    timeout = request.extensions.get("timeout")
    return Outbound(
        method=request.method,
        url=str(url),
        path=url.path,
        target=url.raw_path.decode("ascii", "replace"),
        headers=list(request.headers.raw),
        body=request.content,
        timeout=timeout,
        extensions=dict(request.extensions),
    )


def httpx_request(outbound: Outbound) -> httpx.Request:
    """An :class:`Outbound` as an ``httpx.Request`` (its extensions and timeout kept)."""
    extensions = dict(outbound.extensions)
    if outbound.timeout is not None:
        extensions["timeout"] = outbound.timeout
    spool = outbound.spool
    if spool is None:
        return httpx.Request(
            outbound.method,
            outbound.url,
            headers=outbound.headers,
            content=outbound.body,
            extensions=extensions,
        )
    headers = [*outbound.headers, (b"content-length", str(spool.size).encode())]
    return httpx.Request(
        outbound.method,
        outbound.url,
        headers=headers,
        content=_file_chunks(spool.path),
        extensions=extensions,
    )


async def _file_chunks(path: str) -> AsyncIterator[bytes]:
    """A spooled upload's bytes, one chunk at a time (a test's httpx upstream leg)."""
    with open(path, "rb") as file:
        while chunk := file.read(CHUNK_BYTES):
            yield chunk


class HttpxUpstream:
    """An ``httpx.Response`` whose body is still to be read, as an :class:`Upstream`."""

    __slots__ = ("extensions", "headers", "response", "status")

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.status: int = response.status_code
        self.headers: Headers = list(response.headers.raw)
        self.extensions: dict[str, Any] = dict(response.extensions)

    def aiter_raw(self) -> AsyncIterator[bytes]:
        # The stream itself, not ``response.aiter_raw()``: that closes the response at its
        # end, which pools the connection before :meth:`aclose` can look at what is left.
        stream = self.response.stream
        assert isinstance(stream, httpx.AsyncByteStream)
        return stream.__aiter__()

    async def aclose(self) -> None:
        _refuse_pooling_after_leftovers(self.response.stream)
        await self.response.aclose()


#: How an httpx response stream reaches its HTTP/1.1 connection: httpx's own stream over
#: httpcore's pool stream, over the connection's stream (and a sync transport's wrapper).
_INNER = ("_stream", "_httpcore_stream", "_connection")


def _refuse_pooling_after_leftovers(stream: object) -> None:
    """Keep the connection of an answer read to its end out of the pool if the upstream
    sent bytes after it (contract §12, "An answer belongs to the request it follows").

    httpcore starts the connection's next exchange on whatever h11 received past the
    answer, so an upstream that writes a second answer behind the first one (or a body
    on a 204) would answer the next call on that connection, perhaps another client's,
    with its own usage. A connection whose state is marked failed is closed, not pooled,
    when the answer closes. httpcore keeps the h11 state in private attributes; if they
    move, nothing is found and tests/test_transport_wire.py fails.
    """
    node = stream
    for _ in range(6):
        h11_state = getattr(node, "_h11_state", None)
        if h11_state is not None:
            if h11_state.trailing_data[0]:
                h11_state.send_failed()
            return
        node = next((n for a in _INNER if (n := getattr(node, a, None)) is not None), None)
        if node is None:
            return


def httpx_send(send: HttpxSend) -> Send:
    """A :data:`Send` over an httpx transport's ``handle_async_request`` (or a client's)."""

    async def sending(outbound: Outbound) -> HttpxUpstream:
        return HttpxUpstream(await send(httpx_request(outbound)))

    return sending


class _ReplyBody(httpx.AsyncByteStream):
    def __init__(self, stream: ReplyStream) -> None:
        self._stream = stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._stream:
            yield chunk

    async def aclose(self) -> None:
        await self._stream.aclose()


def httpx_response(reply: Reply, request: httpx.Request | None = None) -> httpx.Response:
    """The guard's :class:`Reply` as an ``httpx.Response`` to ``request``."""
    if reply.body is not None:
        # A stream of the body as the upstream sent it, not ``content=``: httpx would read
        # (and decode) that at once, and the caller's client, reading it again, would find
        # gzip'd headers on decoded bytes, or a consumed stream where it asks for the raw one.
        return httpx.Response(
            reply.status,
            headers=reply.headers,
            stream=httpx.ByteStream(reply.body),
            request=request,
            extensions=reply.extensions,
        )
    assert reply.stream is not None
    return httpx.Response(
        reply.status,
        headers=reply.headers,
        stream=_ReplyBody(reply.stream),
        request=request,
        extensions=reply.extensions,
    )
