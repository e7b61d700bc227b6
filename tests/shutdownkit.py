"""Shutdown tests' tools: requests held in the proxy, the ledger's write lock held from
outside, what the proxy answered on a raw connection, and a guard's retry held until a
close cuts its call off."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sqlite3
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from edgekit import RawAnswer, address, parse_answer, read_until_closed
from observing import cli_json
from pgkit import DSN

import effectguard.config.defaults
from effectguard.callpath.dispatches import Dispatches
from effectguard.callpath.recorder import Recorder
from effectguard.errors import LedgerUnavailable
from effectguard.testing import Proxy

OPENAI_CHAT = "/openai/v1/chat/completions"
#: A bound on a hang (an exit, an answer), never a timing claim.
PATIENCE_S = 20.0


def chat(text: str) -> str:
    return json.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": text}]})


@contextlib.contextmanager
def write_lock(ledger: str) -> Iterator[Callable[[], None]]:
    """The write lock of ``ledger`` (SQLite's, or a PostgreSQL ledger's batch lock), held
    here until the block ends or the function it yields lets it go (from any thread)."""
    if "://" not in ledger:
        holder = sqlite3.connect(ledger, isolation_level=None, check_same_thread=False)
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


def request_under_way(proxy: Proxy, text: str, headers: str = "") -> socket.socket:
    """A chat request under way in the proxy: its headers taken and its body being read
    (the proxy's ``100 Continue`` says so), then its body sent. The drain waits for it."""
    body = chat(text).encode()
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


def answer_on(sock: socket.socket) -> tuple[int, str] | None:
    """The status and error type the proxy answered on ``sock`` (None: it closed first)."""
    answer = whole_answer_on(sock)
    if answer is None:
        return None
    return answer.status, answer.json()["error"]["type"] if answer.status != 200 else "ok"


def whole_answer_on(sock: socket.socket) -> RawAnswer | None:
    """What the proxy answered on ``sock`` (None: it closed first)."""
    with sock:
        data = read_until_closed(sock, PATIENCE_S)
    return parse_answer(data) if data else None


def refusing(proxy: Proxy) -> bool:
    """Whether the proxy's listener refuses connections: its drain has begun."""
    try:
        socket.create_connection(address(proxy.url), timeout=PATIENCE_S).close()
    except ConnectionRefusedError:
        return True
    return False


def settled_stages(ledger: str) -> Counter[str] | None:
    """The ledger's calls by stage, once none is in flight (else None)."""
    stages = Counter(c["stage"] for c in cli_json("calls", "--ledger", ledger))
    return None if stages["in_flight"] else stages


def retry_held_until_the_cut(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[threading.Event, threading.Event]:
    """A close that stops waiting after 1 s, and the guard's retry held as it starts until
    that close cuts its call off, then let commit: (the retry is starting, the cut is made)."""
    monkeypatch.setattr(effectguard.config.defaults, "DRAIN_TIMEOUT_S", 1.0)
    starting, cutting = threading.Event(), threading.Event()
    next_attempt, cut_off_all = Recorder.next_attempt, Dispatches.cut_off_all

    async def held(self: Recorder, prepared: Any, previous: Any) -> Any:
        starting.set()
        await asyncio.to_thread(cutting.wait, PATIENCE_S)
        return await next_attempt(self, prepared, previous)

    async def cut(self: Dispatches, reason: str) -> bool:
        cutting.set()
        return await cut_off_all(self, reason)

    monkeypatch.setattr(Recorder, "next_attempt", held)
    monkeypatch.setattr(Dispatches, "cut_off_all", cut)
    return starting, cutting


def closing_lets_the_lock_go(store: Any, ledger: str, release: Callable[[], None]) -> None:
    """Make ``store``'s close take no new write from then on (as once it has closed), then
    let the ledger's write lock go (``release``) and close: an admission queued long
    before commits as the ledger closes."""
    closing_store = store.close

    async def refused(*_: object) -> None:
        raise LedgerUnavailable(f"ledger {ledger} is not open")

    async def close() -> None:
        store.write = refused
        release()
        await closing_store()

    store.close = close
