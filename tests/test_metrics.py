"""Metrics (contract.md §10): the observer's counters and ledger gauges, on an injected registry.

Traffic goes through ``AsyncGuardTransport`` on a SQLite ledger with a
respx-mocked upstream; values are read back from the registry.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import prometheus_client
import pytest
import pytest_asyncio
import respx
from admitkit import admit_request
from prometheus_client import CollectorRegistry

from effectguard import AsyncGuardTransport, GuardSettings
from effectguard.ledger import Ledger
from effectguard.providers import ModelPrice, load_providers
from effectguard.rules.budgetview import Policyless
from effectguard.rules.money import nanos_to_decimal
from effectguard.rules.usage import Usage, cost, estimate
from effectguard.telemetry.metrics import OTHER_BUDGETS, Metrics, top_budgets
from effectguard.telemetry.observer import NullObserver
from effectguard.telemetry.report import CallReport
from effectguard.testing import free_port, start_proxy
from effectguard_bench import ledgerbench

OPENAI = "https://api.openai.com"
CHAT_URL = OPENAI + "/v1/chat/completions"
MODEL = "gpt-4o-mini"
_PRICE = load_providers([], {})["openai"].price_for(MODEL)
assert _PRICE is not None
PRICE: ModelPrice = _PRICE
FAST = GuardSettings(retry_wait_s=0, retry_wait_max_s=0)
#: The gauges read from the ledger at scrape time.
LEDGER_FAMILIES = (
    "effectguard_calls_in_flight",
    "effectguard_effect_unknown_calls",
    "effectguard_effect_unknown_held_usd",
    "effectguard_effect_unknown_oldest_timestamp_seconds",
    "effectguard_budget_limit_usd",
    "effectguard_budget_reserved_usd",
    "effectguard_budget_spent_usd",
    "effectguard_budget_held_usd",
    "effectguard_budget_period_end_timestamp_seconds",
)


def chat(content: str = "hello") -> dict[str, Any]:
    """A chat completion request body."""
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 10}


def ok() -> httpx.Response:
    """A 200 chat completion with 10 prompt and 5 completion tokens."""
    usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    return httpx.Response(
        200,
        json={
            "id": "c",
            "object": "chat.completion",
            "created": 1,
            "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
            "usage": usage,
        },
    )


def usd(nanos: int) -> float:
    """Nano-dollars as the float a ``_usd`` sample carries."""
    return float(nanos_to_decimal(nanos))


def value(metrics: Metrics, name: str, **labels: str) -> float | None:
    """One sample's value from the metrics' registry."""
    return metrics.registry.get_sample_value(name, labels)


def ledger_samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the ledger gauges (name and labels to value)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in metrics.registry.collect()
        if family.name in LEDGER_FAMILIES
        for s in family.samples
    }


@pytest_asyncio.fixture
async def ledger(ledger_path: str) -> AsyncIterator[Ledger]:
    """The test's SQLite ledger, opened."""
    async with Ledger.open(ledger_path) as opened:
        yield opened


@pytest_asyncio.fixture
async def guarded(ledger: Ledger) -> AsyncIterator[tuple[Metrics, httpx.AsyncClient]]:
    """Metrics on a fresh registry, attached to the ledger, and a client guarded with them."""
    metrics = Metrics(registry=CollectorRegistry())
    transport = AsyncGuardTransport(ledger=ledger, settings=FAST, observer=metrics.observer)
    await transport.guard()
    metrics.attach(ledger)
    async with httpx.AsyncClient(transport=transport) as client:
        yield metrics, client


async def unknown_effect(client: httpx.AsyncClient, mock: respx.MockRouter, key: str) -> str:
    """Make one call whose effect is unknown (the upstream times out after the send)."""
    mock.post("/v1/chat/completions").mock(side_effect=httpx.ReadTimeout("slow"))
    response = await client.post(CHAT_URL, json=chat(key), headers={"Idempotency-Key": key})
    assert response.status_code == 504
    call_id: str = response.headers["effectguard-call-id"]
    return call_id


