"""The proxy's upstream leg: aiohttp, spoken directly.

aiohttp measured the fastest client here (README). The proxy used to reach it
through httpx's API (httpx-aiohttp): an ``httpx.Request`` built for each attempt,
then an ``httpx.Response`` wrapped around aiohttp's answer, with their headers
parsed and re-encoded each time. :class:`AiohttpLeg` sends the guard's
:class:`~effectguard.callpath.exchange.Outbound` as it is and answers an
:class:`~effectguard.callpath.exchange.Upstream` over aiohttp's response.

Failures are mapped to the httpx exceptions httpx-aiohttp raised, with aiohttp's
own exception as their cause, so the guard tells "never sent" from "effect
unknown" exactly as before (:func:`effectguard.callpath.wire.classify_transport_error`).
An aiohttp error httpx-aiohttp leaves unmapped (an answer aiohttp cannot parse: not
HTTP, a header line past its limit) is ``httpx.RemoteProtocolError``, as httpx itself
raises for such an answer: the request was sent, so its effect is unknown.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import aiohttp
import httpx
import yarl
from aiohttp.streams import EofStream
from httpx_aiohttp.transport import map_aiohttp_exceptions

from effectguard.callpath.exchange import Headers, Outbound, decoded
from effectguard.config import defaults
from effectguard.ingress import spool
from effectguard.ingress.aiopool import PoolConnector, PooledRequest, StaleConnection

if TYPE_CHECKING:
    from effectguard.config.settings import ServeSettings

_URL_CACHE_SIZE = 1024
#: Connections a request may find closed by the upstream before one carries it: every
#: pooled connection to an upstream that restarted can be dead at once, though aiohttp
#: drops most of them itself once it has read their close.
STALE_TRIES = 4
#: Header fields an upstream answer may carry. aiohttp's default (128) refused answers
#: the transports take (h11 bounds only the head, at 100 KiB), as effect_unknown. With
#: aiohttp's 8190-byte bound per field this keeps one answer's head under 32 MiB, half
#: the default ``max_answer_bytes``; more fields than this is no provider's answer.
MAX_ANSWER_FIELDS = 4096


@contextmanager
def _translated() -> Iterator[None]:
    """httpx-aiohttp's mapping, and :class:`httpx.RemoteProtocolError` for the aiohttp
    errors it passes through unmapped (a ``ClientResponseError`` for an answer that does
    not parse), which reached the guard as an internal error."""
    try:
        with map_aiohttp_exceptions():
            yield
    except aiohttp.ClientError as exc:
        raise httpx.RemoteProtocolError(f"{type(exc).__name__}: {exc}") from exc


class AiohttpUpstream:
    """aiohttp's response, its body still unread."""

    __slots__ = ("_response", "extensions", "headers", "status")

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status: int = response.status
        self.headers: Headers = list(response.raw_headers)
        self.extensions: dict[str, Any] = {}

    def aiter_raw(self) -> AsyncIterator[bytes]:
        return _Body(self._response.content)

    async def aclose(self) -> None:
        # Returns a fully read connection to the pool; closes one read only in part.
        self._response.release()


class _Body:
    """An answer's body, chunk by chunk as it arrives, aiohttp's failures as httpx's.

    An iterator object, not an async generator: a read cancelled under it (the proxy's
    request cancelled at the end of a SIGTERM drain while it waited for a stream's next
    chunk) leaves it able to read on, so the guard reads the rest of that stream in the
    background and settles it (docs/operations.md, "the SIGTERM drain"). A cancellation
    thrown into a generator ends it: the background read then found the body ended, and a
    stream its provider was still sending was booked broken (``effect_unknown``, "ended
    before its terminal event") the moment the drain ended.
    """

    __slots__ = ("_content",)

    def __init__(self, content: aiohttp.StreamReader) -> None:
        self._content = content

    def __aiter__(self) -> _Body:
        return self

    async def __anext__(self) -> bytes:
        try:
            chunk = await self._content.readany()
        except EofStream:  # as aiohttp's own iter_any() reads it: the end of the body
            raise StopAsyncIteration from None
        except Exception:
            with _translated():
                raise
        if not chunk:  # readany's end of the body
            raise StopAsyncIteration
        return chunk


