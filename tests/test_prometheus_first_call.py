"""A replica's first call of a model shows in the dashboard's rate panels (contract §10).

Prometheus takes a series' first sample as where it starts: a counter series first
scraped at 1 adds nothing to ``rate()``. One ``serve`` scraped every second by a real
Prometheus gets one call, its first of the model: "Requests by outcome", "Spend rate by
provider and model", "Tokens" and "Upstream attempts by ending", read from the
dashboard's JSON, must each show it; and "Refusals by reason" the first refusal of a
key reused for another request.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from promkit import (
    CHAT,
    NEEDS_PROMETHEUS,
    Prometheus,
    chat,
    concrete,
    effectguard,
    panel,
    start_prometheus,
    wait_for,
)

from effectguard.testing import Proxy, fake_provider, start_proxy

pytestmark = NEEDS_PROMETHEUS

MODEL = "gpt-4o-mini"
REUSED = "idempotency_key_reused"


def shown(prom: Prometheus, expr: str, since: float) -> dict[tuple[str, ...], float]:
    """``expr``'s series at the latest scrape after ``since``, by their label values."""
    at = wait_for(
        "a scrape after the call",
        lambda: (t := prom.value("max(timestamp(effectguard_ledger_up))")) and t > since and t,
    )
    return {
        tuple(sorted(r["metric"].items())): float(r["value"][1])
        for r in prom.query(concrete(expr), at=float(at))
    }


def test_a_model_s_first_call_shows_in_the_rate_panels(tmp_path: Path) -> None:
    ledger = str(tmp_path / "ledger.db")
    effectguard("migrate", "--ledger", ledger)
    http = httpx.Client(timeout=10)
    proxy: Proxy | None = None
    prom: Prometheus | None = None
    with fake_provider(tmp_path / "receipts.jsonl") as provider:
        try:
            proxy = start_proxy(ledger, upstreams={"openai": provider.url})
            prom = start_prometheus(tmp_path, [proxy.url.removeprefix("http://")], http)
            # Two scrapes before the call: the rate has a sample before it to start from.
            wait_for("two scrapes", lambda: (prom.value("count_over_time(up[1m])") or 0) >= 2)
            key = {"idempotency-key": "first-call"}
            answer = http.post(proxy.url + CHAT, json=chat("first", model=MODEL), headers=key)
            assert answer.status_code == 200, answer.text
            reused = http.post(proxy.url + CHAT, json=chat("another", model=MODEL), headers=key)
            assert reused.json()["error"]["type"] == "idempotency_key_reused", reused.text
            assert len(provider.receipts()) == 1
            sent = time.time()
            wait_for(
                "a scrape counting the call",
                lambda: prom.value('sum(effectguard_requests_total{outcome="completed"})') == 1,
            )
            requests = shown(prom, panel("Requests by outcome")[0], sent)
            completed = {k: v for k, v in requests.items() if ("outcome", "completed") in k}
            spend = shown(prom, panel("Spend rate by provider and model")[0], sent)
            tokens = shown(prom, panel("Tokens")[0], sent)
            attempts = shown(prom, panel("Upstream attempts by ending")[0], sent)
            answered = {k: v for k, v in attempts.items() if ("outcome", "answered") in k}
            refusals = shown(prom, panel("Refusals by reason")[0], sent)
            reused_key = {k: v for k, v in refusals.items() if ("reason", REUSED) in k}
            missing = {
                "Requests by outcome (completed)": completed,
                "Spend rate by provider and model": spend,
                "Tokens": tokens,
                "Upstream attempts by ending (answered)": answered,
                f"Refusals by reason ({REUSED})": reused_key,
            }
            missing = {title: got for title, got in missing.items() if not any(got.values())}
            assert not missing, f"the first call is missing from: {missing}"
        finally:
            if prom is not None:
                prom.stop()
            if proxy is not None:
                proxy.stop()
            http.close()
