"""One provider that never answers must not stop the calls to another through the same
in-process transport (docs/contract.md, "Connections to upstreams").

httpx's default transport pools 100 connections for every host it reaches and has no
bound per host: one provider that accepts connections and never answers held all of them,
and a call to any other provider waited for a free one until its pool timeout, unsent.
The default upstream leg keeps one pool per origin, so each gets its own 100.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest
from hostilekit import HostileSearch, Script, hostile_search
from transportkit import provider  # noqa: F401  (a fixture, used by name)

import effectguard
from effectguard.testing import FakeProvider

pytestmark = pytest.mark.slow

CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
MESSAGE = {
    "model": "claude-haiku-4-5",
    "max_tokens": 16,
    "messages": [{"role": "user", "content": "hi"}],
}
#: An upstream that reads the request and never answers.
SILENT = Script((b"",), ending="hang")
#: httpx's default ``max_connections``: the calls that fill the hung origin's pool.
POOL = 100
#: A bound on waiting for the hung calls to reach their upstream, not a timing claim.
REACH_BOUND_S = 60.0


def _until_all_reached(hung: HostileSearch) -> None:
    """Wait (bounded) until the hung provider holds all ``POOL`` calls."""
    for _ in range(int(REACH_BOUND_S / 0.05)):
        if hung.hits("/v1/chat/completions") >= POOL:
            break
        time.sleep(0.05)
    assert hung.hits("/v1/chat/completions") == POOL


#: httpx's default pool timeout (5 s); the read bounds the test.
OTHER_TIMEOUT = httpx.Timeout(5.0, read=15.0)


async def _call_past_a_hung_provider(
    ledger: Path, other: FakeProvider
) -> tuple[httpx.Response | Exception, list[object]]:
    """Fill the hung provider's pool, then call ``other``: its answer, and how the hung
    calls ended once their upstream went away."""
    with hostile_search() as hung:
        hung.follow(SILENT)
        transport = effectguard.AsyncGuardTransport(
            ledger=str(ledger), upstreams={"openai": hung.url, "anthropic": other.url}
        )
        # No caller timeout: the hung calls hold their connections until their upstream
        # goes away at the end of this block.
        client = httpx.AsyncClient(transport=transport, timeout=None)
        stuck = [
            asyncio.ensure_future(client.post(hung.url + "/v1/chat/completions", json=CHAT))
            for _ in range(POOL)
        ]
        await asyncio.get_running_loop().run_in_executor(None, _until_all_reached, hung)
        answer: httpx.Response | Exception
        try:
            answer = await client.post(
                other.url + "/v1/messages", json=MESSAGE, timeout=OTHER_TIMEOUT
            )
        except httpx.HTTPError as exc:
            answer = exc
    outcomes = await asyncio.gather(*stuck, return_exceptions=True)
    await client.aclose()
    return answer, outcomes


def test_a_hung_provider_cannot_take_every_connection_of_an_async_transport(
    tmp_path: Path,
    provider: FakeProvider,  # noqa: F811
) -> None:
    answer, outcomes = asyncio.run(_call_past_a_hung_provider(tmp_path / "ledger.db", provider))
    assert isinstance(answer, httpx.Response), repr(answer)
    assert answer.status_code == 200, answer.text
    assert len(outcomes) == POOL


def _sync_call_past_a_hung_provider(
    ledger: Path, other: FakeProvider
) -> tuple[httpx.Response | Exception, list[object]]:
    """:func:`_call_past_a_hung_provider` through a :class:`GuardTransport`: each hung
    call holds a thread of the transport's as well as a connection."""
    outcomes: list[object] = []

    def hang(client: httpx.Client, url: str) -> None:
        try:
            outcomes.append(client.post(url + "/v1/chat/completions", json=CHAT))
        except Exception as exc:
            outcomes.append(exc)

    with hostile_search() as hung:
        hung.follow(SILENT)
        transport = effectguard.GuardTransport(
            ledger=str(ledger), upstreams={"openai": hung.url, "anthropic": other.url}
        )
        client = httpx.Client(transport=transport, timeout=None)
        stuck = [threading.Thread(target=hang, args=(client, hung.url)) for _ in range(POOL)]
        for thread in stuck:
            thread.start()
        _until_all_reached(hung)
        answer: httpx.Response | Exception
        try:
            answer = client.post(other.url + "/v1/messages", json=MESSAGE, timeout=OTHER_TIMEOUT)
        except httpx.HTTPError as exc:
            answer = exc
    for thread in stuck:
        thread.join(REACH_BOUND_S)
    client.close()
    return answer, outcomes


def test_a_hung_provider_cannot_take_every_connection_or_thread_of_a_sync_transport(
    tmp_path: Path,
    provider: FakeProvider,  # noqa: F811
) -> None:
    answer, outcomes = _sync_call_past_a_hung_provider(tmp_path / "ledger.db", provider)
    assert isinstance(answer, httpx.Response), repr(answer)
    assert answer.status_code == 200, answer.text
    assert len(outcomes) == POOL
