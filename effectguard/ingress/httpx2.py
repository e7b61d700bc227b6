"""A thin adapter for SDKs built on ``httpx2`` (anthropic 2.x refuses httpx clients).

::

    from effectguard.ingress.httpx2 import Httpx2Transport
    claude = anthropic.Anthropic(http_client=httpx2.Client(
        transport=Httpx2Transport(effectguard.GuardTransport(ledger="effectguard.db"))))

It converts requests and responses between the two packages and translates
httpx errors into their httpx2 namesakes; the guard itself is unchanged.
Requires the ``httpx2`` package (installed with those SDKs).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import httpx2


def _to_httpx(request: httpx2.Request, body: bytes) -> httpx.Request:
    return httpx.Request(
        request.method,
        str(request.url),
        headers=request.headers.multi_items(),
        content=body,
        extensions=dict(request.extensions),
    )


def _to_httpx2(
    response: httpx.Response, stream: httpx2.SyncByteStream | httpx2.AsyncByteStream
) -> httpx2.Response:
    if response.is_stream_consumed:  # effectguard's own answer (a refusal), built whole
        return httpx2.Response(
            response.status_code,
            headers=response.headers.multi_items(),
            content=response.content,
        )
    return httpx2.Response(
        response.status_code, headers=response.headers.multi_items(), stream=stream
    )


def _translate(exc: httpx.TransportError) -> Exception:
    """The httpx2 exception of the same name (the SDKs catch those)."""
    cls = getattr(httpx2, type(exc).__name__, None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        cls = httpx2.TransportError
    return cls(str(exc))


class AsyncHttpx2Transport(httpx2.AsyncBaseTransport):
    """An httpx2 async transport over an httpx one (e.g. ``AsyncGuardTransport``)."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        body = await request.aread()
        try:
            response = await self.inner.handle_async_request(_to_httpx(request, body))
        except httpx.TransportError as exc:
            raise _translate(exc) from exc
        return _to_httpx2(response, _AsyncStream(response))

    async def aclose(self) -> None:
        await self.inner.aclose()


class _AsyncStream(httpx2.AsyncByteStream):
    def __init__(self, response: httpx.Response) -> None:
        self.response = response

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.response.aiter_raw():
                yield chunk
        except httpx.TransportError as exc:
            raise _translate(exc) from exc

    async def aclose(self) -> None:
        await self.response.aclose()


class Httpx2Transport(httpx2.BaseTransport):
    """An httpx2 sync transport over an httpx one (e.g. ``GuardTransport``)."""

    def __init__(self, inner: httpx.BaseTransport) -> None:
        self.inner = inner

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        body = request.read()
        try:
            response = self.inner.handle_request(_to_httpx(request, body))
        except httpx.TransportError as exc:
            raise _translate(exc) from exc
        return _to_httpx2(response, _SyncStream(response))

    def close(self) -> None:
        self.inner.close()


class _SyncStream(httpx2.SyncByteStream):
    def __init__(self, response: httpx.Response) -> None:
        self.response = response

    def __iter__(self) -> Iterator[bytes]:
        try:
            yield from self.response.iter_raw()
        except httpx.TransportError as exc:
            raise _translate(exc) from exc

    def close(self) -> None:
        self.response.close()