@respx.mock(base_url=OPENAI)
async def test_counters_follow_the_traffic(
    respx_mock: respx.MockRouter, guarded: tuple[Metrics, httpx.AsyncClient], ledger: Ledger
) -> None:
    """Completions, a replay and a budget refusal show up as requests, tokens, cost, refusals."""
    metrics, client = guarded
    respx_mock.post("/v1/chat/completions").mock(return_value=ok())
    await ledger.set_limit("team-a", estimate(PRICE, chat()) - 1)
    for _ in range(2):
        response = await client.post(CHAT_URL, json=chat(), headers={"Idempotency-Key": "k"})
        assert response.status_code == 200
    assert (await client.post(CHAT_URL, json=chat("other"))).status_code == 200
    refused = await client.post(CHAT_URL, json=chat(), headers={"Effectguard-Budget": "team-a"})
    assert refused.status_code == 402

    labels = {"provider": "openai", "model": MODEL}
    assert value(metrics, "effectguard_requests_total", **labels, outcome="completed") == 2
    assert value(metrics, "effectguard_requests_total", **labels, outcome="replayed") == 1
    assert value(metrics, "effectguard_replays_total", provider="openai") == 1
    assert value(metrics, "effectguard_tokens_total", **labels, direction="input") == 20
    assert value(metrics, "effectguard_tokens_total", **labels, direction="output") == 10
    spent = usd(2 * cost(PRICE, Usage(10, 5)))
    assert value(metrics, "effectguard_cost_usd_total", **labels) == pytest.approx(spent)
    reason = {"provider": "openai", "reason": "budget_exceeded"}
    assert value(metrics, "effectguard_refusals_total", **reason) == 1
    answered = {"provider": "openai", "outcome": "answered"}
    assert value(metrics, "effectguard_upstream_duration_seconds_count", **answered) == 2
    assert value(metrics, "effectguard_overhead_duration_seconds_count") == 2


@respx.mock(base_url=OPENAI)
async def test_a_streamed_call_is_timed_like_any_other(
    respx_mock: respx.MockRouter, guarded: tuple[Metrics, httpx.AsyncClient]
) -> None:
    """A completed stream counts once in the upstream and the overhead histograms, as a
    plain answer does: the overhead histogram left every streamed call out, so a fleet
    that streams showed no overhead at all."""
    metrics, client = guarded
    events = (
        b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,'
        b'"delta":{"content":"hi"}}]}\n\n'
        b'data: {"id":"c","object":"chat.completion.chunk","choices":[],'
        b'"usage":{"prompt_tokens":10,"completion_tokens":5,"total_tokens":15}}\n\n'
        b"data: [DONE]\n\n"
    )
    respx_mock.post("/v1/chat/completions").mock(
        return_value=httpx.Response(
            200, headers={"content-type": "text/event-stream"}, content=events
        )
    )
    async with client.stream("POST", CHAT_URL, json={**chat(), "stream": True}) as response:
        assert response.status_code == 200
        await response.aread()
    labels = {"provider": "openai", "model": MODEL, "outcome": "completed"}
    assert value(metrics, "effectguard_requests_total", **labels) == 1
    answered = {"provider": "openai", "outcome": "answered"}
    assert value(metrics, "effectguard_upstream_duration_seconds_count", **answered) == 1
    assert value(metrics, "effectguard_overhead_duration_seconds_count") == 1


@respx.mock(base_url=OPENAI)
async def test_a_request_is_counted_once_by_its_final_outcome(
    respx_mock: respx.MockRouter, guarded: tuple[Metrics, httpx.AsyncClient]
) -> None:
    """A 429 retried twice (three attempts) is one not_processed request; an upstream
    nobody listens on is one not_sent request; a stream broken part-way is one
    effect_unknown request (each retried attempt was once counted, and a broken stream
    never was)."""
    metrics, client = guarded
    route = respx_mock.post("/v1/chat/completions")
    labels = {"provider": "openai", "model": MODEL}
    route.mock(return_value=httpx.Response(429, json={"error": {"message": "slow down"}}))
    assert (await client.post(CHAT_URL, json=chat("busy"))).status_code == 429
    assert route.call_count == 3
    assert value(metrics, "effectguard_requests_total", **labels, outcome="not_processed") == 1
    route.mock(side_effect=httpx.ConnectError("nobody there"))
    assert (await client.post(CHAT_URL, json=chat("down"))).status_code == 502
    assert route.call_count == 6
    assert value(metrics, "effectguard_requests_total", **labels, outcome="not_sent") == 1
    first = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'

    async def cut() -> AsyncIterator[bytes]:
        yield first
        raise httpx.ReadError("connection reset")

    route.mock(
        return_value=httpx.Response(
            200, headers={"content-type": "text/event-stream"}, stream=_Stream(cut())
        )
    )
    async with client.stream("POST", CHAT_URL, json={**chat("cut"), "stream": True}) as r:
        with pytest.raises(httpx.HTTPError):
            async for _ in r.aiter_raw():
                pass
    assert value(metrics, "effectguard_requests_total", **labels, outcome="effect_unknown") == 1


