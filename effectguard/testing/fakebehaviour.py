"""What the fake provider does with one request, chosen by the request itself.

A client (the fault simulator, a test) sends ``x-fake-behaviour: SPEC`` where
SPEC is ``;``-separated ``name=value`` items (a bare name means ``name=1``):

==============  ===============================================================
``delay=S``     wait S seconds after the receipt is durable
``status=N``    answer N (a provider-shaped error body when N >= 400)
``drop``        read the request, write the receipt, then hang up: no response
``cut=K``       send K chunks (SSE events), then end the body *cleanly*: a
                valid HTTP message whose stream lacks its terminal event
``close=K``     send a stream close-delimited (no length, no chunking, as an
                HTTP/1.0 server does), K chunks, then close the connection
                cleanly (a FIN): to HTTP the body simply ended. A non-stream
                answer is sent whole
``reset=K``     send K chunks, then reset the connection (TCP RST)
``endless``     never end the answer: a JSON body is followed by whitespace, a
                stream's first event is repeated, until the client goes away
``trickle=S``   send the headers at once, then the answer one byte every S
                seconds, to its end (or until the client goes away): an
                upstream that is never silent for long, yet never done
``pad=N``       make the answer about N bytes larger (a JSON body: trailing
                whitespace; a stream: its first event repeated), then end it
                as usual
``moved=T``     answer ``status`` (default 307) with ``Location: T``, a path
                made absolute on the fake's own origin as providers write it
``id=X``        with ``times=N``: the behaviour applies to the first N requests
``times=N``     carrying ``id=X``; later ones get a plain answer, so a retry
                after a 429 or a 5xx can succeed
==============  ===============================================================

The receipt records the behaviour that was applied (``"behaviour"``) and the
request's ``x-fake-tag`` header (``"tag"``), which lets a checker tie a receipt
to the client request that caused it. This module imports nothing from
effectguard, like the fake provider itself.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from dataclasses import dataclass, replace
from typing import Literal

from aiohttp import web

from effectguard.testing.fakeanswers import Reply

__all__ = [
    "BEHAVIOUR_HEADER",
    "TAG_HEADER",
    "Behaviour",
    "Ending",
    "UseCounter",
    "padded",
    "parse",
    "send_answer",
]

BEHAVIOUR_HEADER = "x-fake-behaviour"
TAG_HEADER = "x-fake-tag"

#: How the answer ends: whole; no answer at all; a clean EOF, a FIN or a RST after K chunks;
#: or a close-delimited stream closed cleanly after K chunks.
Ending = Literal["whole", "drop", "cut", "break", "reset", "close", "endless"]


@dataclass(frozen=True, slots=True)
class Behaviour:
    """One request's behaviour; the default is a plain, immediate, whole answer."""

    delay: float | None = None
    status: int | None = None
    ending: Ending = "whole"
    after: int = 0
    id: str | None = None
    times: int | None = None
    pad: int = 0
    moved: str | None = None
    #: Seconds between the answer's bytes (None: sent as fast as the connection takes).
    trickle: float | None = None

    def render(self) -> str:
        """The header value that :func:`parse` turns back into this behaviour."""
        items: list[str] = []
        if self.delay is not None:
            items.append(f"delay={self.delay:g}")
        if self.status is not None:
            items.append(f"status={self.status}")
        if self.ending in ("drop", "endless"):
            items.append(self.ending)
        elif self.ending in ("cut", "reset", "close"):
            items.append(f"{self.ending}={self.after}")
        if self.id is not None:
            items.append(f"id={self.id}")
        if self.times is not None:
            items.append(f"times={self.times}")
        if self.pad:
            items.append(f"pad={self.pad}")
        if self.moved is not None:
            items.append(f"moved={self.moved}")
        if self.trickle is not None:
            items.append(f"trickle={self.trickle:g}")
        return ";".join(items)


def parse(text: str) -> Behaviour:
    """Parse an ``x-fake-behaviour`` value; raises ``ValueError`` on a bad item."""
    fields: dict[str, str] = {}
    for item in text.split(";"):
        name, _, value = item.strip().partition("=")
        if name:
            fields[name] = value or "1"
    known = {
        "delay",
        "status",
        "drop",
        "cut",
        "reset",
        "close",
        "id",
        "times",
        "endless",
        "pad",
        "moved",
        "trickle",
    }
    unknown = fields.keys() - known
    if unknown:
        raise ValueError(f"unknown behaviour items: {sorted(unknown)}")
    ending: Ending = "whole"
    after = 0
    bare: tuple[Ending, ...] = ("drop", "endless")
    for name in bare:
        if name in fields:
            ending = name
    endings: tuple[Ending, ...] = ("cut", "reset", "close")
    for name in endings:
        if name in fields:
            ending, after = name, int(fields[name])
    return Behaviour(
        delay=float(fields["delay"]) if "delay" in fields else None,
        status=int(fields["status"]) if "status" in fields else None,
        ending=ending,
        after=after,
        id=fields.get("id"),
        times=int(fields["times"]) if "times" in fields else None,
        pad=int(fields.get("pad", "0")),
        moved=fields.get("moved"),
        trickle=float(fields["trickle"]) if "trickle" in fields else None,
    )


