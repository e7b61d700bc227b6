"""A client that closes its sending side after a whole request is answered.

HTTP lets a client half-close (``shutdown(SHUT_WR)``, as netcat, some curl options and
HTTP/1.0 clients do) once its request is sent, and then read the answer. The proxy used
to take the end of the client's data for its departure: the call was sent upstream, paid
and settled, and the client got nothing (access line 499). Each test runs a real
``effectguard serve`` in front of the real fake provider; the hostile side is raw
sockets, the good side ordinary httpx calls alongside, counted on the provider's
receipt log: every one answered, each sent once.
"""

from __future__ import annotations

import collections
import json
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from edgekit import address, parse_answer, read_until_closed
from observing import wait_for
from toolkit import cli_json

from effectguard.testing import FakeProvider, Proxy, fake_provider, running_proxy

CHAT = "/openai/v1/chat/completions"
CALL_ID = "effectguard-call-id"
PATIENCE_S = 20.0


def chat(content: str, **extra: Any) -> bytes:
    """An OpenAI chat completion request body."""
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": content}]}
    return json.dumps({**body, **extra}).encode()


def request(body: bytes, tag: str, extra: bytes = b"", *, length: int | None = None) -> bytes:
    """A raw POST of ``body`` (``length`` its declared length), tagged for the receipts."""
    return (
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"x-fake-tag: %s\r\n%sContent-Length: %d\r\n\r\n%s"
        % (CHAT.encode(), tag.encode(), extra, len(body) if length is None else length, body)
    )


def half_closed(proxy: Proxy, data: bytes) -> bytes:
    """Send ``data``, close the sending side, and read until the proxy closes."""
    with socket.create_connection(address(proxy.url), timeout=PATIENCE_S) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        return read_until_closed(sock, PATIENCE_S)


@pytest.fixture(scope="module")
def provider(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeProvider]:
    """The fake provider for the module."""
    with fake_provider(tmp_path_factory.mktemp("half") / "receipts.jsonl") as fake:
        yield fake


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory, provider: FakeProvider) -> Iterator[Proxy]:
    """A proxy with a short body deadline (a body cut short by a half-close ends there)."""
    tmp = tmp_path_factory.mktemp("half")
    (tmp / "config.toml").write_text("[server]\nheader_timeout_s = 2\nbody_timeout_s = 2\n")
    with running_proxy(
        tmp / "ledger.db",
        upstreams={"openai": provider.url},
        args=["--config", str(tmp / "config.toml")],
    ) as running:
        yield running


def good_calls(proxy: Proxy, tags: list[str]) -> collections.Counter[object]:
    """One httpx call per tag, 8 at a time: their statuses (or the errors' names)."""

    def one(tag: str) -> object:
        try:
            with httpx.Client(timeout=PATIENCE_S) as client:
                answer = client.post(
                    proxy.url + CHAT, content=chat(tag), headers={"x-fake-tag": tag}
                )
                return answer.status_code
        except httpx.HTTPError as exc:
            return type(exc).__name__

    with ThreadPoolExecutor(8) as pool:
        return collections.Counter(pool.map(one, tags))


def tags_seen(provider: FakeProvider) -> collections.Counter[object]:
    """How many times each tag reached the provider."""
    return collections.Counter(r.get("tag") for r in provider.receipts())


def beside_good_calls(
    proxy: Proxy, name: str, hostile: Callable[[], bytes]
) -> tuple[bytes, list[str]]:
    """Run ``hostile`` while 16 good calls go through; assert those whole. Returns what the
    hostile client got and the good calls' tags."""
    tags = [f"{name}-good-{n}" for n in range(16)]
    with ThreadPoolExecutor(2) as pool:
        got = pool.submit(hostile)
        good = pool.submit(good_calls, proxy, tags)
        answer, goods = got.result(), good.result()
    assert goods == {200: len(tags)}
    return answer, tags


def call_of(proxy: Proxy, call_id: str) -> dict[str, Any]:
    """The ledger's view of ``call_id``."""
    (call,) = [
        c
        for c in cli_json("calls", "--ledger", proxy.ledger, "--limit", "1000")
        if c["call_id"] == call_id
    ]
    return call