@respx.mock(base_url=OPENAI)
async def test_a_call_sent_and_lost_is_reported_effect_unknown_not_refused(
    respx_mock: respx.MockRouter, ledger: Ledger
) -> None:
    """The report an access line and a span are written from says ``effect_unknown`` for
    a request that was sent and not observed (502/504), ``refused`` for the keyed
    resend then refused 409, and ``not_sent`` when no connection opened (a request that
    reached the provider was once logged ``refused``)."""
    reports: list[CallReport] = []

    class Recording(NullObserver):
        def call_finished(self, report: CallReport) -> None:
            reports.append(report)

    transport = AsyncGuardTransport(ledger=ledger, settings=FAST, observer=Recording())
    async with httpx.AsyncClient(transport=transport) as client:
        await unknown_effect(client, respx_mock, "lost")
        resend = await client.post(CHAT_URL, json=chat("lost"), headers={"Idempotency-Key": "lost"})
        assert resend.status_code == 409
        respx_mock.post("/v1/chat/completions").mock(side_effect=httpx.ConnectError("down"))
        assert (await client.post(CHAT_URL, json=chat("down"))).status_code == 502
    assert [(r.status, r.outcome) for r in reports] == [
        (504, "effect_unknown"),
        (409, "refused"),
        (502, "not_sent"),
    ]


class _Stream(httpx.AsyncByteStream):
    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self._chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._chunks:
            yield chunk


@respx.mock(base_url=OPENAI)
async def test_ledger_commits_are_timed(
    respx_mock: respx.MockRouter, guarded: tuple[Metrics, httpx.AsyncClient]
) -> None:
    """Every group commit is counted by result and observed for time and batch size."""
    metrics, client = guarded
    respx_mock.post("/v1/chat/completions").mock(return_value=ok())
    await asyncio.gather(*(client.post(CHAT_URL, json=chat(str(i))) for i in range(8)))
    commits = value(metrics, "effectguard_ledger_commits_total", result="ok")
    assert commits is not None and commits >= 2
    assert value(metrics, "effectguard_ledger_commits_total", result="failed") == 0
    assert value(metrics, "effectguard_ledger_commit_duration_seconds_count") == commits
    assert value(metrics, "effectguard_ledger_commit_batch_size_count") == commits
    operations = value(metrics, "effectguard_ledger_commit_batch_size_sum")
    assert operations is not None and operations >= 16  # admit and record per call


@respx.mock(base_url=OPENAI)
async def test_unknown_effect_gauges_come_from_the_ledger(
    respx_mock: respx.MockRouter, guarded: tuple[Metrics, httpx.AsyncClient], ledger: Ledger
) -> None:
    """An effect-unknown call is counted with its held money and its admission time."""
    metrics, client = guarded
    call_id = await unknown_effect(client, respx_mock, "k-unknown")
    await metrics.refresh()
    call = await ledger.call(call_id)
    assert call.stage == "effect_unknown" and call.held > 0
    assert value(metrics, "effectguard_effect_unknown_calls", provider="openai") == 1
    assert value(metrics, "effectguard_effect_unknown_held_usd", provider="openai") == usd(
        call.held
    )
    oldest = "effectguard_effect_unknown_oldest_timestamp_seconds"
    assert value(metrics, oldest, provider="openai") == call.created_at
    assert value(metrics, "effectguard_calls_in_flight", provider="openai") == 0
    assert value(metrics, "effectguard_budget_held_usd", budget="default") == usd(call.held)
    outcome = {"provider": "openai", "model": MODEL, "outcome": "effect_unknown"}
    assert value(metrics, "effectguard_requests_total", **outcome) == 1


