# ruff: noqa: F811  (the provider fixture is imported by name and used as an argument)
"""A synchronous transport its program drops without closing, with the real openai SDK
and the fake provider (docs/contract.md §1.2): the pattern of a client made per request
(``OpenAI(http_client=httpx.Client(transport=GuardTransport(...)))`` in a handler) and
never closed.

Plain httpx loses nothing there: a dropped client's sockets close when it is collected.
A dropped ``GuardTransport`` kept its loop thread, the ledger's reader and lock threads,
its upstream threads, its SQLite connections and a live worker heartbeat for as long as
the process ran: about four threads and nine file descriptors for each one, until a
long-running program ran out of either.
"""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import openai
import pytest
from transportkit import provider, stages_of  # noqa: F401  (a fixture, used by name)

import effectguard
from effectguard.testing import FakeProvider

pytestmark = pytest.mark.slow

CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}

#: A bound on the background close, not a timing claim: it drains calls for at most 30 s.
CLOSE_BOUND_S = 40.0


def _effectguard_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("effectguard-")}


def _client(provider: FakeProvider, ledger: Path) -> openai.OpenAI:
    transport = effectguard.GuardTransport(ledger=str(ledger), upstreams={"openai": provider.url})
    http = httpx.Client(transport=transport)
    return openai.OpenAI(base_url=provider.url + "/v1", api_key="sk-test", http_client=http)


def _ask_and_drop(provider: FakeProvider, ledger: Path) -> None:
    """One call and one stream read part-way, through a client nobody closes."""
    client = _client(provider, ledger)
    client.chat.completions.create(**CHAT)
    stream = client.chat.completions.create(**CHAT, stream=True)
    next(iter(stream))


def test_a_sync_transport_dropped_unclosed_ends_its_threads(
    provider: FakeProvider, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Five clients made, used and dropped without a close: once collected, their
    transports close themselves in the background (the stream read part-way is read to
    its end and settled) and leave no thread behind."""
    ledger = tmp_path / "ledger.db"
    before = _effectguard_threads()
    for _ in range(5):
        _ask_and_drop(provider, ledger)
    gc.collect()
    deadline = time.monotonic() + CLOSE_BOUND_S
    while _effectguard_threads() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    left = sorted(t.name for t in _effectguard_threads() - before)
    assert left == [], f"threads of dropped transports still running: {left}"
    assert stages_of(capsys, ledger) == Counter(completed=10)
    assert len(provider.effects()) == 10


def test_a_stream_outliving_its_client_is_still_read_whole(
    provider: FakeProvider, tmp_path: Path
) -> None:
    """A raw httpx stream keeps its transport: dropping the client (not closing it) while
    the stream is read must not close the transport under the reader."""
    transport = effectguard.GuardTransport(
        ledger=str(tmp_path / "ledger.db"), upstreams={"openai": provider.url}
    )
    client = httpx.Client(transport=transport)
    request = client.build_request(
        "POST", provider.url + "/v1/chat/completions", json={**CHAT, "stream": True}
    )
    response = client.send(request, stream=True)
    del client, transport
    gc.collect()
    body = b"".join(response.iter_raw())
    assert body.rstrip().endswith(b"data: [DONE]")
    response.close()


def test_async_transports_dropped_unclosed_stop_while_their_loop_runs(
    provider: FakeProvider, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An async server that makes an ``AsyncOpenAI`` per request and never closes it: each
    dropped transport, once collected, stops its runtime on the loop that still runs (the
    stream read part-way is read to its end and settled), leaving no ledger thread and no
    file descriptor behind. Each kept its heartbeat, a ledger reader thread and about six
    descriptors until the loop ended, which for a server is never."""
    ledger = tmp_path / "ledger.db"

    async def ask_and_drop() -> None:
        transport = effectguard.AsyncGuardTransport(
            ledger=str(ledger), upstreams={"openai": provider.url}
        )
        client = openai.AsyncOpenAI(
            base_url=provider.url + "/v1",
            api_key="sk-test",
            http_client=httpx.AsyncClient(transport=transport),
        )
        await client.chat.completions.create(**CHAT)
        stream = await client.chat.completions.create(**CHAT, stream=True)
        await stream.__aiter__().__anext__()

    def descriptors() -> int:
        return len(os.listdir("/proc/self/fd"))

    async def run() -> tuple[list[str], int]:
        await ask_and_drop()  # the first one's imports and pools are not a leak
        gc.collect()
        await asyncio.sleep(0.5)
        before_threads, before_fds = _effectguard_threads(), descriptors()
        for _ in range(5):
            await ask_and_drop()
        deadline = time.monotonic() + CLOSE_BOUND_S
        while time.monotonic() < deadline:
            # Each SDK stream dropped part-way is closed by the loop's async-generator
            # hook, which resurrects it until that close has run: a later collection
            # takes it, as a busy server's collector soon would.
            gc.collect()
            left = _effectguard_threads() - before_threads
            if not left and descriptors() <= before_fds:
                break
            await asyncio.sleep(0.05)
        return sorted(t.name for t in left), descriptors() - before_fds

    left, more_fds = asyncio.run(run())
    assert left == [], f"threads of dropped transports still running: {left}"
    assert more_fds <= 0, f"{more_fds} more file descriptors open"
    assert stages_of(capsys, ledger) == Counter(completed=12)
    assert len(provider.effects()) == 12
