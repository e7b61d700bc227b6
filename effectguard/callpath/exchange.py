"""The guard's own request and response shapes, independent of any HTTP client.

The guard works on these; each way in adapts to them once at its edge. The proxy
fills an :class:`Outbound` straight from the ASGI scope and sends it with aiohttp
(:mod:`effectguard.ingress.aioleg`); the transports convert to and from httpx
(:mod:`effectguard.callpath.httpxshape`). Building ``httpx.Request`` and
``httpx.Response`` objects around aiohttp had cost the proxy about a fifth of its
CPU per request (docs/performance.md, "Round 2").

Headers are wire bytes throughout: a UTF-8 value (RFC 9110 §5.5 obs-text) goes on
exactly as it came. Transport failures are raised as ``httpx.TransportError``
subclasses by every ``Send``, whatever client it uses: that is the vocabulary
:func:`effectguard.callpath.wire.classify_transport_error` decides "not sent" in.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from effectguard.rules.bodyref import SpooledBody

Headers = list[tuple[bytes, bytes]]


def header_value(headers: Iterable[tuple[bytes, bytes]], name: str) -> str | None:
    """The value of header ``name`` (any case), repeated values joined with ``", "``."""
    wanted = _wire_name(name)
    values = [v for k, v in headers if k.lower() == wanted]
    return _joined(values) if values else None


@functools.lru_cache(maxsize=256)
def _wire_name(name: str) -> bytes:
    return name.lower().encode("latin-1")


def _joined(values: list[bytes]) -> str:
    # As httpx's Headers.get: repeated values joined with ", ".
    return header_text(values[0]) if len(values) == 1 else ", ".join(map(header_text, values))


def header_text(value: bytes) -> str:
    """A header value as text: UTF-8 where it is valid (ASCII always is), else Latin-1."""
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return value.decode("latin-1")


@dataclass(slots=True)
class Outbound:
    """A request on its way upstream (the client's, or an attempt's).

    ``path`` is the decoded URL path; ``target`` the still-encoded path and query, as
    hashed and as checked against the provider's base path.
    """

    method: str
    url: str
    path: str
    target: str
    headers: Headers
    body: bytes
    #: Seconds per phase (``connect``, ``read``, ``write``, ``pool``); None: the client's own.
    timeout: Mapping[str, float | None] | None = None
    #: What the way in needs back unchanged (the httpx request's extensions).
    extensions: dict[str, Any] = field(default_factory=dict)
    #: A large upload spooled to a file (ingress/spool.py): then ``body`` is empty and
    #: every send reads the file.
    spool: SpooledBody | None = None
    #: ``headers`` by lower-cased name, built on the first :meth:`header` (a request is
    #: asked for six of them); change headers through :meth:`set_header` only.
    _index: dict[bytes, list[bytes]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def header(self, name: str) -> str | None:
        """The value of header ``name``, if present (repeated values joined with ``", "``)."""
        values = self._values(name)
        return _joined(values) if values else None

    def repeats(self, name: str) -> bool:
        """Whether header ``name`` is sent more than once."""
        return len(self._values(name)) > 1

    def _values(self, name: str) -> list[bytes]:
        index = self._index
        if index is None:
            index = {}
            for k, v in self.headers:
                index.setdefault(k.lower(), []).append(v)
            self._index = index
        return index.get(_wire_name(name), [])

    def set_header(self, name: str, value: str) -> None:
        """Set header ``name`` to ``value``, replacing any the request had."""
        wanted = _wire_name(name)
        self.headers = [(k, v) for k, v in self.headers if k.lower() != wanted]
        self.headers.append((wanted, value.encode("latin-1")))
        self._index = None


class Upstream(Protocol):
    """An upstream answer whose body has not been read yet."""

    status: int
    headers: Headers
    extensions: dict[str, Any]

    def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body's bytes as received (no content decoding)."""
        ...

    async def aclose(self) -> None:
        """Release the connection (reading no further)."""
        ...


Send = Callable[[Outbound], Awaitable[Upstream]]


async def read_body(upstream: Upstream, limit: int, within: float) -> bytes | None:
    """The answer's raw bytes, or None once they grow past ``limit`` (read no further).

    The whole body must arrive ``within`` seconds: an upstream that trickles it, never
    silent for its read timeout, is otherwise read for as long as it keeps sending. Past
    it, ``httpx.ReadTimeout``, as a read timeout after sending is (effect unknown)."""
    try:
        async with asyncio.timeout(within):  # one timer for the whole body
            return await _chunks_up_to(upstream, limit)
    except TimeoutError:
        raise httpx.ReadTimeout(answer_too_slow("read_timeout_s", within)) from None


def answer_too_slow(setting: str, seconds: float) -> str:
    """Why an answer that did not arrive whole within ``setting`` (``seconds``) of its
    headers was cut off, as a read timeout is: its upstream kept sending, never ending."""
    return f"the answer did not end within {setting} ({seconds:g} s) of its headers"


async def _chunks_up_to(upstream: Upstream, limit: int) -> bytes | None:
    chunks: list[bytes] = []
    size = 0
    async for chunk in upstream.aiter_raw():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


class ReplyStream(Protocol):
    """A body the client receives chunk by chunk."""

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


@dataclass(slots=True)
class Reply:
    """The guard's answer: a complete body, or a stream to forward."""

    status: int
    headers: Headers
    body: bytes | None = None
    stream: ReplyStream | None = None
    extensions: dict[str, Any] = field(default_factory=dict)

    def header(self, name: str) -> str | None:
        """The value of header ``name``, if present."""
        return header_value(self.headers, name)

    async def aclose(self) -> None:
        """Release a streamed body not read to its end."""
        if self.stream is not None:
            await self.stream.aclose()


class UpstreamBody:
    """An upstream answer's body as a :class:`ReplyStream`, forwarded untouched."""

    def __init__(self, upstream: Upstream) -> None:
        self._upstream = upstream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._upstream.aiter_raw():
            yield chunk

    async def aclose(self) -> None:
        await self._upstream.aclose()


def decoded(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    """Wire header pairs as text (names Latin-1, values as :func:`header_text`)."""
    return [(k.decode("latin-1"), header_text(v)) for k, v in headers]


def text_headers(pairs: Iterable[tuple[str, str]]) -> Headers:
    """Text header pairs as wire bytes (UTF-8, which ASCII values are unchanged by)."""
    return [(k.encode("latin-1"), v.encode("utf-8")) for k, v in pairs]
