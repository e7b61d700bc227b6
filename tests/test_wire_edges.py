"""The proxy's connections at their limits, with well-formed calls beside the bad ones.

Each test runs a real ``effectguard serve`` and the real fake provider. The hostile
side is raw sockets: hundreds of idle connections against the process's open-files
limit, a descriptor table filled to the brim while a call is admitted, a WebSocket
upgrade, a client that pipelines and leaves, and a dozen hostile clients at once
(slowloris, a trickled body, framing tricks, half-closes, departures mid-upload and
mid-stream). The good side is ordinary httpx calls, counted on the fake provider's
receipt log: every one answered, each sent once; the proxy's descriptors return to
their baseline and nothing is logged as an ERROR.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import socket
import sqlite3
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from edgekit import address, read_until_closed
from observing import wait_for
from toolkit import cli_json

from effectguard.testing import FakeProvider, Proxy, fake_provider, free_port, running_proxy

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


def uploads_under_way(proxy: Proxy, count: int) -> list[socket.socket]:
    """``count`` connections whose request head was sent and whose body never ends: each
    has a request in progress, so it keeps its place at the cap."""
    uploads = idle_connections(proxy, count)
    for sock in uploads:
        sock.sendall(_request(b"{", length=100))
    return uploads


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


def _raw_answer(proxy: Proxy, request: bytes) -> bytes:
    """The answer to one raw ``request`` (sent with ``Connection: close``)."""
    with socket.create_connection(address(proxy.url), timeout=PATIENCE_S) as sock:
        sock.sendall(request)
        return read_until_closed(sock, PATIENCE_S)


def test_healthz_tells_the_truth_while_requests_under_way_fill_max_connections(
    tmp_path: Path, provider: FakeProvider
) -> None:
    # Requests under way (here uploads that have not ended) fill max_connections: a
    # flood of them made /healthz a plain 503, so a liveness probe restarted a proxy
    # whose ledger was fine. The probe is now let past the cap (a few at most). (Silent
    # connections filled it too, until they gave way to requests: test_front_door_cap.)
    def call(tag: str) -> bytes:
        body = json.dumps(chat(tag)).encode()
        return _raw_answer(
            proxy, _request(body, b"x-fake-tag: %s\r\nConnection: close\r\n" % tag.encode())
        )

    probe = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    routed = free_port()
    config = f"max_connections = 16\nprovider_ports = {{ openai = {routed} }}\n"
    with limited_proxy(tmp_path, provider, 4096, 4096, config) as proxy:
        assert good_calls(proxy, ["under-the-cap"]) == {200: 1}
        idle = uploads_under_way(proxy, 16)
        try:
            wait_for(
                lambda: call("at-the-cap").startswith(b"HTTP/1.1 503 "),
                PATIENCE_S,
                "the uploads to fill the cap",
            )
            healthz = _raw_answer(proxy, probe)
            assert healthz.startswith(b"HTTP/1.1 200 "), healthz[:300]
            assert json.loads(healthz.partition(b"\r\n\r\n")[2]) == {"ledger": "writable"}
            # Only GET /healthz passes; the cap still holds for everything else.
            refused = call("still-at-the-cap")
            assert refused.startswith(b"HTTP/1.1 503 "), refused[:300]
            assert b"content-type: text/plain" in refused.lower()
            other = _raw_answer(proxy, probe.replace(b"GET", b"POST"))
            assert other.startswith(b"HTTP/1.1 503 "), other[:300]
            # On a provider's own port /healthz is the provider's path: not let through.
            with socket.create_connection(("127.0.0.1", routed), timeout=PATIENCE_S) as sock:
                sock.sendall(probe)
                theirs = read_until_closed(sock, PATIENCE_S)
            assert theirs.startswith(b"HTTP/1.1 503 Service Unavailable"), theirs[:300]
        finally:
            for sock in idle:
                sock.close()
        wait_for(
            lambda: _raw_answer(proxy, probe.replace(b"GET", b"POST")).startswith(b"HTTP/1.1 200 "),
            PATIENCE_S,
            "the cap to free once the uploads are abandoned",
        )
        assert good_calls(proxy, ["after-the-flood"]) == {200: 1}
    tags = [r.get("tag") for r in provider.receipts()]
    assert "still-at-the-cap" not in tags


def test_probes_past_max_connections_are_bounded(tmp_path: Path, provider: FakeProvider) -> None:
    # Each probe past the cap is held in flight by the ledger's write lock, taken here
    # (the proxy waits for it, then answers 503 "unavailable"): of 12 sent at once, at
    # most 8 are let past the cap; the others get its plain 503 without waiting.
    probe = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    with limited_proxy(tmp_path, provider, 4096, 4096, "max_connections = 16\n") as proxy:
        idle = uploads_under_way(proxy, 16)
        lock = sqlite3.connect(proxy.ledger, isolation_level=None)
        probes: list[socket.socket] = []
        try:
            wait_for(
                lambda: _raw_answer(proxy, probe.replace(b"GET", b"POST")).startswith(
                    b"HTTP/1.1 503 Service Unavailable"
                ),
                PATIENCE_S,
                "the uploads to fill the cap",
            )
            lock.execute("BEGIN IMMEDIATE")
            probes += [socket.create_connection(address(proxy.url)) for _ in range(12)]
            for sock in probes:
                sock.sendall(probe)
            answers = [read_until_closed(sock, PATIENCE_S) for sock in probes]
        finally:
            lock.close()
            for sock in idle + probes:
                sock.close()
    past = [a for a in answers if b'"ledger"' in a]
    refused = [a for a in answers if a.endswith(b"\r\n\r\nService Unavailable")]
    assert len(past) + len(refused) == 12, answers
    assert 1 <= len(past) <= 8, answers


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


def _request(body: bytes, extra: bytes = b"", *, length: int | None = None) -> bytes:
    length = len(body) if length is None else length
    return (
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%s"
        b"Content-Length: %d\r\n\r\n%s" % (CHAT.encode(), extra, length, body)
    )


def _exchange(proxy: Proxy, data: bytes, *, shut: bool = False, keep: float = 5) -> bytes:
    with socket.create_connection(address(proxy.url), timeout=PATIENCE_S) as sock:
        sock.sendall(data)
        if shut:
            sock.shutdown(socket.SHUT_WR)
        return read_until_closed(sock, keep)


def _trickle(proxy: Proxy, head: bytes, drip: bytes) -> bytes:
    """Send ``head``, then ``drip`` a byte at a time until the proxy closes."""
    with socket.create_connection(address(proxy.url), timeout=PATIENCE_S) as sock:
        sock.sendall(head)
        try:
            for byte in drip:
                sock.sendall(bytes([byte]))
                if got := read_until_closed(sock, 0.2):
                    return got
        except OSError:
            pass
        return read_until_closed(sock, PATIENCE_S)


def _gone_mid_stream(proxy: Proxy) -> bytes:
    body = json.dumps({**chat("gone-mid-stream"), "stream": True}).encode()
    with socket.create_connection(address(proxy.url), timeout=PATIENCE_S) as sock:
        sock.sendall(_request(body, b"x-fake-behaviour: pad=2000000\r\n"))
        return sock.recv(4096)


def hostile_clients(proxy: Proxy) -> dict[str, Any]:
    """Each hostile client's name and what it got (its first line, or its bytes)."""
    body = json.dumps(chat("hostile")).encode()
    chunked = _request(b"", b"Transfer-Encoding: chunked\r\n", length=0).replace(
        b"Content-Length: 0\r\n", b""
    )
    clients: dict[str, Any] = {
        "slowloris": lambda: _trickle(proxy, b"POST ", b"/openai/v1/chat/completions" * 10),
        "trickled body": lambda: _trickle(proxy, _request(b"", length=5000), b"x" * 5000),
        "half closed": lambda: _exchange(proxy, _request(body), shut=True),
        "gone mid upload": lambda: _exchange(proxy, _request(body[:10], length=100_000), keep=0),
        "gone mid stream": lambda: _gone_mid_stream(proxy),
        "http/1.0": lambda: _exchange(proxy, _request(body).replace(b"HTTP/1.1", b"HTTP/1.0")),
        "pipelined": lambda: _exchange(
            proxy,
            _request(body) * 2 + b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        ),
        "expect 100": lambda: _exchange(proxy, _request(body, b"Expect: 100-continue\r\n")),
        "bad chunk size": lambda: _exchange(proxy, chunked + b"zz\r\n" + body + b"\r\n0\r\n\r\n"),
        "two lengths": lambda: _exchange(proxy, _request(body, b"Content-Length: 5\r\n")),
        "length and chunked": lambda: _exchange(
            proxy, _request(body, b"Transfer-Encoding: chunked\r\n")
        ),
        "1 MB header": lambda: _exchange(
            proxy, _request(body, b"X-Big: " + b"a" * 2**20 + b"\r\n")
        ),
    }
    with ThreadPoolExecutor(len(clients)) as pool:
        futures = {name: pool.submit(client) for name, client in clients.items()}
        return {name: future.result() for name, future in futures.items()}


