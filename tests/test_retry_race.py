"""A key-less SDK retry that comes the moment its call settles is not sent again.

The client times out (0.2 s) before the provider answers (0.3 s) and sends its declared
retry (``x-stainless-retry-count: 1``, no key) around the time the answer comes. The
proxy used to learn that the first client had gone only when it wrote that client's
answer, a few milliseconds after recording it: a retry admitted in between was new work,
and the provider was paid twice (found by the fault simulator with short client
timeouts: 4 of 52 such calls). The proxy now knows it when the connection is lost.

Timing decides whether a retry lands in that window, so a run sends waves of 40 such
calls, their retries spread over the 50 ms around the answer, until 80 of them had their
first try give up before the answer could exist (on a loaded machine the test's own loop
can give up late, on an answer already delivered: new work by the contract); every one
of those must reach the provider once. Counted with the provider's receipt log.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from effectguard.testing import fake_provider, running_proxy

pytestmark = pytest.mark.slow

CHAT = "/openai/v1/chat/completions"
CALLS_PER_WAVE = 40
#: Calls whose first try gave up in time, that a run must see; and the most waves it sends.
ENOUGH = 80
MOST_WAVES = 6
#: The provider's delay: an answer cannot exist before a call has waited this long.
ANSWER_S = 0.3


async def _timed_out_then_retried(
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient], url: str, body: bytes, offset_s: float
) -> bool:
    """One SDK call: the first try gives up at 0.2 s, the retry comes at 0.3 s + offset.
    True if the first try had given up (its connection closed) before the answer could
    exist; a loop held past that point gives up on an answer already delivered, which
    no server can tell from a delivery, and its retry is new work by the contract (§4)."""
    headers = {"content-type": "application/json", "x-fake-behaviour": f"delay={ANSWER_S}"}
    started = time.monotonic()
    with contextlib.suppress(httpx.TimeoutException):  # as the SDK's timeout ends it
        await clients[0].post(
            url, content=body, headers={**headers, "x-stainless-retry-count": "0"}
        )
    in_time = time.monotonic() - started < ANSWER_S
    await asyncio.sleep(max(0.0, started + ANSWER_S + offset_s - time.monotonic()))
    retry = await clients[1].post(
        url, content=body, headers={**headers, "x-stainless-retry-count": "1"}
    )
    assert retry.status_code == 200, retry.text
    return in_time


def _bodies(wave: int) -> list[bytes]:
    return [
        json.dumps(
            {
                "model": "gpt-4o-mini",
                "max_tokens": 3,
                "messages": [{"role": "user", "content": f"wave {wave} call {n}"}],
            }
        ).encode()
        for n in range(CALLS_PER_WAVE)
    ]


async def _wave(url: str, bodies: list[bytes], offsets: list[float]) -> list[bool]:
    # Both clients made before the calls start: making one takes the event loop for tens
    # of milliseconds (its TLS context), and a client whose loop was held past its timeout
    # gives up on an answer already delivered, which no server can tell from a delivery.
    limits = httpx.Limits(max_connections=len(bodies))
    async with (
        httpx.AsyncClient(timeout=httpx.Timeout(0.2, connect=5), limits=limits) as first,
        httpx.AsyncClient(timeout=15, limits=limits) as again,
    ):
        calls = [
            _timed_out_then_retried((first, again), url, b, o)
            for b, o in zip(bodies, offsets, strict=True)
        ]
        return await asyncio.wait_for(asyncio.gather(*calls), timeout=60)


async def _warm_up(url: str) -> None:
    """A wave's worth of calls answered at once: the proxy's upstream connections are open
    before the timed waves. A retry that comes before its first try is even recorded (a
    cold proxy on a loaded machine) is new work by the contract (§4): that is not the
    window this test aims at, the one around the answer."""
    body = {"model": "gpt-4o-mini", "max_tokens": 3, "messages": [{"role": "user", "content": ""}]}
    async with httpx.AsyncClient(timeout=30) as client:
        await asyncio.gather(
            *(client.post(url, json={**body, "n": 1, "user": f"warm-{n}"}) for n in range(8))
        )


def test_a_retry_that_comes_as_its_call_settles_is_not_sent_again(tmp_path: Path) -> None:
    bodies: list[bytes] = []  # those whose first try gave up in time
    late = 0
    with fake_provider(tmp_path / "receipts.jsonl") as provider:
        with running_proxy(tmp_path / "ledger.db", upstreams={"openai": provider.url}) as proxy:
            asyncio.run(_warm_up(proxy.url + CHAT))
            for wave in range(MOST_WAVES):
                wave_bodies = _bodies(wave)
                offsets = [-0.01 + 0.05 * n / CALLS_PER_WAVE for n in range(CALLS_PER_WAVE)]
                in_time = asyncio.run(_wave(proxy.url + CHAT, wave_bodies, offsets))
                bodies += [b for b, ok in zip(wave_bodies, in_time, strict=True) if ok]
                late += in_time.count(False)
                if len(bodies) >= ENOUGH:
                    break
        receipts = Counter(r["body_sha256"] for r in provider.receipts())
    assert len(bodies) >= ENOUGH, f"only {len(bodies)} first tries gave up in time ({late} late)"
    sent_twice = [b for b in bodies if receipts[hashlib.sha256(b).hexdigest()] != 1]
    assert not sent_twice, f"{len(sent_twice)} of {len(bodies)} calls reached the provider twice"
