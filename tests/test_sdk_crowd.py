"""A crowd of SDK streaming clients through the proxy, some of them leaving part-way.

Hundreds of ``openai`` and ``anthropic`` async streams at once through ``effectguard
serve`` (a real process) to the fake provider: a third read to the end, a third stop after
the first chunk and close, a third are cancelled after the first chunk (their task, and
so their connection, dropped). The readers get their whole answer; once the proxy has
stopped, every call is settled (none left in flight), ``effectguard verify`` passes, and
the provider's receipt log counts exactly the attempts the ledger says were sent.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from effectguard.testing import fake_provider, running_proxy

pytestmark = pytest.mark.slow

CLIENTS = 150
#: Enough bytes that a stream is still under way when its reader leaves.
PAD = {"x-fake-behaviour": "pad=20000"}


def cli(ledger: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "effectguard", *args, "--ledger", str(ledger)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def _openai(oa: openai.AsyncOpenAI, i: int, first: asyncio.Event) -> str:
    stream = await oa.chat.completions.create(
        model="gpt-4o-mini",
        messages=[{"role": "user", "content": f"crowd {i}"}],
        max_tokens=16,
        stream=True,
        extra_headers=PAD,
    )
    text = ""
    async for chunk in stream:
        first.set()
        text += "".join(c.delta.content or "" for c in chunk.choices)
        if i % 3 == 1:
            await stream.close()
            return "closed"
        if i % 3 == 2:
            await asyncio.sleep(30)  # cancelled here
    return text


async def _anthropic(an: anthropic.AsyncAnthropic, i: int, first: asyncio.Event) -> str:
    async with an.messages.stream(
        model="claude-haiku-4-5",
        max_tokens=16,
        messages=[{"role": "user", "content": f"crowd {i}"}],
        extra_headers=PAD,
    ) as stream:
        async for _ in stream:
            first.set()
            if i % 3 == 1:
                return "closed"
            if i % 3 == 2:
                await asyncio.sleep(30)  # cancelled here
        return await stream.get_final_text()


async def _crowd(url: str) -> Counter[str]:
    limits = httpx.Limits(max_connections=CLIENTS * 2)
    async with httpx.AsyncClient(limits=limits, timeout=30) as http:
        oa = openai.AsyncOpenAI(base_url=url + "/openai/v1", api_key="k", http_client=http)
        an = anthropic.AsyncAnthropic(base_url=url + "/anthropic", api_key="k", max_retries=0)
        firsts = [asyncio.Event() for _ in range(CLIENTS)]
        tasks = [
            asyncio.create_task(
                (_openai if i % 2 else _anthropic)(oa if i % 2 else an, i, firsts[i])
            )  # type: ignore[arg-type]
            for i in range(CLIENTS)
        ]
        leaving = [(t, firsts[i]) for i, t in enumerate(tasks) if i % 3 == 2]
        await asyncio.wait_for(asyncio.gather(*(first.wait() for _, first in leaving)), 30)
        for task, _ in leaving:
            task.cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        await an.close()
    seen: Counter[str] = Counter()
    for i, result in enumerate(done):
        if i % 3 == 0:
            assert isinstance(result, str) and result.startswith("ok"), (i, result)
            seen["read"] += 1
        elif i % 3 == 1:
            assert result == "closed", (i, result)
            seen["closed"] += 1
        else:
            assert isinstance(result, asyncio.CancelledError), (i, result)
            seen["cancelled"] += 1
    return seen


def test_hundreds_of_sdk_streams_some_leaving_all_settle_and_match_the_receipts(
    tmp_path: Path,
) -> None:
    ledger = tmp_path / "ledger.db"
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        with running_proxy(ledger, upstreams={"openai": fake.url, "anthropic": fake.url}) as proxy:
            seen = asyncio.run(_crowd(proxy.url))
        receipts = fake.receipts()
    assert seen == {"read": CLIENTS // 3, "closed": CLIENTS // 3, "cancelled": CLIENTS // 3}
    listed = cli(ledger, "calls", "--json", "--limit", str(CLIENTS * 2))
    assert listed.returncode == 0, listed.stderr
    calls: list[dict[str, Any]] = json.loads(listed.stdout)
    assert len(calls) == CLIENTS
    assert Counter(c["stage"] for c in calls) == {"completed": CLIENTS}
    assert all(c["held_usd"] == "0.000000000" for c in calls)
    assert len(receipts) == sum(c["attempts"] for c in calls) == CLIENTS
    verified = cli(ledger, "verify")
    assert verified.returncode == 0, verified.stdout + verified.stderr
