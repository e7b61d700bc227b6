"""An upstream that answers more than any real answer: the call is effect unknown, and no
other call is hurt.

A billable answer is kept whole for the ledger, so before ``max_answer_bytes`` existed a
300 MB answer took the proxy to 1.5 GB of memory (and 300 MB into the ledger), and an
endless event stream was read until the process died, with every call in flight. Past
the limit the attempt is now interrupted: effect unknown, its reservation held, never
re-sent (docs/contract.md §3.4).

The in-process tests mock the upstream with respx; the proxy tests run a real upstream
that answers too much only when asked to, with good traffic alongside.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx
from conftest import FAST

from effectguard import AsyncGuardTransport
from effectguard.config.settings import GuardSettings, load_settings
from effectguard.errors import ConfigError
from effectguard.ledger import Ledger
from effectguard.rules.events import AttemptInterrupted
from effectguard.testing import running_proxy

URL = "https://api.openai.com/v1/chat/completions"
CHAT = "/openai/v1/chat/completions"
CALL_ID = "effectguard-call-id"
LIMIT = 64 * 1024
USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def chat(content: str = "hi", **extra: Any) -> dict[str, Any]:
    """An OpenAI chat completion request body."""
    return {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        **extra,
    }


def completion(text_bytes: int) -> bytes:
    """A chat completion whose whole JSON body is ``text_bytes`` long (padded content)."""
    shell = {"id": "c", "object": "chat.completion", "model": "gpt-4o-mini", "usage": USAGE}
    empty = {**shell, "choices": [{"index": 0, "message": {"content": ""}}]}
    pad = text_bytes - len(json.dumps(empty).encode())
    assert pad >= 0
    full = {**shell, "choices": [{"index": 0, "message": {"content": "x" * pad}}]}
    body = json.dumps(full).encode()
    assert len(body) == text_bytes
    return body


DELTA = b'data: {"choices":[{"index":0,"delta":{"content":"' + b"y" * 1000 + b'"}}]}\n\n'


class Endless(httpx.AsyncByteStream):
    """An event stream that never ends; counts what it was asked for."""

    def __init__(self) -> None:
        self.sent = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while True:
            self.sent += len(DELTA)
            yield DELTA
            await asyncio.sleep(0)


def small(limit: int = LIMIT) -> GuardSettings:
    return dataclasses.replace(FAST, max_answer_bytes=limit)


async def interrupted_reason(ledger: Ledger, call_id: str) -> str:
    events = [e.event for e in await ledger.events(call_id)]
    (interrupted,) = [e for e in events if isinstance(e, AttemptInterrupted)]
    return interrupted.reason


# -- in process ----------------------------------------------------------------------------


async def test_an_answer_over_the_limit_is_effect_unknown_and_held(
    make_transport: Callable[..., AsyncGuardTransport],
    finish: Callable[[AsyncGuardTransport], Awaitable[None]],
) -> None:
    transport = make_transport(settings=small())
    client = httpx.AsyncClient(transport=transport)
    with respx.mock(assert_all_called=True) as mock:
        route = mock.post(URL).respond(200, content=completion(LIMIT + 1))
        answer = await client.post(URL, json=chat())
    assert route.call_count == 1
    assert answer.status_code == 502
    error = answer.json()["error"]
    assert (error["type"], error["next_operation"]) == ("effect_unknown", "reconcile")
    assert "max_answer_bytes" in error["message"]
    call_id = answer.headers[CALL_ID]
    state = await transport.ledger.call(call_id)
    assert (state.stage, state.attempts, state.cost) == ("effect_unknown", 1, None)
    assert state.held == state.reserved_at_admission > 0
    reason = await interrupted_reason(transport.ledger, call_id)
    assert reason == f"the provider's 200 answer grew past max_answer_bytes ({LIMIT} bytes) " + (
        "and was not read further"
    )
    await finish(transport)


async def test_an_answer_of_exactly_the_limit_completes(
    make_transport: Callable[..., AsyncGuardTransport],
    finish: Callable[[AsyncGuardTransport], Awaitable[None]],
) -> None:
    transport = make_transport(settings=small())
    client = httpx.AsyncClient(transport=transport)
    body = completion(LIMIT)
    with respx.mock(assert_all_called=True) as mock:
        mock.post(URL).respond(200, content=body, headers={"content-type": "application/json"})
        answer = await client.post(URL, json=chat())
    assert answer.status_code == 200 and answer.content == body
    state = await transport.ledger.call(answer.headers[CALL_ID])
    assert state.stage == "completed" and state.cost is not None and state.held == 0
    await finish(transport)


async def test_an_endless_stream_is_broken_off_at_the_limit(
    make_transport: Callable[..., AsyncGuardTransport],
    finish: Callable[[AsyncGuardTransport], Awaitable[None]],
) -> None:
    transport = make_transport(settings=small())
    client = httpx.AsyncClient(transport=transport)
    endless = Endless()
    forwarded = 0
    with respx.mock(assert_all_called=True) as mock:
        mock.post(URL).respond(200, stream=endless, headers={"content-type": "text/event-stream"})
        async with client.stream("POST", URL, json=chat(stream=True)) as response:
            call_id = response.headers[CALL_ID]
            with pytest.raises(httpx.RemoteProtocolError, match="max_answer_bytes"):
                async for chunk in response.aiter_raw():
                    forwarded += len(chunk)
    assert forwarded <= LIMIT < endless.sent <= LIMIT + len(DELTA)
    state = await transport.ledger.call(call_id)
    assert (state.stage, state.cost) == ("effect_unknown", None)
    assert state.held == state.reserved_at_admission
    assert "max_answer_bytes" in await interrupted_reason(transport.ledger, call_id)
    await finish(transport)


async def test_an_endless_stream_its_client_left_is_not_read_forever(
    make_transport: Callable[..., AsyncGuardTransport],
    finish: Callable[[AsyncGuardTransport], Awaitable[None]],
) -> None:
    """A client that goes away leaves the stream to be read to its end and settled in the
    background (contract §3.8); an endless one ends at the limit, as effect unknown."""
    transport = make_transport(settings=small())
    client = httpx.AsyncClient(transport=transport)
    endless = Endless()
    with respx.mock(assert_all_called=True) as mock:
        mock.post(URL).respond(200, stream=endless, headers={"content-type": "text/event-stream"})
        async with client.stream("POST", URL, json=chat(stream=True)) as response:
            call_id = response.headers[CALL_ID]
            async for _ in response.aiter_raw():
                break
        for _ in range(500):
            if (await transport.ledger.call(call_id)).stage != "in_flight":
                break
            await asyncio.sleep(0.01)
    assert (await transport.ledger.call(call_id)).stage == "effect_unknown"
    assert LIMIT < endless.sent <= LIMIT + len(DELTA)
    await finish(transport)


def test_the_limit_is_read_from_the_guard_table(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text("[guard]\nmax_answer_bytes = 1048576\n")
    assert load_settings(config=config).guard.max_answer_bytes == 1 << 20
    assert load_settings().guard.max_answer_bytes == 64 * 1024 * 1024
    for bad in ("0", "-1", '"big"'):
        config.write_text(f"[guard]\nmax_answer_bytes = {bad}\n")
        with pytest.raises(ConfigError, match=r"guard\.max_answer_bytes"):
            load_settings(config=config)


# -- through a real proxy, with good traffic alongside --------------------------------------


class Oversized:
    """A real upstream: a request whose body holds ``"big"`` gets an endless answer (a
    JSON body, or an event stream if it asked for one); any other, a small completion."""

    def __init__(self) -> None:
        self.received = 0
        self.cut_off = 0  # endless answers the proxy stopped reading (the socket closed)
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0), backlog=128)
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"

    def __enter__(self) -> Oversized:
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while True:
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                head, _, data = data.partition(b"\r\n\r\n")
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                while len(data) < length:
                    data += conn.recv(65536)
                body, data = data[:length], data[length:]
                with self._lock:
                    self.received += 1
                if b"big" not in body:
                    answer = completion(300)
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\n\r\n%s" % (len(answer), answer)
                    )
                    continue
                stream = json.loads(body).get("stream", False)
                kind = b"text/event-stream" if stream else b"application/json"
                try:
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\n\r\n" % kind)
                    while True:  # close-delimited and endless
                        conn.sendall(DELTA * 16)
                except OSError:
                    with self._lock:
                        self.cut_off += 1
                return


@pytest.fixture
def oversized() -> Iterator[Oversized]:
    with Oversized() as upstream:
        yield upstream


@pytest.mark.slow
def test_endless_answers_are_cut_off_while_good_calls_complete(
    tmp_path: Path, oversized: Oversized
) -> None:
    config = tmp_path / "c.toml"
    config.write_text(f"[guard]\nmax_answer_bytes = {LIMIT}\n")
    ledger = tmp_path / "ledger.db"

    async def run(url: str) -> tuple[list[httpx.Response], list[tuple[str, str]]]:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:

            async def good(i: int) -> httpx.Response:
                return await client.post(CHAT, json=chat(f"good {i}"))

            async def big_stream() -> tuple[str, str]:
                async with client.stream("POST", CHAT, json=chat("big", stream=True)) as r:
                    try:
                        async for _ in r.aiter_raw():
                            pass
                    except httpx.RemoteProtocolError as exc:
                        return r.headers[CALL_ID], str(exc)
                    return r.headers[CALL_ID], "ended cleanly"

            goods = [good(i) for i in range(40)]
            bigs = [client.post(CHAT, json=chat("big")) for _ in range(3)]
            results = await asyncio.gather(*goods, *bigs, *(big_stream() for _ in range(3)))
            answers = [r for r in results if isinstance(r, httpx.Response)]
            streams = [r for r in results if isinstance(r, tuple)]
            return answers, streams

    with running_proxy(
        ledger, upstreams={"openai": oversized.url}, args=["--config", str(config)]
    ) as proxy:
        answers, streams = asyncio.run(run(proxy.url))
    statuses = sorted(a.status_code for a in answers)
    assert statuses == [200] * 40 + [502] * 3
    for answer in answers:
        if answer.status_code == 502:
            assert answer.json()["error"]["type"] == "effect_unknown"
    assert [why for _, why in streams] != ["ended cleanly"] * 3
    assert all("peer closed" in why or "incomplete" in why for _, why in streams), streams
    assert oversized.received == 46  # each sent once: nothing re-sent on a guess
    assert oversized.cut_off == 6

    async def stages() -> dict[str, int]:
        async with Ledger.open(str(ledger)) as opened:
            counts: dict[str, int] = {}
            for call in await opened.calls():
                counts[call.stage] = counts.get(call.stage, 0) + 1
            return counts

    assert asyncio.run(stages()) == {"completed": 40, "effect_unknown": 6}
