"""The transports' default upstream leg: one httpx connection pool per origin.

httpx's transport pools at most 100 connections for all the hosts it reaches, with no
bound per host. Under one pool, a provider that accepts connections and never answers
held all 100, and a call to every other provider the transport routes to waited for a
free one until its pool timeout: recorded ``not_sent``, retried, then failed, while its
own provider was well. Here each origin (scheme, host, port) gets a pool of its own,
made on first use, so a hung provider can hold only its own connections, as the proxy's
``max_connections_per_upstream`` keeps it to its share (docs/contract.md, "Connections
to upstreams"). Only the declared providers' origins get one: the rest of the traffic
(requests the transport passes through) shares one pool, so a program that reaches many
hosts through it holds one pool more, not one a host.

The pools are async transports of any kind: ``httpx.AsyncHTTPTransport`` for
:class:`~effectguard.AsyncGuardTransport`, and for :class:`~effectguard.GuardTransport` a
sync ``httpx.HTTPTransport`` run on its own threads
(:class:`~effectguard.ingress.syncinner.SyncInner`), since a hung provider's calls hold
their threads as they hold their connections.

Each pool keeps an idle connection for ``UPSTREAM_KEEPALIVE_S`` (4 s), not httpx's 5 s:
an upstream whose own keep-alive timeout is 5 s closed a connection just as the next
call, 4.9 s after the last, was sent on it, and that call was lost unread and booked
``effect_unknown`` (docs/contract.md §12, "Kept-alive connections the upstream closes").
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Iterable

import httpx

from effectguard.config import defaults
from effectguard.ingress.syncinner import SyncInner

#: httpx's default limits, but for how long an idle connection is kept.
LIMITS = httpx.Limits(
    max_connections=100,
    max_keepalive_connections=20,
    keepalive_expiry=defaults.UPSTREAM_KEEPALIVE_S,
)

#: An origin as httpx reads a URL: scheme, host (lowered) and port (None: the default).
Origin = tuple[bytes, bytes, int | None]


def origin_of(url: httpx.URL) -> Origin:
    """``url``'s origin."""
    return (url.raw_scheme, url.raw_host, url.port)


class OriginPools(httpx.AsyncBaseTransport):
    """Routes each request to the pool of its URL's origin if that is one of ``origins``
    (the declared providers'), else to the pool the other origins share; each pool is
    made by ``make`` on first use.

    ``make`` takes the TLS context all the pools share: loading the CA bundle once, not
    once per origin."""

    def __init__(
        self,
        make: Callable[[ssl.SSLContext], httpx.AsyncBaseTransport],
        origins: Iterable[Origin] = (),
    ) -> None:
        self._make = make
        self._own = frozenset(origins)
        self._tls: ssl.SSLContext | None = None
        self._pools: dict[Origin | None, httpx.AsyncBaseTransport] = {}

    def pool(self, url: httpx.URL) -> httpx.AsyncBaseTransport:
        """The pool of ``url``'s origin (or the shared one), made now if there is none yet."""
        origin: Origin | None = origin_of(url)
        if origin not in self._own:
            origin = None
        pool = self._pools.get(origin)
        if pool is None:
            if self._tls is None:
                self._tls = httpx.create_ssl_context()
            pool = self._pools[origin] = self._make(self._tls)
        return pool

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.pool(request.url).handle_async_request(request)

    async def aclose(self) -> None:
        """Close every pool. Used again afterwards (as httpx's transports may be), it
        makes new ones."""
        pools, self._pools = self._pools, {}
        errors: list[Exception] = []
        for pool in pools.values():
            try:
                await pool.aclose()
            except Exception as exc:  # the others are closed all the same
                errors.append(exc)
        if errors:
            raise errors[0]


def async_pools(origins: Iterable[Origin]) -> OriginPools:
    """The default upstream leg of :class:`~effectguard.AsyncGuardTransport`, a pool for
    each of ``origins``."""
    return OriginPools(lambda tls: httpx.AsyncHTTPTransport(verify=tls, limits=LIMITS), origins)


def sync_pools(origins: Iterable[Origin]) -> OriginPools:
    """The default upstream leg of :class:`~effectguard.GuardTransport`: each of
    ``origins``' sync pool with threads of its own."""
    return OriginPools(
        lambda tls: SyncInner(httpx.HTTPTransport(verify=tls, limits=LIMITS)), origins
    )