@respx.mock(base_url=OPENAI)
async def test_a_fresh_metrics_on_the_same_ledger_file_shows_the_same_gauges(
    respx_mock: respx.MockRouter,
    guarded: tuple[Metrics, httpx.AsyncClient],
    ledger: Ledger,
    ledger_path: str,
) -> None:
    """Gauges are read from the ledger: a new process (new Metrics, new store) sees the same."""
    metrics, client = guarded
    await unknown_effect(client, respx_mock, "k-1")
    await ledger.set_limit("team-b", 5_000_000_000)
    await metrics.refresh()
    before = ledger_samples(metrics)
    assert before[("effectguard_effect_unknown_calls", (("provider", "openai"),))] == 1
    assert before[("effectguard_budget_limit_usd", (("budget", "team-b"),))] == 5.0
    async with Ledger.open(ledger_path) as reopened:
        fresh = Metrics(registry=CollectorRegistry())
        fresh.attach(reopened)
        await fresh.refresh()
        assert ledger_samples(fresh) == before


@respx.mock(base_url=OPENAI)
async def test_unknown_effect_gauge_drops_to_zero_when_reconciled(
    respx_mock: respx.MockRouter, guarded: tuple[Metrics, httpx.AsyncClient], ledger: Ledger
) -> None:
    """Reconciling the call takes the unknown-effect gauge to 0 and removes its age."""
    metrics, client = guarded
    call_id = await unknown_effect(client, respx_mock, "k-1")
    await ledger.reconcile(call_id, applied=False, note="checked", by="test")
    await metrics.refresh()
    assert value(metrics, "effectguard_effect_unknown_calls", provider="openai") == 0
    assert value(metrics, "effectguard_effect_unknown_held_usd", provider="openai") == 0
    oldest = "effectguard_effect_unknown_oldest_timestamp_seconds"
    assert value(metrics, oldest, provider="openai") is None


async def test_budget_gauges_stop_at_the_configured_depth(ledger: Ledger) -> None:
    """Budget labels are roots only by default; ``budget_depth`` admits deeper paths."""
    await ledger.set_limit("team-a", 10**9)
    await ledger.set_limit("team-a/run-1", 10**8)
    roots, deeper = Metrics(), Metrics(budget_depth=2)
    for metrics in (roots, deeper):
        metrics.attach(ledger)
        await metrics.refresh()
    assert value(roots, "effectguard_budget_limit_usd", budget="team-a") == 1.0
    assert value(roots, "effectguard_budget_limit_usd", budget="team-a/run-1") is None
    assert value(deeper, "effectguard_budget_limit_usd", budget="team-a/run-1") == 0.1


@respx.mock(base_url=OPENAI)
async def test_exposition_names_types_and_labels_follow_prometheus_conventions(
    respx_mock: respx.MockRouter, guarded: tuple[Metrics, httpx.AsyncClient]
) -> None:
    """One prefix, _total counters, base units, and no label carrying a call id or a key."""
    metrics, client = guarded
    respx_mock.post("/v1/chat/completions").mock(return_value=ok())
    response = await client.post(CHAT_URL, json=chat(), headers={"Idempotency-Key": "secret-k"})
    call_id = response.headers["effectguard-call-id"]
    await metrics.refresh()
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain; version=")
    text = body.decode()
    assert call_id not in text and "secret-k" not in text
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE))
    assert all(name.startswith("effectguard_") for name in types)
    expected = {
        "effectguard_requests_total": "counter",
        "effectguard_tokens_total": "counter",
        "effectguard_cost_usd_total": "counter",
        "effectguard_refusals_total": "counter",
        "effectguard_replays_total": "counter",
        "effectguard_internal_errors_total": "counter",
        "effectguard_ledger_commits_total": "counter",
        "effectguard_connections_closed_for_room_total": "counter",
        "effectguard_upstream_duration_seconds": "histogram",
        "effectguard_overhead_duration_seconds": "histogram",
        "effectguard_ledger_commit_duration_seconds": "histogram",
        "effectguard_ledger_commit_batch_size": "histogram",
        "effectguard_ledger_up": "gauge",
        "effectguard_ledger_read_duration_seconds": "gauge",
        **dict.fromkeys(LEDGER_FAMILIES, "gauge"),
    }
    # prometheus_client adds a _created gauge per counter and histogram series.
    declared = {name: kind for name, kind in types.items() if not name.endswith("_created")}
    assert declared == expected
    label_names = set(re.findall(r"[{,](\w+)=", text))
    allowed = {"provider", "model", "outcome", "direction", "reason", "budget", "result", "le"}
    assert label_names <= allowed