def access_status(proxy: Proxy, call_id: str) -> int:
    """The status on ``call_id``'s access line (waited for)."""
    line = wait_for(
        lambda: next((x for x in proxy.log().splitlines() if f"call_id={call_id} " in x), None),
        PATIENCE_S,
        f"{call_id}'s access line",
    )
    return int(line.split(" status=")[1].split()[0])


@pytest.mark.parametrize(
    ("name", "extra"),
    [
        ("at-once", b""),
        # The answer comes a second after the close: the close is long read by then.
        ("slow-provider", b"x-fake-behaviour: delay=1\r\n"),
    ],
)
def test_a_half_closing_client_gets_its_answer_and_the_call_is_sent_once(
    proxy: Proxy, provider: FakeProvider, name: str, extra: bytes
) -> None:
    tag = f"half-closed-{name}"
    got, tags = beside_good_calls(
        proxy, name, lambda: half_closed(proxy, request(chat(tag), tag, extra))
    )
    assert got.startswith(b"HTTP/1.1 200 "), f"no answer after a half-close: {got[:300]!r}"
    answer = parse_answer(got)
    assert answer.json()["object"] == "chat.completion"
    seen = tags_seen(provider)
    assert seen[tag] == 1
    assert all(seen[t] == 1 for t in tags)
    call = call_of(proxy, answer.headers[CALL_ID])
    assert (call["stage"], call["status"]) == ("completed", 200)
    # Logged as nginx logs a client that closed before its answer: a timed-out SDK's close
    # looks the same on the wire, and 200 would read as a delivery nobody can know of.
    assert access_status(proxy, answer.headers[CALL_ID]) == 499


def test_a_half_closing_client_gets_a_stream_whole(proxy: Proxy, provider: FakeProvider) -> None:
    tag = "half-closed-stream"
    got, _ = beside_good_calls(
        proxy, "stream", lambda: half_closed(proxy, request(chat(tag, stream=True), tag))
    )
    assert got.startswith(b"HTTP/1.1 200 "), f"no answer after a half-close: {got[:300]!r}"
    assert b"data: [DONE]" in got
    assert tags_seen(provider)[tag] == 1
    call_id = parse_answer(got).headers[CALL_ID]
    call = wait_for(
        lambda: (c := call_of(proxy, call_id))["stage"] != "in_flight" and c,
        PATIENCE_S,
        "the stream's call to settle",
    )
    assert call["stage"] == "completed"


def test_an_http10_client_that_half_closes_gets_its_answer(
    proxy: Proxy, provider: FakeProvider
) -> None:
    tag = "half-closed-http10"
    data = request(chat(tag), tag).replace(b"HTTP/1.1", b"HTTP/1.0")
    got, _ = beside_good_calls(proxy, "http10", lambda: half_closed(proxy, data))
    assert got.startswith(b"HTTP/1.1 200 "), f"no answer after a half-close: {got[:300]!r}"
    assert tags_seen(provider)[tag] == 1


def test_a_client_that_half_closes_mid_body_is_closed_and_nothing_is_sent(
    proxy: Proxy, provider: FakeProvider
) -> None:
    tag = "half-closed-mid-body"
    body = chat(tag)
    data = request(body[:10], tag, length=len(body) + 100)
    started = time.monotonic()
    got, _ = beside_good_calls(proxy, "mid-body", lambda: half_closed(proxy, data))
    # The request can never be whole: closed at once, not at the body deadline.
    assert got == b""
    assert time.monotonic() - started < PATIENCE_S
    assert tags_seen(provider)[tag] == 0


def test_a_half_closed_connection_is_closed_after_its_answer(
    proxy: Proxy, provider: FakeProvider
) -> None:
    # Keep-alive would wait for a next request that cannot come: the proxy closes.
    tag = "half-closed-then-closed"
    with socket.create_connection(address(proxy.url), timeout=PATIENCE_S) as sock:
        sock.sendall(request(chat(tag), tag))
        sock.shutdown(socket.SHUT_WR)
        started = time.monotonic()
        got = read_until_closed(sock, PATIENCE_S)
        assert time.monotonic() - started < PATIENCE_S - 1, "the connection was kept open"
    assert got.startswith(b"HTTP/1.1 200 ")
