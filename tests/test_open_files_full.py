"""A proxy out of open files says so, and serves again once they come back.

Past the open-files limit the event loop (uvloop, through libuv) accepts each new
connection and closes it at once, in C: the client sees a close with no answer and
nothing was logged. A real ``effectguard serve`` is given a low limit (``prlimit``) and
filled with uploads under way, which are never closed to make room (idle connections are:
tests/test_open_files_room.py); the operator's warning must appear (once, however many
connections were turned away), and new connections must be served again once the uploads
close, each call sent once.
"""

from __future__ import annotations

import collections
import contextlib
import resource
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from edgekit import address, read_until_closed
from observing import wait_for

from effectguard.ingress.fdlimit import LimitReached
from effectguard.testing import FakeProvider, Proxy, fake_provider, running_proxy

pytestmark = pytest.mark.slow

CHAT = "/openai/v1/chat/completions"
PATIENCE_S = 30.0
LOW = 128
PROBE = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
REACHED = f"the open-files limit ({LOW}) is reached"


@pytest.fixture
def provider(tmp_path: Path) -> Iterator[FakeProvider]:
    """The fake provider for one test."""
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        yield fake


def chat(tag: str) -> dict[str, object]:
    """An OpenAI chat completion request body."""
    return {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": tag}]}


def turned_away(proxy: Proxy) -> bool:
    """Whether a new connection's request gets no answer at all."""
    with socket.create_connection(address(proxy.url), timeout=PATIENCE_S) as sock:
        try:
            sock.sendall(PROBE)
            return read_until_closed(sock, 2) == b""
        except OSError:  # reset
            return True


def served(proxy: Proxy) -> bool:
    """Whether a new connection's health probe is answered 200."""
    with socket.create_connection(address(proxy.url), timeout=PATIENCE_S) as sock:
        sock.sendall(PROBE)
        return read_until_closed(sock, PATIENCE_S).startswith(b"HTTP/1.1 200 ")


def uploading(proxy: Proxy) -> socket.socket:
    """A connection whose call's headers were sent and whose body is still to come."""
    sock = socket.create_connection(address(proxy.url), timeout=PATIENCE_S)
    with contextlib.suppress(OSError):  # turned away already, at the limit
        sock.sendall(
            b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{" % CHAT.encode()
        )
    return sock


def test_running_out_of_open_files_is_logged_and_the_proxy_recovers(
    tmp_path: Path, provider: FakeProvider
) -> None:
    with running_proxy(tmp_path / "ledger.db", upstreams={"openai": provider.url}) as proxy:
        assert httpx.post(proxy.url + CHAT, json=chat("before")).status_code == 200
        resource.prlimit(proxy.process.pid, resource.RLIMIT_NOFILE, (LOW, LOW))
        uploads: list[socket.socket] = []
        try:
            uploads += [uploading(proxy) for _ in range(LOW + 20)]
            wait_for(lambda: turned_away(proxy), PATIENCE_S, "a connection turned away")
            wait_for(lambda: REACHED in proxy.log(), PATIENCE_S, "the operator's warning")
            for _ in range(20):  # many more turned away: still one warning
                assert turned_away(proxy)
        finally:
            for sock in uploads:
                sock.close()
        wait_for(lambda: served(proxy), PATIENCE_S, "new connections to be served again")
        tags = [f"after-{n}" for n in range(5)]
        for tag in tags:
            answer = httpx.post(proxy.url + CHAT, json=chat(tag), headers={"x-fake-tag": tag})
            assert answer.status_code == 200
        wait_for(lambda: "open files are free again" in proxy.log(), PATIENCE_S, "the all-clear")
        log = proxy.log()
    assert log.count(REACHED) == 1, log
    assert "closed to make room" not in log, log
    assert " ERROR " not in log, log
    seen = collections.Counter(r.get("tag") for r in provider.receipts())
    assert all(seen[tag] == 1 for tag in tags)
    assert len(provider.receipts()) == len(tags) + 1  # no upload was sent


def test_the_warning_is_said_once_a_minute_while_the_limit_stays_reached() -> None:
    state = LimitReached()
    checks = [(0.0, False), (1.0, True), (2.0, True), (60.0, True), (61.0, True)]
    checks += [(62.0, True), (121.0, True), (122.0, False), (131.0, False), (132.0, False)]
    checks += [(133.0, False), (134.0, True)]
    said = [state.step(now, full) for now, full in checks]
    assert said[:7] == [None, "reached", None, None, "still", None, "still"]
    assert said[7:] == [None, None, "free", None, "reached"]


def test_files_freed_by_closing_idle_ones_are_not_free_until_they_stay_free() -> None:
    # Closing idle connections frees files a flood takes again: each turn was a warning
    # and an all-clear. Free means no check found the limit reached for FREE_AFTER_S.
    state = LimitReached()
    checks = [(1.0, True), (2.0, False), (3.0, True), (4.0, False), (8.0, False)]
    checks += [(13.0, False), (14.0, False), (15.0, True)]
    said = [state.step(now, full) for now, full in checks]
    assert said == ["reached", None, None, None, None, None, "free", "reached"]