class AiohttpLeg:
    """Sends :class:`Outbound` requests with one aiohttp session (opened on first use).

    At most ``connections`` requests hold a connection at once, and at most ``per_origin``
    of them to any one upstream origin (scheme, host, port: aiohttp's ``limit_per_host``).
    Without the second bound, one provider that accepts connections and never answers held
    every connection until ``read_timeout_s``, and each call to every other provider waited
    for one, then failed unsent (docs/configuration.md, ``[upstream]``). aiohttp counts
    both in the pool it already keeps: no work per request here.
    """

    def __init__(
        self,
        connect_timeout_s: float,
        read_timeout_s: float,
        *,
        connections: int = defaults.UPSTREAM_CONNECTIONS,
        per_origin: int = defaults.UPSTREAM_CONNECTIONS // 2,
    ) -> None:
        self._limits = (connections, per_origin)
        self._session: aiohttp.ClientSession | None = None
        self._urls: dict[str, yarl.URL] = {}
        # As the httpx-aiohttp leg mapped httpx's timeouts: pool -> connect. A request
        # waiting for a pooled connection is under the connect timeout, so its timeout is
        # a ConnectionTimeoutError: nothing was sent (callpath/wire.py).
        self._timeout = aiohttp.ClientTimeout(
            sock_connect=connect_timeout_s, sock_read=read_timeout_s, connect=connect_timeout_s
        )
        # The trust store httpx used, read now: built with the session at the first call,
        # it opened a file then, and with every descriptor taken (a flood of idle client
        # connections) that raised before anything was sent, and the call was booked
        # effect_unknown. A connect that fails for want of a descriptor proves "not sent".
        self._ssl = httpx.create_ssl_context(trust_env=False)

    @classmethod
    def configured(cls, settings: ServeSettings) -> AiohttpLeg:
        """The leg ``serve``'s ``[upstream]`` settings describe."""
        return cls(
            settings.connect_timeout_s,
            settings.read_timeout_s,
            connections=settings.upstream_connections,
            per_origin=settings.upstream_connections_per_origin,
        )

    def _open(self) -> aiohttp.ClientSession:
        connector = PoolConnector(
            limit=self._limits[0],
            limit_per_host=self._limits[1],
            keepalive_timeout=defaults.UPSTREAM_KEEPALIVE_S,
            ssl=self._ssl,
        )
        session = aiohttp.ClientSession(
            connector=connector,
            trust_env=False,
            max_headers=MAX_ANSWER_FIELDS,
            request_class=PooledRequest,
        )
        # aiohttp resends a PUT, DELETE or GET by itself, once, when a reused keep-alive
        # connection fails (RFC 9112 §9.3.1.1): a second send the ledger never records,
        # and a PUT or DELETE may be an effect. Every attempt is the guard's to make.
        # The switch has no public name; tests/test_proxy_leg.py pins its meaning.
        session._retry_connection = False
        self._session = session
        return session

    async def send(self, request: Outbound) -> AiohttpUpstream:
        """Send ``request``; its answer with the body still to read.

        A connection the upstream closed before anything was written on it
        (:class:`~effectguard.ingress.aiopool.StaleConnection`) carried nothing: the request
        goes on the next one, a fresh one once the pool's are used up. After
        ``STALE_TRIES`` such connections it is not sent (``httpx.ConnectError``)."""
        session = self._session or self._open()
        headers = decoded(request.headers)
        if request.spool is not None:
            headers.append(("content-length", str(request.spool.size)))
        for tries_left in range(STALE_TRIES - 1, -1, -1):
            try:
                return await self._send_once(session, request, headers)
            except httpx.TransportError as exc:
                stale = exc.__cause__
                if not isinstance(stale, StaleConnection):
                    raise
                if not tries_left:
                    raise httpx.ConnectError(f"{type(stale).__name__}: {stale}") from stale
        raise AssertionError("unreachable")  # pragma: no cover

    async def _send_once(
        self, session: aiohttp.ClientSession, request: Outbound, headers: list[tuple[str, str]]
    ) -> AiohttpUpstream:
        data: Any = request.body or None
        if request.spool is not None:
            # Opened here, so a file gone before the send is "not sent"; from then on
            # aiohttp's body writer owns it, however early the upstream answers.
            data = spool.SpoolReader.open(request.spool)
        try:
            with _translated():
                response = await session.request(
                    request.method,
                    self._url(request.url),
                    headers=headers,
                    data=data,
                    allow_redirects=False,
                    auto_decompress=False,
                    compress=False,
                    timeout=self._timeout,
                )
        except BaseException:
            if isinstance(data, spool.SpoolReader):
                data.close()
            raise
        return AiohttpUpstream(response)

    def _url(self, text: str) -> yarl.URL:
        # Parsed once per distinct URL (clients use few). ``encoded``: the path was checked
        # as the client sent it (rules/paths) and goes upstream as those bytes; parsed
        # plainly, yarl would re-quote it (``%3b`` to ``;``, ``%7e`` to ``~``).
        url = self._urls.get(text)
        if url is None:
            if len(self._urls) >= _URL_CACHE_SIZE:
                self._urls.clear()
            url = self._urls[text] = yarl.URL(text, encoded=True)
        return url

    async def aclose(self) -> None:
        """Close the session and its connections."""
        if self._session is not None:
            await self._session.close()
            self._session = None
