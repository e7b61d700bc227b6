"""A replica whose PostgreSQL path goes silent (no reset, no answer: a middlebox that
stopped forwarding, a database host that vanished), through a real ``effectguard serve``.

The replica's ledger connections run through a relay that can freeze: from then on it
forwards nothing either way on any connection, old or new, and closes none, so the
kernel never calls them dead. The writer used to wait on its connection for ever: every
request of the replica hung, heartbeats included. Now a round trip that gets no answer
for ``WRITE_WAIT_S`` is given up and the connection shut down, so requests are answered
503 ``ledger_unavailable`` (retry) and sent nowhere; once the relay carries new
connections again, the replica serves again, and nothing is paid twice.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pgkit import NEEDS_PG, pg_url, server_port, shorter_waits, via

from effectguard.ledger.daemonthreads import END_WAIT_S
from effectguard.ledger.pgdeadline import WRITE_WAIT_S
from effectguard.testing import FakeProvider, fake_provider, running_proxy, start_proxy

_ = (pg_url,)  # fixtures

pytestmark = [*NEEDS_PG, pytest.mark.slow]

CHAT = "/openai/v1/chat/completions"
#: The longest a request may wait while the path is silent: the writer's bound, one
#: reconnect's connect timeout (10 s) for the batch that met it and one for the next,
#: with room for a loaded machine. Without the bound the request never gets an answer.
ANSWER_BOUND_S = WRITE_WAIT_S + 2 * 10 + 30


class SilentRelay:
    """A TCP relay to PostgreSQL whose path can go silent.

    After :meth:`freeze`, every connection it carries, and every one made until
    :meth:`thaw`, passes nothing either way and is never closed: what either side sends
    is read (the kernel acknowledges it) and dropped. After :meth:`thaw`, new connections
    are carried again; the silent ones stay silent, as flows a vanished host or a
    middlebox forgot do. :meth:`close` closes everything.
    """

    def __init__(self, upstream: int) -> None:
        self._upstream = upstream
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._server.getsockname()[1]
        self._lock = threading.Lock()
        self._frozen = False
        self._silent: set[int] = set()  # ids of the flows that pass nothing
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def freeze(self) -> None:
        with self._lock:
            self._frozen = True
            self._silent.update(range(len(self._sockets) // 2))

    def thaw(self) -> None:
        with self._lock:
            self._frozen = False

    def close(self) -> None:
        self._server.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            with self._lock:
                frozen = self._frozen
            # While frozen a new connection reaches nothing: the client waits for the
            # server's first answer until its connect timeout.
            server = socket.socket() if frozen else self._connect()
            with self._lock:
                flow = len(self._sockets) // 2
                self._sockets += [client, server]
                if self._frozen:
                    self._silent.add(flow)
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(flow, source, sink), daemon=True).start()

    def _connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self._upstream))

    def _pump(self, flow: int, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                with self._lock:
                    silent = flow in self._silent
                if not silent:
                    sink.sendall(data)
        except OSError:
            pass
        with self._lock:
            if flow in self._silent:
                return  # a silent path carries no FIN either
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def relay() -> Iterator[SilentRelay]:
    port = server_port()
    relayed = SilentRelay(port)
    yield relayed
    relayed.close()


@pytest.fixture
def provider(tmp_path: Path) -> Iterator[FakeProvider]:
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        yield fake


def _post(base: str, key: str, timeout: float) -> httpx.Response:
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": key}], "max_tokens": 8}
    return httpx.post(base + CHAT, json=body, headers={"idempotency-key": key}, timeout=timeout)


def test_a_silent_writer_connection_answers_503_then_serves_again(
    pg_url: str, relay: SilentRelay, provider: FakeProvider, tmp_path: Path
) -> None:
    """Requests to a replica whose ledger path went silent are answered 503
    ``ledger_unavailable`` (x-should-retry: true) within a bound and not sent; once new
    connections get through, the same keys are served, each paid once."""
    log_path = tmp_path / "proxy.log"
    with running_proxy(
        via(pg_url, relay.port),
        upstreams={"openai": provider.url},
        log_path=log_path,
        env=shorter_waits(tmp_path),
    ) as proxy:
        assert _post(proxy.url, "warm", 30).status_code == 200
        relay.freeze()
        answers: dict[str, httpx.Response | BaseException] = {}

        def ask(key: str) -> None:
            try:
                answers[key] = _post(proxy.url, key, ANSWER_BOUND_S)
            except httpx.HTTPError as exc:  # the hang: no answer within the bound
                answers[key] = exc

        askers = [threading.Thread(target=ask, args=(k,)) for k in ("silent-a", "silent-b")]
        started = time.monotonic()
        for asker in askers:
            asker.start()
        for asker in askers:
            asker.join()
        waited = time.monotonic() - started
        for key, answer in answers.items():  # checked before the thaw: a hang fails here
            assert isinstance(answer, httpx.Response), (key, answer, waited, proxy.log())
            assert answer.status_code == 503, (key, answer.text)
            assert answer.json()["error"]["type"] == "ledger_unavailable"
            assert answer.headers["x-should-retry"] == "true"
        relay.thaw()
        served = _served_again(proxy.url, "silent-a")
        replayed = _post(proxy.url, "silent-a", 30)
        log = proxy.log()
    assert "ledger writer got no answer" in log, log
    assert served.status_code == 200, (served.text, log)
    assert replayed.status_code == 200 and replayed.headers["effectguard-replayed"] == "true"
    assert len(provider.effects()) == 2  # the warm-up and silent-a, each once
    assert "ok" in _verify(pg_url)


def _served_again(base: str, key: str, bound_s: float = 180.0) -> httpx.Response:
    """Resend ``key`` until it is answered 200 (the replica may need a heartbeat or a
    read on a new connection first, and answers 503 meanwhile); fail after ``bound_s``."""
    deadline = time.monotonic() + bound_s
    while True:
        answer = _post(base, key, ANSWER_BOUND_S)
        if answer.status_code != 503 or time.monotonic() > deadline:
            return answer
        time.sleep(1)


def _verify(url: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "effectguard", "verify", "--ledger", url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_serve_stops_within_its_bound_when_the_ledger_path_goes_silent(
    pg_url: str, relay: SilentRelay, provider: FakeProvider, tmp_path: Path
) -> None:
    """SIGTERM while the ledger's path is silent, a request waiting in its admission:
    ``serve`` exits within its drain bound (twice ``drain_timeout_s``, the 5 s waits for
    markings and admissions, and the close's 10 s wait for the writer thread). Before,
    closing the ledger joined the writer thread with no bound: it waited for the silent
    round trip to be given up (30 s) and for reconnects to fail, past any orchestrator's
    stop timeout, and an orchestrator had to SIGKILL it."""
    drain_s = 1.0
    config = tmp_path / "drain.toml"
    config.write_text(f"[server]\ndrain_timeout_s = {drain_s:g}\n")
    bound_s = 2 * drain_s + 15 + END_WAIT_S + 10  # the documented bound, and a margin
    proxy = start_proxy(
        via(pg_url, relay.port),
        upstreams={"openai": provider.url},
        args=["--config", str(config)],
        log_path=tmp_path / "proxy.log",
    )
    try:
        assert _post(proxy.url, "warm", 30).status_code == 200
        relay.freeze()
        asker = threading.Thread(target=_ask_quietly, args=(proxy.url, "stuck"), daemon=True)
        asker.start()
        asker.join(1.0)  # in its admission, on the silent path (or just about to be)
        proxy.kill(signal.SIGTERM)
        try:
            code = proxy.process.wait(timeout=bound_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"serve had not exited {bound_s:g} s after SIGTERM:\n{proxy.log()}")
    finally:
        proxy.kill()
        proxy.process.wait(timeout=30)
    assert code == 0, proxy.log()
    assert len(provider.effects()) == 1  # the warm-up; the stuck request was never sent


def _ask_quietly(base: str, key: str) -> None:
    with contextlib.suppress(httpx.HTTPError):
        _post(base, key, ANSWER_BOUND_S)
