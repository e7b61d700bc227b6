"""The upstream leg's connection pool: a connection the upstream spoke on unasked is dropped.

aiohttp keeps parsing bytes that arrive on a kept-alive connection while it sits idle
in the pool, and queues a whole response found there; the next request sent on that
connection is then answered with it (aio-libs/aiohttp#13656; 3.14.5, the newest). For the
guard that is the worst kind of wrong answer: a call whose request never reached the
provider would be recorded as completed, at a cost and with a body the upstream chose
for some other call, maybe another tenant's.

HTTP/1.1 has no unsolicited responses: anything that arrives while no request is in
flight is a fault (a misbehaving upstream, or something between us). So a connection
is marked when it goes back to the pool, and a request sent on it again clears the mark
(aiohttp gives every request a parser of its own); a byte that arrives in between
aborts it, and the pool's own check (``is_connected``) then throws it away instead of
handing it to the next request, which goes out on a fresh connection.

A kept-alive connection the upstream closed while it sat idle (its keep-alive timeout
ran out) is thrown away by the same check, once aiohttp has read the close. A close
that reached the socket but not yet aiohttp, or that aiohttp read only after it handed
the connection to a request (the body is written one turn of the event loop later),
used to get the request written on a dead connection: lost unread, and booked
``effect_unknown`` since it was sent. :class:`PooledRequest` looks first, at the last
moment before anything is written (the headers wait for the body): a reused connection
that is closing, or that has anything to read (an idle connection has nothing to read
but a close), gets nothing written and fails with :class:`StaleConnection`, which
proves the request was not sent on it (the leg sends it on another). A close that
arrives after that look crosses the request on the wire; that one stays unknown.

aiohttp names no public hook for either step: the protocol factory (``_factory``), the
release (``_release``) and the protocol's parser (``_parser``) are private. (Overriding
``set_response_params`` to clear the mark cost more instructions per request.)
``tests/test_proxy_leg.py`` pins the behaviour, so an aiohttp that renames them fails a
test rather than silently losing the check.
"""

from __future__ import annotations

import functools
import select
from typing import Any

import aiohttp
from aiohttp.helpers import set_exception

from effectguard.ingress.brokenbody import BrokenBody
from effectguard.ingress.interim import InterimBound

#: No parser: what a connection that was never pooled holds as its idle parser.
_NEVER = object()


class _Handler(InterimBound, BrokenBody):
    """aiohttp's response parser, which refuses bytes that arrive while it is pooled (and
    bounds each answer's interim answers, :mod:`effectguard.ingress.interim`, and fails a
    body whose framing breaks part-way, :mod:`effectguard.ingress.brokenbody`)."""

    #: The parser of the answer it held when it went back to the pool. Every request
    #: sent on the connection gets a new parser (``set_response_params``), so while this
    #: is still the current one, no request is in flight.
    _idle_parser: object = _NEVER

    def data_received(self, data: bytes) -> None:
        if data and self._parser is self._idle_parser:
            # Nothing was asked on this connection: no byte here can be an answer.
            self.abort()
            return
        super().data_received(data)


class StaleConnection(aiohttp.ClientConnectionError):
    """The upstream closed the connection a request was given before any byte of the
    request was written on it: nothing was sent."""


def _closed_by_upstream(protocol: Any) -> bool:
    """Whether ``protocol``'s connection, between requests, was closed by the upstream."""
    transport = protocol.transport
    if transport is None or transport.is_closing():
        return True
    if getattr(protocol, "_idle_parser", _NEVER) is _NEVER:
        # Fresh: TLS records may still be arriving after the handshake (session
        # tickets), so readable says nothing; only a pooled connection is looked at.
        return False
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    # An idle HTTP/1.1 connection has nothing to read unless the upstream closed it (or
    # spoke unasked): httpcore looks the same way before it reuses one.
    poll = select.poll()
    poll.register(sock.fileno(), select.POLLIN)
    return bool(poll.poll(0))


class PooledRequest(aiohttp.ClientRequest):
    """aiohttp's request, which writes nothing on a connection the upstream closed."""

    async def send(self, conn: Any) -> aiohttp.ClientResponse:
        # Nothing is written before this (headers wait for the body, or go out here).
        if conn.protocol is not None and _closed_by_upstream(conn.protocol):
            raise StaleConnection("the upstream had closed the connection; nothing was sent")
        return await super().send(conn)

    async def write_bytes(self, writer: Any, conn: Any, content_length: int | None = None) -> None:
        # A turn of the event loop after send(): a close aiohttp read meanwhile is seen.
        protocol = conn.protocol
        if protocol is not None and _closed_by_upstream(protocol):
            set_exception(
                protocol,
                StaleConnection("the upstream had closed the connection; nothing was sent"),
            )
            conn.close()
            return
        await super().write_bytes(writer, conn, content_length)


class PoolConnector(aiohttp.TCPConnector):
    """A :class:`aiohttp.TCPConnector` whose pooled connections must stay silent."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._factory = functools.partial(_Handler, loop=self._loop)  # type: ignore[assignment]

    def _release(self, key: Any, protocol: Any, *args: Any, **kwargs: Any) -> None:
        super()._release(key, protocol, *args, **kwargs)
        # Closed or pooled, it is idle now: an open one is in the pool.
        if isinstance(protocol, _Handler):
            protocol._idle_parser = protocol._parser