def keep_alive_idle(proxy: Proxy, count: int) -> list[socket.socket]:
    """``count`` connections that made one request each and now sit idle, kept alive."""
    kept = idle_connections(proxy, count)
    for sock in kept:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    for sock in kept:
        assert sock.recv(4096).startswith(b"HTTP/1.1 200 ")
    return kept


def settled(proxy: Proxy) -> list[dict[str, Any]] | None:
    """The ledger's calls once none is still in flight (else None)."""
    calls: list[dict[str, Any]] = cli_json("calls", "--ledger", proxy.ledger, "--limit", "1000")
    return None if any(c["stage"] == "in_flight" for c in calls) else calls


def test_hostile_clients_beside_good_calls_leave_them_whole_and_the_proxy_as_it_was(
    tmp_path: Path, provider: FakeProvider
) -> None:
    (tmp_path / "config.toml").write_text("[server]\nheader_timeout_s = 1\nbody_timeout_s = 1\n")
    with running_proxy(
        tmp_path / "ledger.db",
        upstreams={"openai": provider.url},
        args=["--config", str(tmp_path / "config.toml")],
    ) as proxy:
        assert good_calls(proxy, ["warm"]) == {200: 1}
        baseline = open_fds(proxy)
        kept = keep_alive_idle(proxy, 300)
        tags = [f"beside-hostile-{n}" for n in range(40)]
        with ThreadPoolExecutor(2) as pool:
            hostile = pool.submit(hostile_clients, proxy)
            good = pool.submit(good_calls, proxy, tags)
            answers, goods = hostile.result(), good.result()
        for sock in kept:
            sock.close()
        assert goods == {200: len(tags)}
        assert sent_once(provider, tags)
        assert answers["slowloris"].startswith(b"HTTP/1.1 408 ")
        assert answers["trickled body"] == b""  # closed: nothing was admitted
        assert answers["http/1.0"].startswith(b"HTTP/1.1 200 ")
        assert answers["half closed"].startswith(b"HTTP/1.1 200 ")  # 2026-12-05: was b""
        assert answers["pipelined"].count(b"HTTP/1.1 200 ") == 3
        assert answers["expect 100"].startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 ")
        for framing in ("bad chunk size", "two lengths", "length and chunked"):
            assert answers[framing].startswith(b"HTTP/1.1 400 "), framing
        assert answers["1 MB header"].startswith(b"HTTP/1.1 431 ")
        # Whatever the hostile clients got admitted was sent once and settled, never
        # left unknown: those that went away were answered (or read) without them.
        calls = wait_for(lambda: settled(proxy), PATIENCE_S, "every call to settle")
        assert {c["stage"] for c in calls} == {"completed"}
        assert len(provider.receipts()) == len(calls)
        wait_for(lambda: open_fds(proxy) <= baseline + 5, PATIENCE_S, "the fds to go")
        assert httpx.get(proxy.url + "/healthz", timeout=PATIENCE_S).status_code == 200
        assert " ERROR " not in proxy.log()