def test_label_values_are_capped() -> None:
    """An unbounded stream of model names cannot grow the series count past the cap."""
    metrics = Metrics()
    for i in range(150):
        metrics.observer.request_done("openai", f"model-{i}", "completed")
    models = {
        s.labels["model"]
        for family in metrics.registry.collect()
        if family.name == "effectguard_requests"
        for s in family.samples
        if s.name.endswith("_total")
    }
    assert len(models) == 101 and "other" in models
    assert value(metrics, "effectguard_requests_total", provider="openai", model="other",
                 outcome="completed") == 50  # fmt: skip


def test_a_first_count_makes_its_siblings_at_zero_for_rate() -> None:
    """A provider's and a model's first count makes their other series at 0, so that
    Prometheus, which cannot rate a series' first sample, counts their own first counts
    (docs/metrics.md); a request with no provider makes none."""
    metrics = Metrics()
    metrics.observer.refused("", "not_found")
    assert value(metrics, "effectguard_replays_total", provider="") is None
    metrics.observer.request_done("openai", "gpt-4o-mini", "completed")
    for outcome in ("effect_unknown", "failed", "not_processed", "replayed"):
        assert value(metrics, "effectguard_requests_total", provider="openai",
                     model="gpt-4o-mini", outcome=outcome) == 0  # fmt: skip
    assert value(metrics, "effectguard_cost_usd_total", provider="openai",
                 model="gpt-4o-mini") == 0  # fmt: skip
    for reason in ("rate_limited", "budget_exceeded"):
        assert value(metrics, "effectguard_refusals_total", provider="openai", reason=reason) == 0
    for ending in ("answered", "timeout", "error"):
        assert value(metrics, "effectguard_upstream_duration_seconds_count",
                     provider="openai", outcome=ending) == 0  # fmt: skip
    metrics.observer.request_done("openai", "gpt-4o-mini", "effect_unknown")
    assert value(metrics, "effectguard_requests_total", provider="openai",
                 model="gpt-4o-mini", outcome="effect_unknown") == 1  # fmt: skip


async def test_an_unreadable_ledger_reports_down_not_stale_gauges(ledger_path: str) -> None:
    """If the ledger cannot be read, ledger_up is 0 and no ledger gauge shows old values."""
    metrics = Metrics()
    async with Ledger.open(ledger_path) as ledger:
        await ledger.set_limit("team-a", 10**9)
        metrics.attach(ledger)
        await metrics.refresh()
        assert value(metrics, "effectguard_ledger_up") == 1
    await metrics.refresh()  # the store is closed now
    assert value(metrics, "effectguard_ledger_up") == 0
    assert value(metrics, "effectguard_budget_limit_usd", budget="team-a") is None


@respx.mock(base_url=OPENAI)
async def test_start_http_server_exposes_current_ledger_gauges(
    respx_mock: respx.MockRouter, guarded: tuple[Metrics, httpx.AsyncClient]
) -> None:
    """The in-process one-liner (start_http_server on the registry) reads the ledger per scrape."""
    metrics, client = guarded
    respx_mock.route(host="127.0.0.1").pass_through()
    port = free_port()
    server, thread = prometheus_client.start_http_server(
        port, addr="127.0.0.1", registry=metrics.registry
    )
    try:
        await unknown_effect(client, respx_mock, "k-1")  # no refresh() awaited by the test
        async with httpx.AsyncClient() as scraper:
            text = (await scraper.get(f"http://127.0.0.1:{port}/metrics")).text
        assert 'effectguard_effect_unknown_calls{provider="openai"} 1.0' in text
    finally:
        server.shutdown()
        thread.join(5)


