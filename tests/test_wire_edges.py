"""The proxy's connections at their limits, with well-formed calls beside the bad ones.

Each test runs a real ``effectguard serve`` and the real fake provider. The hostile
side is raw sockets: hundreds of idle connections against the process's open-files
limit, a descriptor table filled to the brim while a call is admitted, a WebSocket
upgrade. The good side is ordinary httpx calls, counted on the fake provider's receipt
log: every one answered, each sent once.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from edgekit import address, read_until_closed
from observing import wait_for
from toolkit import cli_json

from effectguard.testing import FakeProvider, Proxy, fake_provider, running_proxy

pytestmark = pytest.mark.slow

CHAT = "/openai/v1/chat/completions"
CALL_ID = "effectguard-call-id"
PATIENCE_S = 30.0
#: Sets the open-files limit of every Python process started with it on PYTHONPATH,
#: from EFFECTGUARD_TEST_NOFILE ("SOFT:HARD"), before anything else runs: the proxy
#: then starts as it would under a system's low default.
SITECUSTOMIZE = """\
import os, resource
_limit = os.environ.get("EFFECTGUARD_TEST_NOFILE")
if _limit:
    _soft, _hard = map(int, _limit.split(":"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (_soft, _hard))
"""
LOW = 256


def chat(content: str = "hello") -> dict[str, Any]:
    """An OpenAI chat completion request body."""
    return {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": content}]}


@pytest.fixture
def provider(tmp_path: Path) -> Iterator[FakeProvider]:
    """The fake provider for one test."""
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        yield fake


@contextlib.contextmanager
def limited_proxy(
    tmp_path: Path, provider: FakeProvider, soft: int, hard: int, config: str = ""
) -> Iterator[Proxy]:
    """A proxy started with the open-files limit ``soft:hard``; idle connections wait
    a minute for their headers (so they stay for the whole test)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    (tmp_path / "config.toml").write_text("[server]\nheader_timeout_s = 60\n" + config)
    env = {"PYTHONPATH": path, "EFFECTGUARD_TEST_NOFILE": f"{soft}:{hard}"}
    with running_proxy(
        tmp_path / "ledger.db",
        upstreams={"openai": provider.url},
        args=["--config", str(tmp_path / "config.toml")],
        env=env,
    ) as proxy:
        yield proxy


def open_fds(proxy: Proxy) -> int:
    """How many descriptors the proxy process holds."""
    return len(os.listdir(f"/proc/{proxy.process.pid}/fd"))


def good_calls(proxy: Proxy, tags: list[str]) -> collections.Counter[object]:
    """One call per tag, 20 at a time, each on a connection of its own: their
    statuses (or the names of the errors that stopped them)."""

    def one(tag: str) -> object:
        try:
            with httpx.Client(timeout=PATIENCE_S) as client:
                return client.post(
                    proxy.url + CHAT, json=chat(tag), headers={"x-fake-tag": tag}
                ).status_code
        except httpx.HTTPError as exc:
            return type(exc).__name__

    with ThreadPoolExecutor(20) as pool:
        return collections.Counter(pool.map(one, tags))


def idle_connections(proxy: Proxy, count: int) -> list[socket.socket]:
    """``count`` connections that send nothing."""
    return [socket.create_connection(address(proxy.url), timeout=PATIENCE_S) for _ in range(count)]


def sent_once(provider: FakeProvider, tags: list[str]) -> bool:
    """Whether each tag reached the provider exactly once."""
    seen = collections.Counter(r.get("tag") for r in provider.receipts())
    return all(seen[tag] == 1 for tag in tags)


def test_good_calls_beside_hundreds_of_idle_connections_under_a_low_soft_file_limit(
    tmp_path: Path, provider: FakeProvider
) -> None:
    # A soft limit of 256 (hard 4096): 400 idle connections used to fill the table, and
    # then each new connection was accepted and closed at once, with no log line.
    with limited_proxy(tmp_path, provider, LOW, 4096) as proxy:
        assert good_calls(proxy, ["warm"]) == {200: 1}
        baseline = open_fds(proxy)
        idle = idle_connections(proxy, 400)
        try:
            tags = [f"beside-idle-{n}" for n in range(40)]
            assert good_calls(proxy, tags) == {200: len(tags)}
            assert sent_once(provider, tags)
        finally:
            for sock in idle:
                sock.close()
        wait_for(lambda: open_fds(proxy) <= baseline + 5, PATIENCE_S, "the idle fds to go")
        assert httpx.get(proxy.url + "/healthz", timeout=PATIENCE_S).status_code == 200


def test_a_hard_file_limit_below_what_max_connections_needs_is_warned_about(
    tmp_path: Path, provider: FakeProvider
) -> None:
    with limited_proxy(tmp_path, provider, LOW, LOW, "max_connections = 1024\n") as proxy:
        assert good_calls(proxy, ["under-the-limit"]) == {200: 1}
        log = proxy.log()
    assert "the open-files limit is 256, below the 2176 that max_connections = 1024" in log


def test_a_websocket_upgrade_is_served_as_plain_http(
    tmp_path: Path, provider: FakeProvider
) -> None:
    with running_proxy(tmp_path / "ledger.db", upstreams={"openai": provider.url}) as proxy:
        sock = socket.create_connection(address(proxy.url))
        with sock:
            sock.sendall(
                b"GET /healthz HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                b"Sec-WebSocket-Version: 13\r\n\r\n"
            )
            answer = read_until_closed(sock, 3)
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
        assert good_calls(proxy, ["after-upgrade"]) == {200: 1}
        log = proxy.log()
    assert " ERROR " not in log, log


def test_a_call_admitted_while_the_descriptor_table_is_full_is_never_effect_unknown(
    tmp_path: Path, provider: FakeProvider
) -> None:
    # The proxy's first call opened the upstream session's TLS trust store, a file: with
    # no descriptor free that raised, and the call (never sent) was booked effect_unknown.
    with limited_proxy(tmp_path, provider, 4096, 4096) as proxy:
        import resource

        resource.prlimit(proxy.process.pid, resource.RLIMIT_NOFILE, (LOW, LOW))
        caller = socket.create_connection(address(proxy.url))
        idle = idle_connections(proxy, LOW + 20)
        try:
            wait_for(lambda: open_fds(proxy) >= LOW - 1, PATIENCE_S, "the table to fill")
            body = json.dumps(chat("table-full")).encode()
            caller.sendall(
                b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Connection: close\r\nContent-Length: %d\r\n\r\n%s"
                % (CHAT.encode(), len(body), body)
            )
            answer = read_until_closed(caller, PATIENCE_S)
        finally:
            caller.close()
            for sock in idle:
                sock.close()
        assert answer.startswith(b"HTTP/1.1 502 "), answer[:300]
        call_id = answer.split(b"effectguard-call-id: ")[1].split(b"\r\n")[0].decode()
        (call,) = [
            c for c in cli_json("calls", "--ledger", proxy.ledger) if c["call_id"] == call_id
        ]
        assert call["stage"] == "not_sent", call
        assert provider.receipts() == []
