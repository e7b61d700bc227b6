"""PostgreSQL faults under the writer, through a real ``effectguard serve``: a connection
lost around a batch's ``COMMIT`` (the ledger connection runs through a relay that can
cut it), an idle connection the server closed, a table another session locked.

When the connection is lost after ``COMMIT`` was sent, the transaction may or may not
have committed. The writer must find out, not guess: it reconnects and, once the lost
transaction can no longer be running (it waits for the batch lock), looks for the
batch's last event. Each case checks the client's answer, the provider's receipts
(each request sent once), the call's stage and ``verify``:

* the connection cut right after the admission's ``COMMIT`` reached the server (which
  committed it): the call was admitted, so it is sent and answered 200; before, the
  client was told 503 "not sent", while the call sat ``in_flight`` for ever and every
  resend of its key got 409 ``in_progress``;
* the same after the observation's ``COMMIT``: the answer was recorded, so 200; before,
  502 ``observe_failed`` for a call the ledger held as completed;
* the connection cut *instead of* sending the admission's ``COMMIT``: nothing committed,
  so the batch runs once more on a fresh connection, and the client gets 200;
* a connection the server closed while it sat idle: the next batch reconnects and runs;
* a ledger table locked by another session: 503 after the lock timeout, not a hang;
* every connection lost before a keyed resend of an ``effect_unknown`` call: the reader
  reads once more on a new connection, and the resend gets its 409, not a 500.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pgkit import DSN, NEEDS_PG, pg_url, server_port, shorter_waits, via

from effectguard.testing import FakeProvider, Proxy, fake_provider, running_proxy
from effectguard.testing.fakebehaviour import BEHAVIOUR_HEADER

_ = (pg_url,)  # fixtures

pytestmark = [*NEEDS_PG, pytest.mark.slow]

CHAT = "/openai/v1/chat/completions"


class Relay:
    """A TCP relay to PostgreSQL that can cut one connection at a batch's ``COMMIT``.

    :meth:`arm` names a marker (text the batch's writes carry, such as an event kind)
    and when to cut: ``after`` forwards the writes and their ``COMMIT`` and cuts once the
    server had time to commit them; ``instead`` cuts without forwarding them.
    :meth:`cut_idle` closes every connection now, as a server restart would.
    :meth:`stall` freezes the next connection that runs a given statement: from then on
    nothing passes it either way and it stays open, as a connection to a server that
    went silent (no reset, no answer) does; :meth:`release` lets what it held through.
    """

    def __init__(self, port: int) -> None:
        self._upstream = port
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._lock = threading.Lock()
        self._armed: tuple[bytes, str] | None = None
        self._sockets: list[socket.socket] = []
        self._admits: int | None = None  # new connections still let through (None: all)
        self._stall: bytes | None = None
        self._stall_whole = False
        self._frozen: list[_Freeze] = []
        self.cuts = 0
        self.stalls = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, marker: str, when: str) -> None:
        with self._lock:
            self._armed = (marker.encode(), when)

    def stall(self, marker: str, *, whole: bool = False) -> None:
        """Freeze the next connection that runs a statement whose text holds ``marker``
        (``whole``: is ``marker``), once the statement has reached the server (which runs
        it; its answer waits)."""
        with self._lock:
            self._stall = marker.encode()
            self._stall_whole = whole

    def release(self) -> None:
        """Pass on what the stalled connections held, and let them run again."""
        with self._lock:
            frozen, self._frozen = self._frozen, []
        for freeze in frozen:
            freeze.thaw()

    def admit_only(self, count: int | None) -> None:
        """Let only ``count`` more connections through (``None``: every one again)."""
        with self._lock:
            self._admits = count

    def cut_idle(self) -> None:
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            _close(sock)

    def close(self) -> None:
        self._server.close()
        self.cut_idle()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            with self._lock:
                refused = self._admits == 0
                if self._admits:
                    self._admits -= 1
            if refused:  # as a server that is down would
                _close(client)
                continue
            server = socket.create_connection(("127.0.0.1", self._upstream))
            with self._lock:
                self._sockets += [client, server]
            mute = threading.Event()  # set: the server's answers are no longer passed on
            frozen = _Freeze()  # while frozen nothing passes either way, nothing is closed
            for args in (
                (client, server, mute, frozen, True),
                (server, client, mute, frozen, False),
            ):
                threading.Thread(target=self._pump, args=args, daemon=True).start()

    def _pump(
        self,
        source: socket.socket,
        sink: socket.socket,
        mute: threading.Event,
        frozen: _Freeze,
        scan: bool,
    ) -> None:
        frontend, seen = _Frontend(), False
        try:
            while data := source.recv(65536):
                if mute.is_set():
                    break
                cut, stall = None, False
                for kind, raw in frontend.feed(data) if scan else ():
                    if kind == "query":
                        stall = stall or self._stalled(raw, frozen)
                    elif kind == "bind":
                        seen = seen or self._marked(raw)
                    elif seen:  # the COMMIT of the batch that wrote the marker
                        cut, seen = self._take(), False
                if frozen.hold(sink, data):
                    continue  # kept until released: the other side waits meanwhile
                if stall:  # the statement reaches the server; its answer is held
                    sink.sendall(data)
                    frozen.freeze()
                    continue
                if cut is not None:
                    mute.set()
                if cut == "instead":
                    break
                sink.sendall(data)
                if cut == "after":
                    mute.wait(0.3)  # the server commits meanwhile; its answer is lost
                    break
        except OSError:
            pass
        _close(source)
        _close(sink)

    def _marked(self, parameters: bytes) -> bool:
        with self._lock:
            return self._armed is not None and self._armed[0] in parameters

    def _stalled(self, query: bytes, freeze: _Freeze) -> bool:
        with self._lock:
            text = query.rstrip(b"\0")  # a simple query's text ends with a NUL
            if self._stall is None or self._stall not in text:
                return False
            if self._stall_whole and text.strip() != self._stall:
                return False
            self._stall = None
            self.stalls += 1
            self._frozen.append(freeze)
            return True

    def _take(self) -> str | None:
        """When to cut (the relay is disarmed then)."""
        with self._lock:
            if self._armed is None:
                return None
            when, self._armed = self._armed[1], None
            self.cuts += 1
            return when


class _Freeze:
    """One relayed connection's stall: while frozen, what either side sends is kept."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._frozen = False
        self._held: list[tuple[socket.socket, bytes]] = []

    def freeze(self) -> None:
        with self._lock:
            self._frozen = True

    def hold(self, sink: socket.socket, data: bytes) -> bool:
        """Keep ``data`` for ``sink`` if frozen (True), else leave it to the caller."""
        with self._lock:
            if self._frozen:
                self._held.append((sink, data))
            return self._frozen

    def thaw(self) -> None:
        with self._lock:
            self._frozen = False
            for sink, data in self._held:
                with contextlib.suppress(OSError):
                    sink.sendall(data)
            self._held = []


class _Frontend:
    """A client's PostgreSQL messages as they pass: each ``Bind`` (with its parameters)
    and each ``COMMIT``, sent as text or by the name psycopg prepared it under, and the
    text of each statement run (``query``): bound, prepared by name or not, or simple."""

    def __init__(self) -> None:
        self._buffer = b""
        self._started = False
        self._commits: set[bytes] = set()
        self._queries: dict[bytes, bytes] = {}

    def feed(self, data: bytes) -> list[tuple[str, bytes]]:
        self._buffer += data
        found: list[tuple[str, bytes]] = []
        while True:
            if len(self._buffer) < (5 if self._started else 8):
                return found
            if not self._started:  # SSLRequest or StartupMessage: no type byte
                size = int.from_bytes(self._buffer[:4], "big")
                if len(self._buffer) < size:
                    return found
                code = int.from_bytes(self._buffer[4:8], "big")
                self._started = code not in (80877103, 80877104)  # SSL, GSS requests
                self._buffer = self._buffer[size:]
                continue
            kind, size = self._buffer[:1], int.from_bytes(self._buffer[1:5], "big")
            if len(self._buffer) < 1 + size:
                return found
            body, self._buffer = self._buffer[5 : 1 + size], self._buffer[1 + size :]
            if kind == b"P":
                name, query = body.split(b"\0")[:2]
                self._queries[name] = query
                if query.strip().upper() == b"COMMIT":
                    self._commits.add(name)
                else:  # an unnamed statement is replaced by the next one
                    self._commits.discard(name)
            elif kind == b"Q":  # the simple protocol: a query's text, run at once
                found.append(("query", body))
            elif kind == b"B":
                statement = body.split(b"\0")[1]
                found.append(("query", self._queries.get(statement, b"")))
                found.append(("commit" if statement in self._commits else "bind", body))
        return found


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


@pytest.fixture
def relay() -> Iterator[Relay]:
    port = server_port()
    relayed = Relay(port)
    yield relayed
    relayed.close()


def _chat(key: str) -> tuple[dict[str, Any], dict[str, str]]:
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": key}], "max_tokens": 8}
    return body, {"idempotency-key": key}


def _ledger(url: str, *args: str) -> Any:
    result = subprocess.run(
        [sys.executable, "-m", "effectguard", *args, "--ledger", url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout) if "--json" in args else result.stdout


@pytest.fixture
def provider(tmp_path: Path) -> Iterator[FakeProvider]:
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        yield fake


@contextlib.contextmanager
def relayed_beside_a_sweeper(
    pg_url: str, relay: Relay, provider: FakeProvider, tmp_path: Path
) -> Iterator[tuple[Proxy, httpx.Client]]:
    """Two replicas of ``pg_url`` on a 2 s lease, each sweeping every 0.5 s: one reached
    through ``relay`` (its log ``a.log``), one direct (``b.log``). The first, and a client
    of it."""
    config = tmp_path / "lease.toml"
    config.write_text("[server]\nlease_s = 2\nheartbeat_s = 0.5\nsweep_s = 0.5\n")
    flags = ["--config", str(config)]
    upstreams = {"openai": provider.url}
    with (
        running_proxy(
            via(pg_url, relay.port), upstreams=upstreams, args=flags, log_path=tmp_path / "a.log"
        ) as relayed,
        running_proxy(pg_url, upstreams=upstreams, args=flags, log_path=tmp_path / "b.log"),
        httpx.Client(base_url=relayed.url, timeout=60) as client,
    ):
        yield relayed, client


@pytest.mark.parametrize(
    ("marker", "when"),
    [("lost-commit", "after"), ("attempt.observed", "after"), ("lost-commit", "instead")],
    ids=["admission-committed", "observation-committed", "admission-never-sent"],
)
def test_a_commit_whose_answer_is_lost_is_found_out_not_guessed(
    marker: str, when: str, pg_url: str, relay: Relay, provider: FakeProvider, tmp_path: Path
) -> None:
    url = via(pg_url, relay.port)
    log_path = tmp_path / "proxy.log"
    with running_proxy(url, upstreams={"openai": provider.url}, log_path=log_path) as proxy:
        client = httpx.Client(base_url=proxy.url, timeout=30)
        warm = client.post(CHAT, json=_chat("warm")[0], headers=_chat("warm")[1])
        assert warm.status_code == 200, warm.text
        relay.arm(marker, when)
        body, headers = _chat("lost-commit")
        first = client.post(CHAT, json=body, headers=headers)
        again = client.post(CHAT, json=body, headers=headers)
        client.close()
        log = proxy.log()
    assert relay.cuts == 1, log
    found = "had committed" if when == "after" else "had not committed"
    assert found in log, log
    assert first.status_code == 200, (first.text, log)
    assert again.status_code == 200 and again.headers["effectguard-replayed"] == "true"
    assert len(provider.effects()) == 2  # the warm-up and this call, each once
    calls = {c["call_id"]: c for c in _ledger(pg_url, "calls", "--json")}
    assert calls[first.headers["effectguard-call-id"]]["stage"] == "completed"
    budgets = {b["path"]: b for b in _ledger(pg_url, "budgets", "--json")}
    assert float(budgets["default"]["reserved_usd"]) == 0
    assert "ok" in _ledger(pg_url, "verify")


def test_a_connection_the_server_closed_while_idle_is_reopened(
    pg_url: str, relay: Relay, provider: FakeProvider, tmp_path: Path
) -> None:
    url = via(pg_url, relay.port)
    log_path = tmp_path / "proxy.log"
    with running_proxy(url, upstreams={"openai": provider.url}, log_path=log_path) as proxy:
        client = httpx.Client(base_url=proxy.url, timeout=30)
        answers = []
        for n in range(3):
            relay.cut_idle()
            body, headers = _chat(f"idle-{n}")
            answers.append(client.post(CHAT, json=body, headers=headers).status_code)
        client.close()
    assert answers == [200, 200, 200]
    assert len(provider.effects()) == 3
    assert "ok" in _ledger(pg_url, "verify")
    # psycopg warns of the lost connection (a Pipeline error ignored); the log must say
    # what came of it, or an operator reads a failure that did not happen.
    log = log_path.read_text()
    reconnected = "ledger writer reconnected: the server had closed its connection while idle"
    assert log.count(reconnected) == 3, log


def test_a_table_locked_by_another_session_is_503_not_a_hang(
    pg_url: str, provider: FakeProvider, tmp_path: Path
) -> None:
    """A ``LOCK TABLE`` left held by some other session (a forgotten transaction, a
    ``VACUUM FULL``): a call waits at most the lock timeout, then gets 503
    ``ledger_unavailable`` and is not sent; once the lock is gone, calls go through."""
    import psycopg

    schema = pg_url.rsplit("schema=", 1)[1]
    log_path = tmp_path / "proxy.log"
    with running_proxy(pg_url, upstreams={"openai": provider.url}, log_path=log_path) as proxy:
        client = httpx.Client(base_url=proxy.url, timeout=60)
        with psycopg.connect(DSN) as locker:  # one transaction, until the block ends
            locker.execute(f"LOCK TABLE {schema}.events IN ACCESS EXCLUSIVE MODE")
            body, headers = _chat("while-locked")
            locked = client.post(CHAT, json=body, headers=headers)
        body, headers = _chat("after-the-lock")
        after = client.post(CHAT, json=body, headers=headers)
        client.close()
    assert locked.status_code == 503, locked.text
    assert locked.json()["error"]["type"] == "ledger_unavailable"
    # The client is told what failed in one line, without PostgreSQL's quote of the SQL;
    # the whole text is in the proxy's log.
    message = locked.json()["error"]["message"]
    assert message.endswith("canceling statement due to lock timeout"), message
    assert "\n" not in message and "LINE" not in message and "SELECT" not in message
    logged = [line for line in log_path.read_text().splitlines() if "event=ledger_failed" in line]
    assert logged and "LINE 1:" in logged[0], logged
    assert after.status_code == 200, after.text
    assert len(provider.effects()) == 1  # only the call after the lock
    assert "ok" in _ledger(pg_url, "verify")


def test_a_resend_after_the_connections_were_lost_is_judged_not_a_500(
    pg_url: str, relay: Relay, provider: FakeProvider, tmp_path: Path
) -> None:
    """Every ledger connection lost (``pg_terminate_backend``, a failover) between a call
    that ended ``effect_unknown`` and a keyed resend of it: the resend is answered 409
    ``effect_unknown`` as always, and not sent. Before, the read that looks for evidence
    met the dead connection and the client got 500 ``internal_error`` with
    ``x-should-retry: false``."""
    url = via(pg_url, relay.port)
    with running_proxy(
        url, upstreams={"openai": provider.url}, log_path=tmp_path / "p.log"
    ) as proxy:
        client = httpx.Client(base_url=proxy.url, timeout=30)
        body, headers = _chat("lost-then-resent")
        first = client.post(CHAT, json=body, headers={**headers, BEHAVIOUR_HEADER: "drop"})
        relay.cut_idle()
        again = client.post(CHAT, json=body, headers=headers)
        client.close()
    assert first.status_code == 502, first.text
    assert again.status_code == 409, again.text
    assert again.json()["error"]["type"] == "effect_unknown"
    assert len(provider.effects()) == 1
    assert "ok" in _ledger(pg_url, "verify")


def test_a_resend_whose_evidence_cannot_be_read_is_503_not_sent(
    pg_url: str, relay: Relay, provider: FakeProvider, tmp_path: Path
) -> None:
    """The ledger reachable for the resend's admission but not for the read that looks
    for the earlier call's outcome (the database went away in between): 503
    ``ledger_unavailable`` with ``x-should-retry: true``, nothing sent. Before, 500
    ``internal_error`` with ``x-should-retry: false``, though nothing had been sent."""
    url = via(pg_url, relay.port)
    with running_proxy(
        url, upstreams={"openai": provider.url}, log_path=tmp_path / "p.log"
    ) as proxy:
        client = httpx.Client(base_url=proxy.url, timeout=30)
        body, headers = _chat("unreadable-evidence")
        first = client.post(CHAT, json=body, headers={**headers, BEHAVIOUR_HEADER: "drop"})
        relay.admit_only(1)  # the writer's new connection, and then none
        relay.cut_idle()
        again = client.post(CHAT, json=body, headers=headers)
        relay.admit_only(None)
        client.close()
    assert first.status_code == 502, first.text
    assert again.status_code == 503, again.text
    assert again.json()["error"]["type"] == "ledger_unavailable"
    assert again.headers["x-should-retry"] == "true"
    assert len(provider.effects()) == 1
    assert "ok" in _ledger(pg_url, "verify")


def test_a_key_revoked_while_the_key_read_hangs_is_not_accepted_for_ever(
    pg_url: str, relay: Relay, provider: FakeProvider, tmp_path: Path
) -> None:
    """The replica's read of the proxy keys hangs (its ledger connection went silent: no
    reset, no answer) while its writes go on. A key revoked meanwhile must stop spending:
    503 ``ledger_unavailable`` (x-should-retry: true, nothing sent) while the keys cannot
    be read, then 401 once a read on a new connection sees the revocation. Before, the
    refresh waited on the silent connection for ever and the replica kept admitting and
    sending the revoked key's calls."""
    _ledger(pg_url, "migrate")
    made = _ledger(pg_url, "key", "new", "--root", "team", "--json")
    auth = {"Authorization": f"Bearer {made['key']}"}
    log_path = tmp_path / "proxy.log"
    with running_proxy(
        via(pg_url, relay.port), upstreams={"openai": provider.url}, log_path=log_path
    ) as proxy:
        client = httpx.Client(base_url=proxy.url, timeout=30)
        body, _ = _chat("before")
        assert client.post(CHAT, json=body, headers=auth).status_code == 200
        relay.stall("'key.revoked') AND e.seq >")  # a refresh's read of the key events
        _wait(lambda: relay.stalls == 1, "the key refresh to reach the stalled connection")
        _ledger(pg_url, "key", "revoke", made["name"])
        answers: list[httpx.Response] = []

        def refused() -> bool:
            answers.append(client.post(CHAT, json=_chat("after")[0], headers=auth))
            return answers[-1].status_code == 401

        _wait(refused, "the revoked key to be refused 401")
        client.close()
        log = proxy.log()
    statuses = [a.status_code for a in answers]
    # A refresh under way when the revoke committed may still admit a call or two.
    assert set(statuses) <= {200, 503, 401}, statuses
    assert 503 in statuses, (statuses, log)
    unavailable = next(a for a in answers if a.status_code == 503)
    assert unavailable.json()["error"]["type"] == "ledger_unavailable"
    assert unavailable.headers["x-should-retry"] == "true"
    first_refusal = next(i for i, s in enumerate(statuses) if s != 200)
    assert 200 not in statuses[first_refusal:], statuses
    assert len(provider.effects()) == 1 + statuses.count(200)  # nothing refused was sent
    assert "proxy keys not refreshed" in log, log


def _wait(check: Callable[[], bool], what: str, bound_s: float = 60.0) -> None:
    """Poll ``check`` until it holds; fail after ``bound_s`` (a bound, not a timing)."""
    deadline = time.monotonic() + bound_s
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {bound_s} s: {what}")
        time.sleep(0.2)


def test_an_operators_limit_set_while_serve_seeds_the_config_is_kept(
    pg_url: str, relay: Relay, tmp_path: Path
) -> None:
    """``budget set`` commits while a starting ``serve`` is between reading who set which
    limit and writing the config's ``[budgets]``: the operator's limit wins (contract
    §5.4), now and at the next start. Before, ``serve`` wrote the file's limit over it
    from what it had read, and the next start took the path for the file's."""
    _ledger(pg_url, "migrate")
    config = tmp_path / "effectguard.toml"
    config.write_text('[budgets]\n"team" = "5"\n')
    args = ["--config", str(config)]
    relay.stall("'budget.limit_set'")  # serve's read of the limits already set
    with running_proxy(
        via(pg_url, relay.port), args=args, log_path=tmp_path / "first.log", wait=False
    ) as proxy:
        _wait(lambda: relay.stalls == 1, "serve to read the limits set")
        _ledger(pg_url, "budget", "set", "team", "--limit", "1")
        relay.release()
        _wait(lambda: _healthy(proxy.url), "serve to start")
    assert _limits(pg_url) == {"team": "1.000000000"}, proxy.log()
    with running_proxy(pg_url, args=args, log_path=tmp_path / "second.log") as again:
        pass
    assert _limits(pg_url) == {"team": "1.000000000"}, again.log()
    assert "budget 'team'" in again.log()  # the file and the operator disagree: warned


def _limits(url: str) -> dict[str, str]:
    return {n["path"]: n["limit_usd"] for n in _ledger(url, "budgets", "--json")}


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_dead_replicas_slots_are_freed_though_the_sweepers_read_hangs(
    pg_url: str, relay: Relay, provider: FakeProvider, tmp_path: Path
) -> None:
    """Two replicas, ``concurrency 2``: replica A holds both slots and is SIGKILLed while
    replica B's sweeper is waiting on a ledger read whose connection went silent. B gives
    that read up, reads again on a new connection, takes A over and frees the slots
    (contract §5.6). Before, B's sweeper waited for ever: every later request to the node
    was refused 429 ``concurrency`` for as long as the silence lasted."""
    from effectguard.ledger.queries import POSTGRES
    from effectguard.testing import start_proxy

    _ledger(pg_url, "migrate")
    _ledger(pg_url, "budget", "set", "team", "--concurrency", "2")
    body, _ = _chat("slot")
    team = {"Effectguard-Budget": "team"}
    upstreams = {"openai": provider.url}
    a = start_proxy(pg_url, upstreams=upstreams, log_path=tmp_path / "a.log")
    try:
        with running_proxy(
            via(pg_url, relay.port),
            upstreams=upstreams,
            log_path=tmp_path / "b.log",
            env=shorter_waits(tmp_path),
        ) as b:
            held = [
                threading.Thread(
                    target=_post_quietly, args=(a.url, body, {**team, "x-fake-delay": "300"})
                )
                for _ in range(2)
            ]
            for thread in held:
                thread.start()
            _wait(lambda: len(provider.effects()) == 2, "replica A to hold both slots")
            relay.stall(POSTGRES.live_workers, whole=True)  # B's sweeper's read
            _wait(lambda: relay.stalls == 1, "B's sweeper to wait on the silent connection")
            a.kill()
            answers: list[httpx.Response] = []

            def freed() -> bool:
                answers.append(httpx.post(b.url + CHAT, json=body, headers=team, timeout=30))
                return answers[-1].status_code == 200

            _wait(freed, "B to free the dead replica's slots", bound_s=240.0)
            log = b.log()
    finally:
        a.stop()
    refused = [r for r in answers if r.status_code != 200]
    assert all(r.status_code == 429 for r in refused), [r.text for r in refused]
    assert "ledger read got no answer" in log, log
    assert len(provider.effects()) == 3  # A's two calls, then B's one; nothing refused sent


def test_a_commit_whose_answer_never_comes_is_given_up_and_found_out(
    pg_url: str, relay: Relay, provider: FakeProvider, tmp_path: Path
) -> None:
    """The writer's connection goes silent (no reset, no answer) once a batch's events
    and ``COMMIT`` are sent: the writer gives the round trip up after ``WRITE_WAIT_S``,
    shuts the connection down and, on a new one, finds out whether the batch committed,
    so the call is answered 200 and sent once. Before, the writer waited for ever and
    every request of the replica with it."""
    from effectguard.ledger.pgdeadline import WRITE_WAIT_S

    # A lease that outlasts the silence, so this is about the writer alone: while
    # heartbeats queued in the writer, the default lease (15 s) lapsed meanwhile and the
    # rerun batch was refused 503 (a lapsed worker starts no new dispatch).
    config = tmp_path / "effectguard.toml"
    config.write_text(f"[server]\nlease_s = {WRITE_WAIT_S * 4:g}\n")
    log_path = tmp_path / "proxy.log"
    with running_proxy(
        via(pg_url, relay.port),
        upstreams={"openai": provider.url},
        args=["--config", str(config)],
        log_path=log_path,
        env=shorter_waits(tmp_path),
    ) as proxy:
        client = httpx.Client(base_url=proxy.url, timeout=WRITE_WAIT_S + 60)
        warm = client.post(CHAT, json=_chat("warm")[0], headers=_chat("warm")[1])
        assert warm.status_code == 200, warm.text
        relay.stall("INSERT INTO events")  # the next batch that writes events
        body, headers = _chat("silent-commit")
        first = client.post(CHAT, json=body, headers=headers)
        again = client.post(CHAT, json=body, headers=headers)
        client.close()
        log = proxy.log()
    assert relay.stalls == 1, log
    assert "ledger writer got no answer" in log, log
    assert "had committed" in log or "had not committed" in log, log  # found out, not guessed
    assert first.status_code == 200, (first.text, log)
    assert again.status_code == 200 and again.headers["effectguard-replayed"] == "true"
    assert len(provider.effects()) == 2  # the warm-up and this call, each once
    assert "ok" in _ledger(pg_url, "verify")


def _post_quietly(url: str, body: dict[str, Any], headers: dict[str, str]) -> None:
    """POST and ignore the outcome (the replica it went to is killed under it)."""
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(url + CHAT, json=body, headers=headers, timeout=600)


def _taken_over(url: str) -> list[Any]:
    """The ``worker.taken_over`` events of the ledger at ``url``."""
    import psycopg

    schema = url.rpartition("schema=")[2]
    with psycopg.connect(DSN) as conn:
        query = f"SELECT data FROM {schema}.events WHERE kind = 'worker.taken_over'"
        return [row[0] for row in conn.execute(query).fetchall()]


def test_a_writer_slow_to_commit_does_not_cost_the_replica_its_lease(
    pg_url: str, relay: Relay, provider: FakeProvider, tmp_path: Path
) -> None:
    """A replica's writer waits for a commit's answer (as behind a batch of large answers
    being recorded) for longer than the lease, while another replica sweeps. Before, the
    heartbeat queued behind that write, the lease lapsed and the other replica took the
    healthy replica over (``worker.taken_over``: its calls in flight ``effect_unknown``,
    their answers refused). Now the lease is renewed beside the writer and nothing is
    taken over; once the answer comes, the replica serves on, each call sent once."""
    with relayed_beside_a_sweeper(pg_url, relay, provider, tmp_path) as (busy, client):
        body, headers = _chat("warm")
        assert client.post(CHAT, json=body, headers=headers).status_code == 200
        relay.stall("COMMIT", whole=True)  # the next commit of the busy replica's writer
        _wait(lambda: relay.stalls == 1, "a commit of the busy replica's writer")
        # Three leases: the other replica's sweeper takes a lapsed lease over within one
        # lease and two sweeps. A bound to wait out, not a timing claim.
        deadline = time.monotonic() + 6.0
        while time.monotonic() < deadline and not _taken_over(pg_url):
            time.sleep(0.5)
        taken = _taken_over(pg_url)
        relay.release()
        assert not taken, f"the busy replica was taken over: {taken}\n{busy.log()}"
        body, headers = _chat("after")
        answer = client.post(CHAT, json=body, headers=headers)
        assert answer.status_code == 200, (answer.text, busy.log())
    assert len(provider.effects()) == 2
