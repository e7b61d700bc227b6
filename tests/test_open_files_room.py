"""Past the open-files limit, idle connections give way to new ones.

A silent flood larger than the proxy's open-files limit turned every new connection away
(uvloop accepts and closes each, in C) until the silent sockets closed: only a log line
said so. As nginx closes idle kept-alive connections when accept meets EMFILE, the proxy
now closes the connections idle longest, never one with a request in progress. A real
``effectguard serve`` is given a low limit (``prlimit``) and flooded, three times, while
the silent sockets stay open; new clients' calls must be served beside a call in flight
and an upload under way, each call sent once (the fake provider's receipts), and the
closing counted and logged.
"""

from __future__ import annotations

import collections
import json
import re
import resource
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from edgekit import address, read_until_closed
from observing import wait_for

from effectguard.testing import FakeProvider, Proxy, fake_provider, running_proxy

pytestmark = pytest.mark.slow

CHAT = "/openai/v1/chat/completions"
PATIENCE_S = 30.0
LOW = 128
PROBE = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
CLOSED = re.compile(
    r'^effectguard_connections_closed_for_room_total\{reason="open_files"\} (\S+)$', re.M
)


@pytest.fixture
def provider(tmp_path: Path) -> Iterator[FakeProvider]:
    """The fake provider for one test."""
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        yield fake


def chat(tag: str) -> bytes:
    """An OpenAI chat completion request body."""
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": tag}]}
    return json.dumps(body).encode()


def head(body_length: int, extra: bytes = b"") -> bytes:
    """A chat call's request line and headers, for a body of ``body_length`` bytes."""
    return (
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%s"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n" % (CHAT.encode(), extra, body_length)
    )


def served(proxy: Proxy) -> bool:
    """Whether a new connection's health probe is answered 200."""
    with socket.create_connection(address(proxy.url), timeout=PATIENCE_S) as sock:
        try:
            sock.sendall(PROBE)
        except OSError:  # closed unanswered by the loop, at the limit
            return False
        return read_until_closed(sock, PATIENCE_S).startswith(b"HTTP/1.1 200 ")


def good_call(proxy: Proxy, tag: str) -> int | str:
    """One call on a connection of its own: its status, or the error that ended it."""
    try:
        with httpx.Client(timeout=PATIENCE_S) as client:
            answer = client.post(proxy.url + CHAT, content=chat(tag), headers={"x-fake-tag": tag})
            return answer.status_code
    except httpx.HTTPError as exc:
        return type(exc).__name__


def test_past_the_open_files_limit_idle_connections_make_room(
    tmp_path: Path, provider: FakeProvider
) -> None:
    # Deadlines that outlast the test: the silent sockets are closed by no timer.
    (tmp_path / "config.toml").write_text(
        "[server]\nheader_timeout_s = 120\nbody_timeout_s = 120\nkeep_alive_timeout_s = 120\n"
    )
    with running_proxy(
        tmp_path / "ledger.db",
        upstreams={"openai": provider.url},
        args=["--config", str(tmp_path / "config.toml")],
    ) as proxy:
        assert good_call(proxy, "before") == 200
        in_flight = socket.create_connection(address(proxy.url), timeout=PATIENCE_S)
        body = chat("in-flight")
        in_flight.sendall(
            head(len(body), b"x-fake-tag: in-flight\r\nx-fake-behaviour: delay=3\r\n") + body
        )
        uploading = socket.create_connection(address(proxy.url), timeout=PATIENCE_S)
        upload = chat("uploading")
        uploading.sendall(head(len(upload), b"x-fake-tag: uploading\r\n") + upload[:10])
        resource.prlimit(proxy.process.pid, resource.RLIMIT_NOFILE, (LOW, LOW))
        silent: list[socket.socket] = []
        tags: list[str] = []
        try:
            for round_ in range(3):  # the flood comes back after each round of calls
                silent += [socket.create_connection(address(proxy.url)) for _ in range(LOW + 20)]
                wait_for(lambda: served(proxy), PATIENCE_S, "a new connection to be served")
                batch = [f"beside-flood-{round_}-{n}" for n in range(3)]
                tags += batch
                assert collections.Counter(good_call(proxy, tag) for tag in batch) == {200: 3}
            uploading.sendall(upload[10:])
            uploaded = read_until_closed(uploading, PATIENCE_S)
            flown = read_until_closed(in_flight, PATIENCE_S)
            metrics = httpx.get(proxy.url + "/metrics", timeout=PATIENCE_S).text
        finally:
            for sock in [in_flight, uploading, *silent]:
                sock.close()
        log = proxy.log()
    assert uploaded.startswith(b"HTTP/1.1 200 "), uploaded[:300]
    assert flown.startswith(b"HTTP/1.1 200 "), flown[:300]
    closed = CLOSED.search(metrics)
    assert closed is not None and float(closed.group(1)) >= 1, metrics
    assert "idle connections closed to make room (open_files)" in log, log
    assert " ERROR " not in log, log
    seen = collections.Counter(r.get("tag") for r in provider.receipts())
    assert all(seen[tag] == 1 for tag in [*tags, "before", "in-flight", "uploading"]), seen
