"""One request straight into the proxy's ASGI app, with no server or socket between:
for tests of the upstream leg, where the front door is not what is tested."""

from __future__ import annotations

import asyncio
from typing import Any


async def asgi_call(
    app: Any, path: str, body: bytes, method: str = "POST"
) -> tuple[int, dict[bytes, bytes], bytes]:
    """One request through the ASGI app: its status, headers and whole body."""
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
    }
    messages: list[dict[str, Any]] = []
    received = False

    async def receive() -> dict[str, Any]:
        nonlocal received
        if received:
            await asyncio.Event().wait()
        received = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    await app(scope, receive, send)
    start = messages[0]
    content = b"".join(m.get("body", b"") for m in messages[1:])
    return start["status"], dict(start["headers"]), content
