"""The proxy's own path talks aiohttp directly (issue #17, step 3).

The proxy app, driven through ASGI in front of the real fake provider, answers a
plain and a streamed chat completion, recorded as calls, while building an
``httpx.Request`` or ``httpx.Response`` fails: no httpx object is made per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from asgikit import asgi_call
from keepalivekit import chat_answer

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
                    return [
                        (await asgi_call(app, CHAT, _body(False))),
                        (await asgi_call(app, CHAT, _body(True))),
                    ]
            finally:
                await app.shutdown()

        (status, headers, content), (s_status, s_headers, s_content) = asyncio.run(run())
    assert status == 200, content
    assert json.loads(content)["choices"]
    assert headers[b"effectguard-call-id"].startswith(b"call_")
    assert s_status == 200, s_content
    assert s_content.rstrip().endswith(b"data: [DONE]")
    assert s_headers[b"effectguard-call-id"] != headers[b"effectguard-call-id"]


async def _drop_second_request(seen: list[bytes]) -> tuple[asyncio.Server, int]:
    """A server that answers the first request on a connection and, on the second, reads
    it whole and closes the connection without answering (a keep-alive race)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        answered = False
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                (
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                ),
                0,
            )
            body = await reader.readexactly(length)
            seen.append(head.split(b"\r\n")[0] + b" " + body)
            if answered:
                writer.close()
                return
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()
            answered = True

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@pytest.mark.parametrize("method", ["PUT", "DELETE", "POST"])
def test_the_leg_never_resends_a_request_by_itself(method: str) -> None:
    """A request lost on a reused keep-alive connection reaches the provider once and is
    reported as a failure whose effect is unknown: aiohttp's own retry of PUT and DELETE
    would send it a second time, unrecorded."""
    from effectguard.callpath.exchange import Outbound
    from effectguard.callpath.wire import classify_transport_error
    from effectguard.ingress.aioleg import AiohttpLeg

    async def run() -> tuple[list[bytes], BaseException | None]:
        seen: list[bytes] = []
        server, port = await _drop_second_request(seen)
        leg = AiohttpLeg(5.0, 5.0)
        failure: BaseException | None = None
        try:
            for n in range(2):
                url = f"http://127.0.0.1:{port}/charges/c{n}"
                request = Outbound(method, url, "/charges", "/charges", [], f"charge-{n}".encode())
                try:
                    response = await leg.send(request)
                    async for _ in response.aiter_raw():
                        pass
                    await response.aclose()
                except httpx.TransportError as exc:
                    failure = exc
        finally:
            await leg.aclose()
            server.close()
            await server.wait_closed()
        return seen, failure

    seen, failure = asyncio.run(run())
    assert [s.split(b" ")[0].decode() for s in seen] == [method, method], seen
    assert seen[1].endswith(b"charge-1")
    assert failure is not None
    assert classify_transport_error(failure) == "unknown"


def test_a_read_only_request_lost_on_a_stale_connection_is_sent_again(tmp_path: Path) -> None:
    """A read has no effect to lose: a GET that a kept-alive connection drops unanswered
    is sent once more on a fresh one (aiohttp's own resend is off for every request, and
    the guard resends only what is declared read-only), and the client gets its 200."""

    async def run() -> tuple[list[bytes], list[int]]:
        seen: list[bytes] = []
        server, port = await _drop_second_request(seen)
        upstreams = {"openai": f"http://127.0.0.1:{port}"}
        app = create_app(load_settings(ledger=str(tmp_path / "ledger.db"), upstreams=upstreams))
        await app.startup()
        try:
            statuses = [
                (await asgi_call(app, "/openai/v1/models", b"", "GET"))[0] for _ in range(2)
            ]
        finally:
            await app.shutdown()
            server.close()
            await server.wait_closed()
        return seen, statuses

    seen, statuses = asyncio.run(run())
    assert statuses == [200, 200]
    assert [s.split(b" ")[:2] for s in seen] == [[b"GET", b"/v1/models"]] * 3


async def _speak_unasked(seen: list[bytes]) -> tuple[asyncio.Server, int]:
    """A chat upstream that echoes each request's body in its answer and, once, writes a
    second, forged answer on the connection after the first one, while it sits idle."""
    forged = False

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal forged
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                body = await reader.readexactly(length)
                seen.append(body)
                writer.write(chat_answer(json.loads(body)["messages"][0]["content"]))
                await writer.drain()
                if not forged:
                    forged = True
                    await asyncio.sleep(0.05)
                    writer.write(chat_answer("FORGED"))
                    await writer.drain()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_an_answer_nobody_asked_for_is_never_taken_for_the_next_calls(tmp_path: Path) -> None:
    """An upstream that writes a second response on an idle kept-alive connection does not
    get it taken as the answer to the next call sent there (aiohttp queues it: #13656):
    that call's own request reaches the provider and its own answer comes back."""

    async def run() -> tuple[list[bytes], list[tuple[int, str]]]:
        seen: list[bytes] = []
        server, port = await _speak_unasked(seen)
        upstreams = {"openai": f"http://127.0.0.1:{port}"}
        app = create_app(load_settings(ledger=str(tmp_path / "ledger.db"), upstreams=upstreams))
        await app.startup()
        answers = []
        try:
            for n in range(3):
                body = json.dumps(
                    {
                        "model": "gpt-4o-mini",
                        "max_tokens": 8,
                        "messages": [{"role": "user", "content": f"call-{n}"}],
                    }
                ).encode()
                status, _, content = await asgi_call(app, CHAT, body)
                answers.append((status, json.loads(content)["choices"][0]["message"]["content"]))
                await asyncio.sleep(0.2)  # the forged answer arrives while the pool holds it
        finally:
            await app.shutdown()
            server.close()
            await server.wait_closed()
        return seen, answers

    seen, answers = asyncio.run(run())
    assert answers == [(200, "call-0"), (200, "call-1"), (200, "call-2")]
    assert [json.loads(b)["messages"][0]["content"] for b in seen] == ["call-0", "call-1", "call-2"]
