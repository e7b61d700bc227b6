"""The in-process benchmark: ``AsyncGuardTransport`` vs the plain transport it wraps.

Both clients use httpx's API over httpx-aiohttp's ``AiohttpTransport`` against
the same fake provider, in this process (pinned to the proxy CPU while it
runs), so the difference is what the guard and its ledger add to a call made
from application code. CPU per request includes the client's own work, in
both variants alike.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from effectguard_bench.loadgen import Load, request_body
from effectguard_bench.processes import Pinning, this_thread_on

VARIANTS = ("plain", "effectguard")
_WARM_UP_REQUESTS = 200
_WARM_UP_S = 1.0


@dataclass(frozen=True, slots=True)
class TransportSample:
    """One variant under one load."""

    scenario: str
    concurrency: int
    variant: str
    load: Load
    cpu_ms_per_request: float | None

    def to_json(self) -> dict[str, Any]:
        """The sample as a JSON-ready dict."""
        cpu = self.cpu_ms_per_request
        return {
            "scenario": self.scenario,
            "concurrency": self.concurrency,
            "variant": self.variant,
            **self.load.to_json(),
            "cpu_ms_per_request": None if cpu is None else round(cpu, 3),
        }


async def _drive(
    client: httpx.AsyncClient, url: str, body: bytes, concurrency: int, duration: float
) -> Load:
    latencies: list[float] = []
    ttfbs: list[float] = []
    errors = 0
    headers = {"content-type": "application/json"}

    async def worker(deadline: float) -> None:
        nonlocal errors
        while (started := time.perf_counter()) < deadline:
            ttfb = None
            async with client.stream("POST", url, content=body, headers=headers) as response:
                async for _ in response.aiter_bytes():
                    if ttfb is None:
                        ttfb = time.perf_counter() - started
            if response.status_code != 200:
                errors += 1
                continue
            latencies.append(time.perf_counter() - started)
            ttfbs.append(ttfb if ttfb is not None else latencies[-1])

    begin = time.perf_counter()
    await asyncio.gather(*(worker(begin + duration) for _ in range(concurrency)))
    elapsed = time.perf_counter() - begin
    return Load.from_samples("in-process", concurrency, latencies, ttfbs, errors, elapsed)


def _inner() -> httpx.AsyncBaseTransport:
    from httpx_aiohttp import AiohttpTransport

    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
    transport: httpx.AsyncBaseTransport = AiohttpTransport(limits=limits, trust_env=False)
    return transport


async def _bench(
    fake_url: str, concurrencies: Sequence[int], duration: float, ledger: Path
) -> list[TransportSample]:
    from effectguard.ingress.transport import AsyncGuardTransport

    url = fake_url + "/v1/chat/completions"
    guarded = AsyncGuardTransport(_inner(), ledger=str(ledger), upstreams={"openai": fake_url})
    clients = {
        "plain": httpx.AsyncClient(transport=_inner()),
        "effectguard": httpx.AsyncClient(transport=guarded),
    }
    samples: list[TransportSample] = []
    try:
        for scenario in ("plain", "stream"):
            body = request_body(scenario == "stream")
            for client in clients.values():
                deadline = time.perf_counter() + min(_WARM_UP_S, duration / 2)
                for _ in range(_WARM_UP_REQUESTS):
                    (await client.post(url, content=body)).raise_for_status()
                    if time.perf_counter() > deadline:
                        break
            for concurrency in concurrencies:
                for variant, client in clients.items():
                    cpu = time.process_time()
                    load = await _drive(client, url, body, concurrency, duration)
                    cpu = time.process_time() - cpu
                    per_request = cpu * 1000 / load.requests if load.requests else None
                    samples.append(
                        TransportSample(scenario, concurrency, variant, load, per_request)
                    )
    finally:
        for client in clients.values():
            await client.aclose()
    return samples


def run(
    fake_url: str, pins: Pinning, concurrencies: Sequence[int], duration: float, work: Path
) -> list[TransportSample]:
    """Both variants, plain and streaming, at every concurrency (this thread pinned meanwhile)."""
    with this_thread_on(pins.proxy):  # the ledger's writer thread inherits it
        return asyncio.run(_bench(fake_url, concurrencies, duration, work / "transport-ledger.db"))
