"""The client's request as the proxy hands it to the guard.

Its body read within ``max_body_bytes`` (a large upload spooled to disk), the client's
credentials swapped for the provider key effectguard holds, and its upstream URL
resolved under the provider's base URL. One per :class:`~effectguard.ingress.server.ProxyApp`:
it keeps the resolved URLs, since parsing a URL is a measurable share of a request and
clients use few distinct ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import httpx

from effectguard.callpath.exchange import Outbound, header_value
from effectguard.callpath.wire import strip_hop_by_hop
from effectguard.errors import Refusal
from effectguard.ingress.fallback import Receive, Scope
from effectguard.ingress.keyring import KeyRing
from effectguard.ingress.requestchecks import check_utf8
from effectguard.ingress.spool import Body, TooLarge, read_body, spools
from effectguard.providers import Provider
from effectguard.rules.counts import parse_count

if TYPE_CHECKING:
    from effectguard.config.settings import ServeSettings

_URL_CACHE_SIZE = 1024
#: Client credentials that must never reach the provider when effectguard holds the key.
CLIENT_CREDENTIALS = (b"authorization", b"x-api-key", b"api-key", b"effectguard-key")


class OutboundRequests:
    """Builds each request the proxy sends upstream, for one server's settings."""

    def __init__(self, settings: ServeSettings, keyring: KeyRing) -> None:
        self.settings = settings
        self.keyring = keyring
        self._timeout = {
            "connect": settings.connect_timeout_s,
            "pool": settings.connect_timeout_s,
            "read": settings.read_timeout_s,
            "write": settings.read_timeout_s,
        }
        self._urls: dict[tuple[str, bytes], tuple[str, str, str]] = {}

    async def body(self, receive: Receive, raw_headers: list[tuple[bytes, bytes]]) -> Body:
        """The request body, at most ``max_body_bytes`` (else 413); a large upload spooled."""
        declared = header_value(raw_headers, "content-length")
        limit = self.settings.max_body_bytes
        length = None if declared is None else parse_count(declared, limit)
        if declared is not None and length is None:
            raise Refusal(400, "invalid_request", "Content-Length is not a number")
        too_large = Refusal(
            413, "request_too_large", f"request bodies are limited to {limit} bytes"
        )
        if length is not None and length > limit:
            raise too_large
        spool_over = None
        if spools(header_value(raw_headers, "content-type")):
            spool_over = self.settings.spool_body_bytes
        try:
            return await read_body(
                receive, limit, spool_over=spool_over, spool_dir=self.settings.spool_dir
            )
        except TooLarge:
            raise too_large from None

    def request(
        self,
        scope: Scope,
        provider: Provider,
        upstream_path: str,
        raw_headers: list[tuple[bytes, bytes]],
        body: Body,
    ) -> Outbound:
        """The client's request as it goes to the guard: credentials swapped, URL resolved."""
        # Wire bytes throughout: a UTF-8 header value goes upstream exactly as it came.
        check_utf8(raw_headers)
        out_headers = strip_hop_by_hop(raw_headers)
        provider_key = self.settings.provider_keys.get(provider.name)
        if provider_key is not None or self.keyring.required:
            # The provider's own credential header too (postmark's x-postmark-server-token):
            # a tenant's SDK sends its proxy key there, and ProxyApp._authorize reads it there.
            drop = (*CLIENT_CREDENTIALS, provider.key_header.lower().encode())
            out_headers = [(k, v) for k, v in out_headers if k.lower() not in drop]
            if provider_key is not None:
                credential = provider.key_format.format(key=provider_key)
                out_headers.append((provider.key_header.encode(), credential.encode()))
        url, path, target = self._url(
            provider.base_url + upstream_path, scope.get("query_string", b"")
        )
        return Outbound(
            scope["method"],
            url,
            path,
            target,
            out_headers,
            body.data,
            self._timeout,
            {},
            body.spool,
        )

    def _url(self, target: str, query: bytes) -> tuple[str, str, str]:
        """The upstream URL, its decoded path and its still-encoded path and query."""
        # Parsing a URL is a measurable share of a request; clients use few distinct ones.
        key = (target, query)
        parts = self._urls.get(key)
        if parts is None:
            try:
                url = httpx.URL(target, query=query or None)
            except httpx.InvalidURL as exc:
                raise Refusal(400, "invalid_request", f"invalid request URL: {exc}") from exc
            if len(self._urls) >= _URL_CACHE_SIZE:
                self._urls.clear()
            parts = self._urls[key] = (str(url), url.path, url.raw_path.decode("ascii"))
        return parts
