"""A second SIGTERM or Ctrl-C during ``effectguard serve``'s drain (docs/operations.md,
"Shutting down: the SIGTERM drain"): the proxy stops at once, and nothing that had not
gone to the provider by then goes there afterwards.

Real processes throughout: the proxy, the fake provider (whose receipt log counts what
reached it) and this test, which holds the ledger's write lock (SQLite's, as a backup
tool does; PostgreSQL's batch lock, as a wedged replica does) to keep requests in their
admission. For those admissions to commit just as
the second signal arrives, the proxy is frozen (SIGSTOP), sent the signal, the lock is
let go, and the proxy let go (SIGCONT): the signal and the free lock then meet it at
the same instant, as they may on a loaded host.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import sqlite3
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from edgekit import address, parse_answer, read_until_closed
from observing import cli_json, wait_for
from pgkit import DSN, ledger_url

from effectguard.testing import FakeProvider, Proxy, fake_provider, running_proxy

OPENAI_CHAT = "/openai/v1/chat/completions"
#: A bound on a hang (an exit, an answer), never a timing claim.
PATIENCE_S = 20.0
#: The same for the sweep that takes over what the stopped proxy left (on PostgreSQL,
#: once its lease has expired).
SWEEP_PATIENCE_S = 90.0
#: Requests kept in their admission by the locked ledger when the second signal comes.
HELD = 3


def _chat(text: str) -> str:
    return json.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": text}]})


@pytest.fixture
def provider(tmp_path: Path) -> Iterator[FakeProvider]:
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        yield fake


_ = (ledger_url,)  # fixtures


@contextlib.contextmanager
def _write_lock(ledger: str) -> Iterator[Callable[[], None]]:
    """The write lock of ``ledger`` (SQLite's, or a PostgreSQL ledger's batch lock), held
    here until the block ends or the function it yields lets it go."""
    if "://" not in ledger:
        holder = sqlite3.connect(ledger, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")

        def release() -> None:
            holder.execute("ROLLBACK")

        try:
            yield release
        finally:
            if holder.in_transaction:
                holder.execute("ROLLBACK")
            holder.close()
        return
    import psycopg

    from effectguard.ledger.pgschema import lock_key

    schema = ledger.rpartition("schema=")[2]
    with psycopg.connect(DSN, options=f"-c search_path={schema}") as conn:
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock_key(conn, "batch"),))
        yield conn.rollback


def _request(proxy: Proxy, text: str, headers: str = "") -> socket.socket:
    """A chat request under way in the proxy: its headers taken and its body being read
    (the proxy's ``100 Continue`` says so), then its body sent. The drain waits for it."""
    body = _chat(text).encode()
    sock = socket.create_connection(address(proxy.url), timeout=PATIENCE_S)
    head = (
        f"POST {OPENAI_CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n{headers}"
        "Connection: close\r\n\r\n"
    )
    sock.sendall(head.encode())
    interim = b""
    while b"\r\n\r\n" not in interim:
        chunk = sock.recv(1)
        assert chunk, f"the proxy closed the connection: {interim!r}"
        interim += chunk
    assert interim.startswith(b"HTTP/1.1 100 "), interim
    sock.sendall(body)
    return sock


def _answer(sock: socket.socket) -> tuple[int, str] | None:
    """The status and error type the proxy answered on ``sock`` (None: it closed first)."""
    with sock:
        data = read_until_closed(sock, PATIENCE_S)
    if not data:
        return None
    answer = parse_answer(data)
    return answer.status, answer.json()["error"]["type"] if answer.status != 200 else "ok"


def _refusing(proxy: Proxy) -> bool:
    """Whether the proxy's listener refuses connections: its drain has begun."""
    try:
        socket.create_connection(address(proxy.url), timeout=PATIENCE_S).close()
    except ConnectionRefusedError:
        return True
    return False


def _stages(ledger: str) -> Counter[str] | None:
    """The ledger's calls by stage, once none is in flight (else None)."""
    stages = Counter(c["stage"] for c in cli_json("calls", "--ledger", ledger))
    return None if stages["in_flight"] else stages


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_nothing_reaches_the_provider_after_a_second_signal(
    ledger_url: str, provider: FakeProvider, second: signal.Signals, tmp_path: Path
) -> None:
    """A second SIGTERM (or a Ctrl-C) during the drain, just as requests held in their
    admission commit: none of them is sent. Each is answered 503 ``shutting_down`` and
    recorded ``not_sent``, or, cut off before that, left as a crash leaves it; the call
    still waiting for its provider is ``effect_unknown``; the exit status is 0, and the
    next start leaves no call in flight. (The second signal used to leave sending on:
    an admission committing before the process ended was sent, its effect begun after
    the proxy was told to stop at once. And on SQLite, a batch still waiting for the
    write lock as the loop's teardown cancelled it left a transaction open on the
    writer's connection: every later write failed, "cannot start a transaction within a
    transaction", and the call cut off was left unmarked, its client answered 503.)"""
    ledger = ledger_url
    upstreams = {"openai": provider.url}
    with running_proxy(ledger, upstreams=upstreams, log_path=tmp_path / "proxy.log") as proxy:
        waiting = _request(proxy, "slow", "x-fake-delay: 30\r\n")
        wait_for(lambda: len(provider.receipts()) == 1, PATIENCE_S, "the slow call's receipt")
        with _write_lock(ledger) as release:
            held = [_request(proxy, f"held {n}") for n in range(HELD)]
            proxy.kill(signal.SIGTERM)
            wait_for(lambda: _refusing(proxy), PATIENCE_S, "the drain to close the listener")
            with pytest.raises(httpx.ConnectError):  # a request arriving now is turned away
                httpx.post(proxy.url + OPENAI_CHAT, content=_chat("late"), timeout=PATIENCE_S)
            proxy.kill(signal.SIGSTOP)
            sent_before = provider.receipts()
            proxy.kill(second)
            release()
            proxy.kill(signal.SIGCONT)
            code = proxy.process.wait(PATIENCE_S)
        answers = [_answer(sock) for sock in held]
        cut_off = _answer(waiting)
        log = proxy.log()
    assert code == 0, log
    assert "stopped without draining (a second signal)" in log, log
    assert len(sent_before) == 1, sent_before
    assert provider.receipts() == sent_before, (answers, log)
    assert cut_off in (None, (504, "effect_unknown")), (cut_off, log)
    assert all(a in (None, (503, "shutting_down")) for a in answers), answers
    # The next start takes over what the stopped process could not mark.
    with running_proxy(ledger, upstreams=upstreams, log_path=tmp_path / "next.log"):
        stages = wait_for(lambda: _stages(ledger), SWEEP_PATIENCE_S, "no call in flight")
    assert stages["effect_unknown"] >= 1, stages  # the slow call, sent and never answered
    assert set(stages) <= {"effect_unknown", "not_sent"}, stages
    assert stages.total() <= 1 + HELD, stages
    assert provider.receipts() == sent_before
