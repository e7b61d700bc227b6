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

aiohttp names no public hook for either step: the protocol factory (``_factory``), the
release (``_release``) and the protocol's parser (``_parser``) are private. (Overriding
``set_response_params`` to clear the mark cost more instructions per request.)
``tests/test_proxy_leg.py`` pins the behaviour, so an aiohttp that renames them fails a
test rather than silently losing the check.
"""

from __future__ import annotations

import functools
from typing import Any

import aiohttp

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