async def test_budget_gauges_show_the_current_period() -> None:
    """A daily budget's gauges show today's counters (yesterday's charges are not counted)
    and when today ends."""
    from datetime import UTC, datetime

    from effectguard.ledger import operations
    from effectguard.ledger.base import Writer
    from effectguard.rules.budget import BudgetPolicy
    from effectguard.testing.clock import ManualClock

    clock = ManualClock(datetime(2026, 11, 30, 23, 0, tzinfo=UTC).timestamp())
    async with Ledger.open("memory://", clock=clock) as ledger:
        await ledger.set_policy(BudgetPolicy("team", 10**9, "day", "UTC"))
        writer = await ledger.store.write(
            Writer("boot", 0),
            lambda tx: operations.register_worker(tx, worker="w", host="h", pid=1, lease_s=1e6),
        )
        request = admit_request("team", model=MODEL, reserve=7_000)
        assert (await ledger.admit(writer, request)).action == "admit"
        metrics = Metrics()
        metrics.attach(ledger)
        await metrics.refresh()
        assert value(metrics, "effectguard_budget_reserved_usd", budget="team") == usd(7_000)
        clock.advance(3600)  # Dec 1
        await metrics.refresh()
        assert value(metrics, "effectguard_budget_reserved_usd", budget="team") == 0
        end = value(metrics, "effectguard_budget_period_end_timestamp_seconds", budget="team")
        assert end == datetime(2026, 12, 2, tzinfo=UTC).timestamp()


# -- concurrent scrapes: shared reads, never figures older than the scrape
class HeldReads:
    """A store whose gauge reads (``stage_counts``) are counted and, while ``hold`` is
    clear, wait after taking their figures: a slow ledger read, paused at will."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.reads = 0
        self.entered = asyncio.Event()
        self.hold = asyncio.Event()
        self.hold.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def stage_counts(self) -> list[tuple[str, str, int, int, float]]:
        self.reads += 1
        figures: list[tuple[str, str, int, int, float]] = await self._store.stage_counts()
        self.entered.set()
        await self.hold.wait()
        return figures


def held_metrics(ledger: Ledger, refresh_timeout_s: float = 5.0) -> tuple[Metrics, HeldReads]:
    """Metrics reading ``ledger`` through a :class:`HeldReads`."""
    store = HeldReads(ledger.store)
    metrics = Metrics(registry=CollectorRegistry(), refresh_timeout_s=refresh_timeout_s)
    metrics.attach(Ledger(store))
    return metrics, store


async def test_concurrent_scrapes_share_one_ledger_read(ledger: Ledger) -> None:
    """Twenty scrapes arriving while a read runs cost one more read, not twenty."""
    metrics, store = held_metrics(ledger)
    await metrics.refresh()  # the read attach started, and this one
    store.reads = 0
    store.hold.clear()
    store.entered.clear()
    first = asyncio.ensure_future(metrics.refresh())
    await store.entered.wait()
    rest = [asyncio.ensure_future(metrics.refresh()) for _ in range(20)]
    await asyncio.sleep(0)
    store.hold.set()
    await asyncio.gather(first, *rest)
    assert store.reads == 2  # the one running when they came, then one for all of them


async def test_a_scrape_whose_ledger_read_hangs_answers_ledger_down(ledger: Ledger) -> None:
    """A read that hangs (a locked table, a silent database: 10 to 60 s) ends the scrape at
    refresh_timeout_s with ledger_up 0 and no ledger gauge, so Prometheus (10 s scrape
    timeout) still gets an answer and EffectguardLedgerUnreadable can fire; the read goes
    on, and once the ledger answers a scrape shows the gauges again."""
    await ledger.set_limit("team-a", 10**9)
    metrics, store = held_metrics(ledger, refresh_timeout_s=0.05)
    await metrics.refresh()
    assert value(metrics, "effectguard_ledger_up") == 1
    store.hold.clear()
    # Without the bound this waits for the hold: the guard turns that into a failure.
    await asyncio.wait_for(metrics.refresh(), 30)
    assert value(metrics, "effectguard_ledger_up") == 0
    assert ledger_samples(metrics) == {}
    store.hold.set()
    await metrics.refresh()
    assert value(metrics, "effectguard_ledger_up") == 1
    assert value(metrics, "effectguard_budget_limit_usd", budget="team-a") == 1


@respx.mock(base_url=OPENAI)
async def test_a_scrape_never_gets_figures_read_before_it_was_asked(
    respx_mock: respx.MockRouter, guarded: tuple[Metrics, httpx.AsyncClient], ledger: Ledger
) -> None:
    """A scrape asked after a call became effect-unknown shows it, even while a read that
    took its figures before that call is still running (it waits for the next read)."""
    _, client = guarded
    metrics, store = held_metrics(ledger)
    await metrics.refresh()
    store.hold.clear()
    store.entered.clear()
    stale = asyncio.ensure_future(metrics.refresh())
    await store.entered.wait()  # figures taken: no unknown call yet
    await unknown_effect(client, respx_mock, "k-after")
    after = asyncio.ensure_future(metrics.refresh())
    await asyncio.sleep(0)
    store.hold.set()
    await asyncio.gather(stale, after)
    assert value(metrics, "effectguard_effect_unknown_calls", provider="openai") == 1


class NodesRead:
    """A store that notes the paths of the budget nodes each read returned."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.paths: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def budget_nodes(self, *args: Any, **kwargs: Any) -> list[Any]:
        nodes: list[Any] = await self._store.budget_nodes(*args, **kwargs)
        self.paths |= {n.path for n in nodes}
        return nodes

    async def policyless(self, depth: int, limit: int) -> Policyless:
        read: Policyless = await self._store.policyless(depth, limit)
        self.paths |= {n.path for n in read.top}
        return read