def test_a_client_that_pipelines_two_calls_and_leaves_is_no_internal_error(
    tmp_path: Path, provider: FakeProvider
) -> None:
    # uvicorn marked only the queued request's answer as going nowhere: the running
    # one's write met the closed socket (uvloop raises), a 500 and two ERROR tracebacks.
    with running_proxy(tmp_path / "ledger.db", upstreams={"openai": provider.url}) as proxy:
        body = json.dumps(chat("pipelined-then-gone")).encode()
        with socket.create_connection(address(proxy.url), timeout=PATIENCE_S) as sock:
            sock.sendall(
                _request(body, b"x-fake-tag: first\r\nx-fake-behaviour: delay=2\r\n")
                + _request(body, b"x-fake-tag: second\r\n")
            )
            wait_for(lambda: provider.receipts(), PATIENCE_S, "the first call upstream")
        # Its close came after both requests were whole: for all the proxy can tell, a
        # half-close, so the first answer is written (access 200); the second, queued
        # behind it, is never served.
        wait_for(lambda: " event=access " in proxy.log(), PATIENCE_S, "the first's access line")
        calls = wait_for(lambda: settled(proxy), PATIENCE_S, "the call to settle")
        assert [c["stage"] for c in calls] == ["completed"]
        assert [r.get("tag") for r in provider.receipts()] == ["first"]
        assert good_calls(proxy, ["after-the-pipeline"]) == {200: 1}
        log = proxy.log()
    assert " ERROR " not in log, log
    assert "internal_error" not in log, log
