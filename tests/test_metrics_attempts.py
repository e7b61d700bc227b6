"""Every attempt sent upstream is timed, whatever its ending (docs/metrics.md).

``effectguard_upstream_duration_seconds`` once left out every attempt that got no
answer the guard settled: a timeout (504), a reset or refused connection (502), a
broken stream, an answer it could not read. The latency panel and any alert on it then
showed only the upstream's good moments, and nothing at all while it only timed out.
``effectguard_overhead_duration_seconds`` left out the same requests, and counted a
retried request once per attempt. These tests drive the guard through its transport
(respx upstream) and one real ``effectguard serve`` (fake provider), and read the
histograms back by ``outcome``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
import respx
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from test_metrics import CHAT_URL, FAST, MODEL, OPENAI, _Stream, chat, ok

from effectguard import AsyncGuardTransport, GuardSettings
from effectguard.ledger import Ledger
from effectguard.telemetry.metrics import Metrics
from effectguard.testing import FakeProvider, fake_provider, free_port, running_proxy

UPSTREAM = "effectguard_upstream_duration_seconds"
OVERHEAD = "effectguard_overhead_duration_seconds"


def attempts(metrics: Metrics, provider: str = "openai") -> dict[str, float]:
    """Attempts timed for ``provider``, by outcome (absent: none timed)."""
    return _counts(metrics.registry.collect(), provider)


def _counts(families: Iterable[Metric], provider: str) -> dict[str, float]:
    """The upstream histogram's ``_count`` of ``provider`` in ``families``, by outcome."""
    return {
        s.labels.get("outcome", "<none>"): s.value
        for family in families
        if family.name == UPSTREAM
        for s in family.samples
        if s.name == UPSTREAM + "_count" and s.labels.get("provider") == provider and s.value
    }


def overhead(metrics: Metrics) -> float | None:
    """Requests timed in the overhead histogram."""
    return metrics.registry.get_sample_value(OVERHEAD + "_count")


@pytest_asyncio.fixture
async def guarded(ledger_path: str) -> AsyncIterator[tuple[Metrics, httpx.AsyncClient]]:
    """Metrics on a fresh registry and a client guarded with them (no retry backoff)."""
    async with Ledger.open(ledger_path) as ledger:
        metrics = Metrics(registry=CollectorRegistry())
        transport = AsyncGuardTransport(ledger=ledger, settings=FAST, observer=metrics.observer)
        async with httpx.AsyncClient(transport=transport) as client:
            yield metrics, client


@respx.mock(base_url=OPENAI)
async def test_an_attempt_that_timed_out_is_timed_as_a_timeout(
    respx_mock: respx.MockRouter, guarded: tuple[Metrics, httpx.AsyncClient]
) -> None:
    """A read timeout after the send (504 effect_unknown) is one ``timeout`` attempt and
    one request of overhead: the histograms did not move for it."""
    metrics, client = guarded
    respx_mock.post("/v1/chat/completions").mock(side_effect=httpx.ReadTimeout("slow"))
    assert (await client.post(CHAT_URL, json=chat())).status_code == 504
    assert attempts(metrics) == {"timeout": 1}
    assert overhead(metrics) == 1


@respx.mock(base_url=OPENAI)
async def test_a_reset_and_a_refused_connection_are_timed_as_errors(
    respx_mock: respx.MockRouter, guarded: tuple[Metrics, httpx.AsyncClient]
) -> None:
    """A connection reset after the send (502 effect_unknown) is one ``error`` attempt; a
    refused connection retried twice (502 upstream_unreachable) is three; each request is
    one of overhead."""
    metrics, client = guarded
    route = respx_mock.post("/v1/chat/completions")
    route.mock(side_effect=httpx.ReadError("connection reset by peer"))
    assert (await client.post(CHAT_URL, json=chat("reset"))).status_code == 502
    assert attempts(metrics) == {"error": 1}
    route.mock(side_effect=httpx.ConnectError("connection refused"))
    assert (await client.post(CHAT_URL, json=chat("refused"))).status_code == 502
    assert route.call_count == 4
    assert attempts(metrics) == {"error": 4}
    assert overhead(metrics) == 2


@respx.mock(base_url=OPENAI)
async def test_an_answer_too_large_to_read_is_timed_as_an_error(
    respx_mock: respx.MockRouter, ledger_path: str
) -> None:
    """An answer past ``max_answer_bytes`` (502 effect_unknown) is one ``error`` attempt."""
    metrics = Metrics(registry=CollectorRegistry())
    settings = GuardSettings(retry_wait_s=0, retry_wait_max_s=0, max_answer_bytes=64)
    respx_mock.post("/v1/chat/completions").mock(return_value=ok())
    async with Ledger.open(ledger_path) as ledger:
        transport = AsyncGuardTransport(ledger=ledger, settings=settings, observer=metrics.observer)
        async with httpx.AsyncClient(transport=transport) as client:
            assert (await client.post(CHAT_URL, json=chat())).status_code == 502
    assert attempts(metrics) == {"error": 1}
    assert overhead(metrics) == 1


