"""``[server] max_connections`` against connections that send no request.

Each test runs a real ``effectguard serve`` (``max_connections = 16``) and the real fake
provider. The hostile side is raw sockets that connect and send nothing, or made one
request and sit idle, kept alive; the good side is ordinary calls, counted on the fake
provider's receipt log, beside a call in flight and an upload under way, which must
never be cut to make room.
"""

from __future__ import annotations

import collections
import contextlib
import json
import re
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from edgekit import address, read_until_closed

from effectguard.testing import FakeProvider, Proxy, fake_provider, running_proxy

pytestmark = pytest.mark.slow

CHAT = "/openai/v1/chat/completions"
PATIENCE_S = 30.0
CAP = 16
CLOSED = re.compile(
    r'^effectguard_connections_closed_for_room_total\{reason="max_connections"\} (\S+)$', re.M
)


def chat(content: str) -> bytes:
    """An OpenAI chat completion request body."""
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": content}]}
    return json.dumps(body).encode()


def head(body_length: int, extra: bytes = b"") -> bytes:
    """A chat call's request line and headers, for a body of ``body_length`` bytes."""
    return (
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%s"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n" % (CHAT.encode(), extra, body_length)
    )


@pytest.fixture
def provider(tmp_path: Path) -> Iterator[FakeProvider]:
    """The fake provider for one test."""
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        yield fake


@contextlib.contextmanager
def capped_proxy(tmp_path: Path, provider: FakeProvider) -> Iterator[Proxy]:
    """A proxy with ``max_connections = 16`` whose deadlines outlast the test: silent
    connections are closed by no timer, only to make room."""
    (tmp_path / "config.toml").write_text(
        f"[server]\nmax_connections = {CAP}\nheader_timeout_s = 120\n"
        "body_timeout_s = 120\nkeep_alive_timeout_s = 120\n"
    )
    with running_proxy(
        tmp_path / "ledger.db",
        upstreams={"openai": provider.url},
        args=["--config", str(tmp_path / "config.toml")],
    ) as proxy:
        yield proxy


def silent(proxy: Proxy, count: int) -> list[socket.socket]:
    """``count`` connections that send nothing."""
    return [socket.create_connection(address(proxy.url), timeout=PATIENCE_S) for _ in range(count)]


def kept_alive(proxy: Proxy, count: int) -> list[socket.socket]:
    """``count`` connections that made one request each and now sit idle, kept alive."""
    kept = silent(proxy, count)
    for sock in kept:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    for sock in kept:
        assert sock.recv(4096).startswith(b"HTTP/1.1 200 ")
    return kept


def good_calls(proxy: Proxy, tags: list[str], at_once: int) -> collections.Counter[object]:
    """One call per tag, ``at_once`` at a time, each on a connection of its own."""

    def one(tag: str) -> object:
        try:
            with httpx.Client(timeout=PATIENCE_S) as client:
                return client.post(
                    proxy.url + CHAT, content=chat(tag), headers={"x-fake-tag": tag}
                ).status_code
        except httpx.HTTPError as exc:
            return type(exc).__name__

    with ThreadPoolExecutor(at_once) as pool:
        return collections.Counter(pool.map(one, tags))


def test_silent_connections_at_the_cap_make_room_for_real_calls(
    tmp_path: Path, provider: FakeProvider
) -> None:
    # Open but silent connections counted toward max_connections until header_timeout_s
    # closed each: 16 of them from one client made every other client's call a plain
    # 503. The oldest of them is now closed to make room; calls under way never are.
    with capped_proxy(tmp_path, provider) as proxy:
        in_flight = socket.create_connection(address(proxy.url), timeout=PATIENCE_S)
        body = chat("in-flight")
        in_flight.sendall(
            head(len(body), b"x-fake-tag: in-flight\r\nx-fake-behaviour: delay=3\r\n") + body
        )
        uploading = socket.create_connection(address(proxy.url), timeout=PATIENCE_S)
        upload = chat("uploading")
        uploading.sendall(head(len(upload), b"x-fake-tag: uploading\r\n") + upload[:10])
        idle: list[socket.socket] = []
        tags: list[str] = []
        try:
            for round_ in range(3):  # the flood comes back after each round of calls
                idle += kept_alive(proxy, 4) + silent(proxy, CAP)
                batch = [f"beside-silent-{round_}-{n}" for n in range(6)]
                tags += batch
                assert good_calls(proxy, batch, 3) == {200: len(batch)}
            uploading.sendall(upload[10:])
            uploaded = read_until_closed(uploading, PATIENCE_S)
            flown = read_until_closed(in_flight, PATIENCE_S)
        finally:
            for sock in [in_flight, uploading, *idle]:
                sock.close()
        assert uploaded.startswith(b"HTTP/1.1 200 "), uploaded[:300]
        assert flown.startswith(b"HTTP/1.1 200 "), flown[:300]
        assert good_calls(proxy, ["after-the-flood"], 1) == {200: 1}
        metrics = httpx.get(proxy.url + "/metrics", timeout=PATIENCE_S).text
        log = proxy.log()
    seen = collections.Counter(r.get("tag") for r in provider.receipts())
    assert all(seen[tag] == 1 for tag in [*tags, "in-flight", "uploading", "after-the-flood"])
    assert " ERROR " not in log, log
    # Counted, and said once for the three rounds (at most a line a minute).
    closed = CLOSED.search(metrics)
    assert closed is not None and float(closed.group(1)) >= 3, metrics
    assert log.count("idle connections closed to make room (max_connections)") == 1, log