class UseCounter:
    """Counts requests per behaviour id, to apply a ``times=N`` behaviour N times only."""

    def __init__(self) -> None:
        self._uses: dict[str, int] = {}

    def applies(self, behaviour: Behaviour) -> bool:
        """Whether ``behaviour`` applies to this request (and count the use)."""
        if behaviour.id is None or behaviour.times is None:
            return True
        used = self._uses.get(behaviour.id, 0)
        self._uses[behaviour.id] = used + 1
        return used < behaviour.times


def padded(reply: Reply, pad: int) -> Reply:
    """``reply`` about ``pad`` bytes larger, still well-formed: a JSON body followed by
    whitespace, or a stream whose first event is repeated."""
    if pad <= 0:
        return reply
    first = reply.chunks[0]
    if not reply.stream:
        return replace(reply, chunks=(first + b" " * pad,))
    repeats = (first,) * max(1, pad // len(first))
    return replace(reply, chunks=(first, *repeats, *reply.chunks[1:]))


async def send_answer(
    request: web.Request, reply: Reply, behaviour: Behaviour
) -> web.StreamResponse:
    """Send ``reply`` as ``behaviour`` says: padded, then ended as its ``ending`` says
    (after ``after`` chunks), or with ``trickle``, whole, a byte every ``trickle`` seconds.

    A peer that went away first (a killed proxy) is not an error here: aiohttp
    ignores the connection error it meets on the unsent response returned then.
    """
    reply = padded(reply, behaviour.pad)
    try:
        if behaviour.trickle is not None:
            return await _send_trickled(request, reply, behaviour.trickle)
        return await _send(request, reply, behaviour.ending, behaviour.after)
    except ConnectionError:
        return web.StreamResponse()


async def _send_trickled(request: web.Request, reply: Reply, every: float) -> web.StreamResponse:
    """The headers now (a body's length declared), then the answer a byte at a time."""
    response = web.StreamResponse(status=reply.status, headers=dict(reply.headers))
    response.content_type = reply.content_type
    body = b"".join(reply.chunks)
    if not reply.stream:
        response.content_length = len(body)
    await response.prepare(request)
    for i in range(len(body)):
        await response.write(body[i : i + 1])
        await asyncio.sleep(every)
    await response.write_eof()
    return response


async def _send(
    request: web.Request, reply: Reply, ending: Ending, after: int
) -> web.StreamResponse:
    chunks = reply.chunks
    if ending == "drop":
        _hang_up(request, reset=False)
        return web.StreamResponse()  # never sent: the transport is closed
    if ending == "close" and reply.stream:
        return await _send_close_delimited(request, reply, after)
    if ending == "endless":
        return await _send_endless(request, reply)
    if ending == "whole" or after >= len(chunks):
        if not reply.stream:
            return web.Response(
                status=reply.status,
                body=chunks[0],
                content_type=reply.content_type,
                headers=dict(reply.headers),
            )
        response = web.StreamResponse(status=reply.status)
        response.content_type = reply.content_type
        response.headers["Cache-Control"] = "no-cache"
        await response.prepare(request)
        for chunk in chunks:
            await response.write(chunk)
        await response.write_eof()
        return response
    # A broken answer: headers and the first K chunks, then the end.
    response = web.StreamResponse(status=reply.status)
    response.content_type = reply.content_type
    if not reply.stream:
        response.content_length = len(chunks[0])
    await response.prepare(request)
    for chunk in chunks[:after]:
        await response.write(chunk)
    if ending == "cut" and reply.stream:
        await response.write_eof()  # a clean end of a chunked body, without the terminal event
        return response
    transport = request.transport
    if transport is not None:
        # abort() drops unsent bytes, so let the K chunks reach the socket first.
        while transport.get_write_buffer_size() and not transport.is_closing():
            await asyncio.sleep(0.001)
    _hang_up(request, reset=ending == "reset")
    return response  # aiohttp's write_eof then meets a closed transport, and stays quiet


async def _send_endless(request: web.Request, reply: Reply) -> web.StreamResponse:
    """The answer's first chunk, then more of it until the peer goes away (the write that
    meets the closed connection raises, and :func:`send_answer` returns)."""
    response = web.StreamResponse(status=reply.status)
    response.content_type = reply.content_type
    await response.prepare(request)
    first = reply.chunks[0]
    more = first * max(1, 65536 // len(first)) if reply.stream else b" " * 65536
    await response.write(first)
    while True:
        await response.write(more)  # waits while the peer's window is full


class _CloseDelimited(web.StreamResponse):
    """A response whose body ends where the connection does: no length, no chunking.

    aiohttp chunks an HTTP/1.1 body of unknown length; skipping its length check (as its
    own WebSocketResponse does) leaves the framing to the connection's end, as an
    HTTP/1.0 server (or a proxy that strips chunking) sends an event stream.
    """

    _length_check = False


async def _send_close_delimited(
    request: web.Request, reply: Reply, after: int
) -> web.StreamResponse:
    """Send the first ``after`` chunks close-delimited, then close the connection cleanly."""
    response = _CloseDelimited(status=reply.status, headers={"Connection": "close"})
    response.content_type = reply.content_type
    await response.prepare(request)
    for chunk in reply.chunks[:after]:
        await response.write(chunk)
    transport = request.transport
    if transport is not None:
        # close() (unlike abort()) flushes what was written, then sends a FIN.
        transport.close()
    return response


def _hang_up(request: web.Request, *, reset: bool) -> None:
    """Close the connection now: a FIN, or with ``reset`` a TCP RST (SO_LINGER 0)."""
    transport = request.transport
    if transport is None:
        return
    if reset:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()
