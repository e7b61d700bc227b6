# ruff: noqa: F811  (the provider fixture is imported by name and used as an argument)
"""A closed transport leaves no thread of its own behind (docs/contract.md §1.2): a
program that closed its transport and then forks must not hand the child a lock that one
of the transport's threads held (a child hung in OpenSSL's ``CRYPTO_THREAD_write_lock``
when ``close()`` returned with the portal's and the ledger's threads still running)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from transportkit import provider  # noqa: F401  (a fixture, used by name)

import effectguard
import effectguard.config.defaults
from effectguard.testing import FakeProvider

CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
PG_DSN = os.environ.get("EFFECTGUARD_TEST_PG_DSN")


def _ledgers(tmp_path: Path, name: str) -> list[str]:
    ledgers = [str(tmp_path / "ledger.db")]
    if PG_DSN:
        sep = "&" if "?" in PG_DSN else "?"
        ledgers.append(f"{PG_DSN}{sep}schema=closethreads_{name}_{os.getpid()}")
    return ledgers


def _left(before: set[threading.Thread]) -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t not in before)


def test_sync_close_ends_every_thread_it_started(tmp_path: Path, provider: FakeProvider) -> None:
    for ledger in _ledgers(tmp_path, "sync"):
        before = set(threading.enumerate())
        transport = effectguard.GuardTransport(ledger=ledger, upstreams={"openai": provider.url})
        with httpx.Client(transport=transport, base_url=provider.url) as client:
            for _ in range(3):
                assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
            # A stream abandoned after its first chunk: its read thread is the transport's.
            with client.stream("POST", "/v1/chat/completions", json=CHAT) as response:
                next(response.iter_bytes())
        assert _left(before) == [], ledger


def test_async_aclose_ends_every_thread_it_started(tmp_path: Path, provider: FakeProvider) -> None:
    async def use(ledger: str) -> list[str]:
        before = set(threading.enumerate())
        transport = effectguard.AsyncGuardTransport(
            ledger=ledger, upstreams={"openai": provider.url}
        )
        async with httpx.AsyncClient(transport=transport, base_url=provider.url) as client:
            for _ in range(3):
                response = await client.post("/v1/chat/completions", json=CHAT)
                assert response.status_code == 200
        return _left(before)

    for ledger in _ledgers(tmp_path, "async"):
        # asyncio.run's own default executor is not the transport's: made before.
        assert asyncio.run(use(ledger)) == [], ledger


class _Stalls(httpx.SyncByteStream):
    """An upstream stream that stalls after its first event until it is closed, and whose
    read then takes a moment to return (a TLS shutdown): the read outlives the close.
    The close drains the call for 30 s, then cancels the read's task (its thread goes
    on) and closes the inner transport, whose close ends the read."""

    def __init__(self) -> None:
        self.closed = threading.Event()

    def __iter__(self) -> Iterator[bytes]:
        yield b'data: {"id":"x","object":"chat.completion.chunk","choices":[]}\n\n'
        self.closed.wait(60)
        time.sleep(0.5)  # a bound on nothing: what the close must wait for

    def close(self) -> None:
        self.closed.set()


class _StallingInner(httpx.BaseTransport):
    """Its close ends the reads waiting on it, as closing a connection pool does."""

    def __init__(self) -> None:
        self.streams: list[_Stalls] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.streams.append(_Stalls())
        headers = {"content-type": "text/event-stream"}
        return httpx.Response(200, headers=headers, stream=self.streams[-1])

    def close(self) -> None:
        for stream in self.streams:
            stream.close()


def test_sync_close_waits_for_a_sync_inner_read_it_abandoned(
    tmp_path: Path, provider: FakeProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The close first waits this long for the call in flight (30 s by default).
    monkeypatch.setattr(effectguard.config.defaults, "DRAIN_TIMEOUT_S", 1.0)
    before = set(threading.enumerate())
    transport = effectguard.GuardTransport(
        ledger=str(tmp_path / "ledger.db"),
        upstreams={"openai": provider.url},
        inner=_StallingInner(),
    )
    with httpx.Client(transport=transport, base_url=provider.url) as client:
        body = {**CHAT, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            next(response.iter_bytes())  # then abandoned, its next read still waiting
    assert _left(before) == []


pytestmark = pytest.mark.slow
