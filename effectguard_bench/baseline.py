"""The baseline: a bare pass-through proxy with no ledger, built like the real one.

Same raw-ASGI style as :mod:`effectguard.ingress.server`, the same upstream leg
(:class:`effectguard.ingress.aioleg.AiohttpLeg`, aiohttp spoken directly), same
uvicorn settings, same ``/{provider}/{path}`` routes; it only forwards. Whatever
effectguard costs on top of this is the cost of the guard and the ledger.

``python -m effectguard_bench.baseline --port N --upstream URL`` serves on
127.0.0.1 until SIGTERM (the bench polls it until it answers).
"""

from __future__ import annotations

import argparse
import importlib.util

from effectguard.callpath.exchange import Outbound
from effectguard.callpath.wire import strip_hop_by_hop
from effectguard.config import defaults
from effectguard.ingress.aioleg import AiohttpLeg
from effectguard.ingress.server import Receive, Scope, Send


class BareProxy:
    """``/{anything}/{path}`` forwarded to ``upstream + /{path}``, streamed back."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.leg: AiohttpLeg | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.leg = AiohttpLeg(defaults.CONNECT_TIMEOUT_S, defaults.READ_TIMEOUT_S)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.leg is not None:
                    await self.leg.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert self.leg is not None
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
        query = scope.get("query_string", b"").decode("latin-1")
        url = f"{self.upstream}/{upstream_path}" + (f"?{query}" if query else "")
        headers = strip_hop_by_hop(scope["headers"])
        request = Outbound(
            scope["method"], url, upstream_path, upstream_path, headers, b"".join(chunks)
        )
        response = await self.leg.send(request)
        try:
            out = strip_hop_by_hop(response.headers)
            # Kept, as the real proxy keeps the length it knows: no chunked framing.
            out += [(k, v) for k, v in response.headers if k.lower() == b"content-length"]
            await send({"type": "http.response.start", "status": response.status, "headers": out})
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
