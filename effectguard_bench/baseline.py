"""The baseline: a bare pass-through proxy with no ledger, built like the real one.

Same raw-ASGI style as :mod:`effectguard.ingress.server`, same upstream leg (httpx's
API over httpx-aiohttp's ``AiohttpTransport``), same uvicorn settings, same
``/{provider}/{path}`` routes; it only forwards. Whatever effectguard costs on
top of this is the cost of the guard and the ledger.

``python -m effectguard_bench.baseline --port N --upstream URL`` serves on
127.0.0.1 until SIGTERM (the bench polls it until it answers).
"""

from __future__ import annotations

import argparse
import importlib.util

import httpx

from effectguard.callpath.wire import strip_hop_by_hop
from effectguard.ingress.server import Receive, Scope, Send


class BareProxy:
    """``/{anything}/{path}`` forwarded to ``upstream + /{path}``, streamed back."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.inner: httpx.AsyncBaseTransport | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        from httpx_aiohttp import AiohttpTransport

        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
                self.inner = AiohttpTransport(limits=limits, trust_env=False)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.inner is not None:
                    await self.inner.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert self.inner is not None
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        _, _, rest = scope["path"].partition("/")
        _, _, upstream_path = rest.partition("/")
        headers = strip_hop_by_hop(httpx.Headers(scope["headers"]).multi_items())
        query = scope.get("query_string", b"")
        request = httpx.Request(
            scope["method"],
            httpx.URL(f"{self.upstream}/{upstream_path}", query=query or None),
            headers=headers,
            content=b"".join(chunks),
        )
        response = await self.inner.handle_async_request(request)
        out = [
            (k.encode("latin-1"), v.encode("latin-1"))
            for k, v in strip_hop_by_hop(response.headers.multi_items())
        ]
        length = response.headers.get("content-length")
        if length is not None:
            out.append((b"content-length", length.encode()))
        await send({"type": "http.response.start", "status": response.status_code, "headers": out})
        try:
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await response.aclose()


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def serve(upstream: str, host: str, port: int) -> None:
    """Run the bare proxy with the uvicorn settings ``effectguard serve`` uses."""
    import uvicorn

    config = uvicorn.Config(
        BareProxy(upstream),
        host=host,
        port=port,
        lifespan="on",
        log_level="warning",
        access_log=False,
        server_header=False,
        date_header=False,
        http="httptools" if _has("httptools") else "h11",
        loop="uvloop" if _has("uvloop") else "asyncio",
    )
    uvicorn.Server(config).run()


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``python -m effectguard_bench.baseline``."""
    parser = argparse.ArgumentParser(prog="baseline", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True, help="TCP port on 127.0.0.1")
    parser.add_argument("--upstream", required=True, help="base URL to forward to")
    args = parser.parse_args(argv)
    serve(args.upstream, "127.0.0.1", args.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