async def test_a_scrape_reads_only_the_budget_nodes_it_labels(ledger: Ledger) -> None:
    """Per-user budget nodes below the labelled depth are not read at all by a scrape
    (100,000 of them took each scrape 1.3 s of the event loop); the roots are shown."""
    writer = await ledgerbench.register(ledger, lease_s=60)
    for user in ("u1", "u2", "u3"):
        await ledger.admit(writer, ledgerbench.admit_request(f"team/{user}"))
    store = NodesRead(ledger.store)
    metrics = Metrics(registry=CollectorRegistry())
    metrics.attach(Ledger(store))
    await metrics.refresh()
    assert store.paths == {"team"}
    assert value(metrics, "effectguard_budget_reserved_usd", budget="team") is not None


async def test_a_scrape_reads_only_the_client_made_roots_it_shows(ledger: Ledger) -> None:
    """Roots that clients make by naming budgets (nodes with no policy) are ranked and
    summed by the store: a scrape reads the 50 it shows, not all of them (100,000 took
    each scrape 0.76 s of the event loop), and shows what a read of every root gives."""
    writer = await ledgerbench.register(ledger, lease_s=60)
    for i in range(120):
        for _ in range(i % 7 + 1):  # money committed varies, with ties
            await ledger.admit(writer, ledgerbench.admit_request(f"r{i:03d}"))
    await ledger.change_policy("watched", {"limit": 10**12})  # ranked first, never charged
    store = NodesRead(ledger.store)
    metrics = Metrics(registry=CollectorRegistry())
    metrics.attach(Ledger(store))
    await metrics.refresh()
    assert len(store.paths) == 50 and "watched" not in store.paths
    every = top_budgets(await ledger.budgets(depth=1), 50)
    assert every[0].path == "watched" and every[-1].path == OTHER_BUDGETS
    for node in every:
        reserved = value(metrics, "effectguard_budget_reserved_usd", budget=node.path)
        assert reserved == usd(node.reserved), node.path
    shown = [
        s
        for family in metrics.registry.collect()
        if family.name == "effectguard_budget_reserved_usd"
        for s in family.samples
    ]
    assert len(shown) == len(every) == 51


def test_serve_shows_declared_models_at_zero_before_any_request(tmp_path: Path) -> None:
    """``serve``'s first scrape already has each declared provider's and priced model's
    counters at 0, so a replica's first call of a model shows in ``rate()``
    (test_prometheus_first_call.py shows it with a real Prometheus)."""
    ledger = str(tmp_path / "ledger.db")
    subprocess.run(
        [sys.executable, "-m", "effectguard", "migrate", "--ledger", ledger],
        check=True,
        capture_output=True,
        timeout=30,
    )
    proxy = start_proxy(ledger)
    try:
        lines = set(httpx.get(proxy.url + "/metrics", timeout=10).text.splitlines())
    finally:
        proxy.stop()
    for sample in (
        'effectguard_requests_total{model="gpt-4o-mini",outcome="completed",provider="openai"}',
        'effectguard_cost_usd_total{model="gpt-4o-mini",provider="openai"}',
        'effectguard_tokens_total{direction="input",model="gpt-4o-mini",provider="openai"}',
        'effectguard_upstream_duration_seconds_count{outcome="answered",provider="openai"}',
        'effectguard_refusals_total{provider="openai",reason="idempotency_key_reused"}',
    ):
        assert f"{sample} 0.0" in lines, sample
