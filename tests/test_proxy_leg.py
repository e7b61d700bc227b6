"""The proxy's own path talks aiohttp directly (issue #17, step 3).

The proxy app, driven through ASGI in front of the real fake provider, answers a
plain and a streamed chat completion, recorded as calls, while building an
``httpx.Request`` or ``httpx.Response`` fails: no httpx object is made per request.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from effectguard.config.settings import load_settings
from effectguard.ingress.server import create_app
from effectguard.testing import fake_provider

CHAT = "/openai/v1/chat/completions"


def _body(stream: bool) -> bytes:
    body: dict[str, Any] = {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
    }
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


async def _call(app: Any, body: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
    """One POST through the ASGI app: its status, headers and whole body."""
    scope = {
        "type": "http",
        "method": "POST",
        "path": CHAT,
        "raw_path": CHAT.encode(),
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


def _forbidden(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("an httpx object was built on the proxy's path")


def test_the_proxy_path_builds_no_httpx_objects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        settings = load_settings(ledger=str(tmp_path / "ledger.db"), upstreams={"openai": fake.url})

        async def run() -> list[tuple[int, dict[bytes, bytes], bytes]]:
            app = create_app(settings)
            await app.startup()
            try:
                with monkeypatch.context() as patched:
                    patched.setattr(httpx.Request, "__init__", _forbidden)
                    patched.setattr(httpx.Response, "__init__", _forbidden)
                    return [await _call(app, _body(False)), await _call(app, _body(True))]
            finally:
                await app.shutdown()

        (status, headers, content), (s_status, s_headers, s_content) = asyncio.run(run())
    assert status == 200, content
    assert json.loads(content)["choices"]
    assert headers[b"effectguard-call-id"].startswith(b"call_")
    assert s_status == 200, s_content
    assert s_content.rstrip().endswith(b"data: [DONE]")
    assert s_headers[b"effectguard-call-id"] != headers[b"effectguard-call-id"]