@respx.mock(base_url=OPENAI)
async def test_a_stream_broken_part_way_is_timed_as_an_error(
    respx_mock: respx.MockRouter, guarded: tuple[Metrics, httpx.AsyncClient]
) -> None:
    """A stream reset before its terminal event is one ``error`` attempt and one request
    of overhead, as a whole stream is one ``answered`` attempt."""
    metrics, client = guarded
    first = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'

    async def cut() -> AsyncIterator[bytes]:
        yield first
        raise httpx.ReadError("connection reset")

    respx_mock.post("/v1/chat/completions").mock(
        return_value=httpx.Response(
            200, headers={"content-type": "text/event-stream"}, stream=_Stream(cut())
        )
    )
    async with client.stream("POST", CHAT_URL, json={**chat(), "stream": True}) as r:
        with pytest.raises(httpx.HTTPError):
            async for _ in r.aiter_raw():
                pass
    assert attempts(metrics) == {"error": 1}
    assert overhead(metrics) == 1


@respx.mock(base_url=OPENAI)
async def test_retried_answers_are_attempts_and_the_request_one_overhead(
    respx_mock: respx.MockRouter, guarded: tuple[Metrics, httpx.AsyncClient]
) -> None:
    """A 429 retried twice, then a 200, are four ``answered`` attempts over two requests:
    the overhead histogram once counted each retried attempt as a request of its own."""
    metrics, client = guarded
    route = respx_mock.post("/v1/chat/completions")
    route.mock(return_value=httpx.Response(429, json={"error": {"message": "busy"}}))
    assert (await client.post(CHAT_URL, json=chat("busy"))).status_code == 429
    assert route.call_count == 3
    route.mock(return_value=ok())
    assert (await client.post(CHAT_URL, json=chat("fine"))).status_code == 200
    assert attempts(metrics) == {"answered": 4}
    assert overhead(metrics) == 2
    labels = {"provider": "openai", "model": MODEL, "outcome": "not_processed"}
    assert metrics.registry.get_sample_value("effectguard_requests_total", labels) == 1


# -- through a real effectguard serve ---------------------------------------------------------
@pytest.fixture
def provider(tmp_path: Path) -> Iterator[FakeProvider]:
    """A fake provider process for one test."""
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        yield fake


@pytest.mark.slow
def test_the_proxys_metrics_time_attempts_that_time_out_or_break(
    tmp_path: Path, provider: FakeProvider
) -> None:
    """Through ``effectguard serve``, scraped at /metrics: an upstream slower than the
    read timeout (504), one that hangs up without answering (502), a stream reset part-way
    and an upstream nobody listens on (three attempts) all show in the upstream histogram,
    each under its ending, beside one answered call."""
    config = tmp_path / "config.toml"
    config.write_text("[upstream]\nread_timeout_s = 1\n[guard]\nretry_wait_s = 0\n")
    closed = f"http://127.0.0.1:{free_port()}"
    with (
        running_proxy(
            tmp_path / "ledger.db",
            upstreams={"openai": provider.url, "anthropic": closed},
            args=["--config", str(config)],
        ) as proxy,
        httpx.Client(base_url=proxy.url, timeout=30) as client,
    ):
        url = "/openai/v1/chat/completions"

        def post(behaviour: str, stream: bool = False) -> int:
            body = {**chat(behaviour), "stream": stream}
            headers = {"x-fake-behaviour": behaviour} if behaviour else {}
            with client.stream("POST", url, json=body, headers=headers) as answer:
                try:
                    answer.read()
                except httpx.HTTPError:
                    return -1  # a stream ended with an error
                return answer.status_code

        assert post("") == 200
        assert post("delay=3") == 504
        assert post("drop") == 502
        assert post("reset=1", stream=True) == -1
        message = {"model": "claude-haiku-4-5", "max_tokens": 5, "messages": []}
        message["messages"] = [{"role": "user", "content": "hi"}]
        assert client.post("/anthropic/v1/messages", json=message).status_code == 502
        text = client.get("/metrics").text
    families = list(text_string_to_metric_families(text))
    assert _counts(families, "openai") == {"answered": 1, "timeout": 1, "error": 2}
    assert _counts(families, "anthropic") == {"error": 3}
    (requests,) = (s.value for f in families for s in f.samples if s.name == OVERHEAD + "_count")
    assert requests == 5
