"""Cost, outcomes and unknown effects in Prometheus against the ledger (contract §10).

One ``serve`` scraped every second by a real Prometheus settles a mix of calls:
completed ones, ones the provider refused (400: not processed; 402: failed), one whose
answer the provider dropped part-way (effect unknown), and one in flight when ``serve``
is killed (SIGKILL) and restarted on the same port (effect unknown once the restart
finds it). What the dashboard reads must agree with `effectguard calls` and
`effectguard budgets`: the cost counters of both processes add up to the money the
ledger spent, their outcomes to its calls (less the killed one, which no process lived
to count), and the unknown-effect panels to its unknown calls and the money they hold;
the counters' reset at the restart is a reset to Prometheus, not a drop.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
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

from effectguard.testing import FakeProvider, Proxy, fake_provider, free_port, start_proxy

pytestmark = NEEDS_PROMETHEUS

TEAM = {"effectguard-budget": "team"}


def counted(prom: Prometheus, at: float) -> tuple[dict[str, float], float]:
    """The requests by outcome and the cost that the scraped process had counted at
    ``at`` (its last scrape by then)."""
    outcomes = {
        r["metric"]["outcome"]: float(r["value"][1])
        for r in prom.query(f"sum by (outcome) (effectguard_requests_total @ {at:.3f})")
    }
    cost = prom.value(f"sum(effectguard_cost_usd_total @ {at:.3f})") or 0.0
    return outcomes, cost


def scraped_after(prom: Prometheus, since: float, expr: str, value: float) -> float:
    """Wait until a scrape later than ``since`` shows ``expr`` == ``value``; that time."""

    def seen() -> float | None:
        found = prom.query(f"timestamp({expr})")
        result = prom.value(expr)
        if found and result == value and float(found[0]["value"][1]) > since:
            return float(found[0]["value"][1])
        return None

    return float(wait_for(f"a scrape showing {expr} == {value}", seen))


def send_mix(proxy: Proxy) -> None:
    """Three completions, one refused by the provider (400: not processed), one failed
    (402: applied), one whose answer the provider dropped."""
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        for i in range(3):
            body = {**chat(f"fine {i}"), "max_tokens": 5 + i}
            assert client.post(CHAT, json=body, headers=TEAM).status_code == 200
        for status in (400, 402):  # not processed; failed, booked as applied
            refused = client.post(
                CHAT, json=chat(f"bad {status}"), headers=TEAM | {"x-fake-status": str(status)}
            )
            assert refused.status_code == status, refused.text
        dropped = client.post(
            CHAT, json=chat("dropped"), headers=TEAM | {"x-fake-break-after": "0"}
        )
        assert dropped.status_code >= 500, dropped.text


def kill_mid_call(proxy: Proxy, provider: FakeProvider) -> None:
    """SIGKILL ``proxy`` while the provider holds a call it received."""
    before = len(provider.receipts())
    errors: list[BaseException] = []

    def call() -> None:
        try:
            httpx.post(
                proxy.url + CHAT,
                json=chat("killed"),
                headers=TEAM | {"x-fake-delay": "30"},
                timeout=60,
            )
        except httpx.HTTPError as error:
            errors.append(error)

    caller = threading.Thread(target=call)
    caller.start()
    wait_for("the provider to receive it", lambda: len(provider.receipts()) > before)
    proxy.kill()
    proxy.process.wait(10)
    caller.join(30)
    assert errors, "the call outlived its serve"


def ledger_truth(ledger: str) -> tuple[Counter[str], dict[str, Any], list[float]]:
    """The ledger's calls by state, its root ``team`` and its calls' costs."""
    calls = json.loads(effectguard("calls", "--json", "--ledger", ledger))
    roots = json.loads(effectguard("budgets", "--json", "--ledger", ledger))
    (team,) = [r for r in roots if r["path"] == "team"]
    costs = [float(c["cost_usd"] or 0) for c in calls]
    return Counter(c["stage"] for c in calls), team, costs


def test_cost_outcomes_and_unknown_effects_agree_with_the_ledger(tmp_path: Path) -> None:
    ledger = str(tmp_path / "ledger.db")
    effectguard("migrate", "--ledger", ledger)
    effectguard("budget", "set", "team", "--limit", "10", "--period", "month", "--ledger", ledger)
    http = httpx.Client(timeout=10)
    started: list[Proxy] = []
    prom: Prometheus | None = None
    with fake_provider(tmp_path / "receipts.jsonl") as provider:
        upstreams = {"openai": provider.url}
        try:
            port = free_port()
            first = start_proxy(ledger, upstreams=upstreams, port=port)
            started.append(first)
            prom = start_prometheus(tmp_path, [f"127.0.0.1:{port}"], http)
            began = scraped_after(prom, 0, "effectguard_ledger_up", 1)
            # A first request, scraped, before the rest: a process's first request of a
            # model makes that model's series, and later first counts come later.
            opening = httpx.post(first.url + CHAT, json=chat("opening"), headers=TEAM)
            assert opening.status_code == 200, opening.text
            scraped_after(prom, began, "sum(effectguard_requests_total)", 1)
            send_mix(first)
            total = "sum(effectguard_requests_total)"
            before_kill = scraped_after(prom, began, total, 7)
            kill_mid_call(first, provider)
            second = start_proxy(ledger, upstreams=upstreams, port=port)
            started.append(second)
            with httpx.Client(base_url=second.url, timeout=10) as client:
                for i in range(2):
                    assert (
                        client.post(CHAT, json=chat(f"after {i}"), headers=TEAM).status_code == 200
                    )
            states, team, costs = ledger_truth(ledger)
            assert states == {
                "completed": 6,
                "failed": 1,
                "not_processed": 1,
                "effect_unknown": 2,
            }, states
            unknown = "max(effectguard_effect_unknown_calls)"
            end = scraped_after(prom, before_kill, unknown, 2)
            end = max(end, scraped_after(prom, before_kill, total, 2))
            outcomes1, cost1 = counted(prom, before_kill)
            outcomes2, cost2 = counted(prom, end)
            # The killed call is in the ledger; no process lived to count it.
            expected = Counter(states)
            expected["effect_unknown"] -= 1
            assert Counter(outcomes1) + Counter(outcomes2) == expected
            assert cost1 + cost2 == pytest_approx(Decimal(team["spent_usd"]))
            (shown_unknown,) = panel("Unknown effects")
            assert prom.value(concrete(shown_unknown), at=end) == 2
            (shown_held,) = panel("Held by unknown effects")
            held = prom.value(concrete(shown_held), at=end)
            assert held == pytest_approx(Decimal(team["held_usd"]))
            assert held and held > 0
            # The restart is a counter reset, which rate() and increase() step over.
            completed = 'effectguard_requests_total{outcome="completed"}'
            assert prom.value(f"sum(resets({completed}[1m] @ {end:.3f}))") == 1
            window = f"{max(1, round(end - before_kill + 1))}s"
            increase = prom.value(f"sum(increase({completed}[{window}] @ {end:.3f}))")
            assert increase is not None and increase >= 2
            # What the rate panels add up since Prometheus began. increase() extrapolates,
            # never below what it saw counted; but a series born at its first count has no
            # earlier sample. Only each process's first request of the model may be missed
            # so (docs/metrics.md): once every rare outcome's first count was, the one
            # effect_unknown, failed and not_processed here included.
            whole = f"{round(end - began) + 60}s"
            rated = {
                r["metric"]["outcome"]: float(r["value"][1])
                for r in prom.query(
                    f"sum by (outcome) (increase(effectguard_requests_total[{whole}]))", at=end
                )
            }
            first = Counter({"completed": 2})  # one per process: its first request
            short = {
                o: (rated.get(o, 0.0), n)
                for o, n in (expected - first).items()
                if rated.get(o, 0.0) < n
            }
            assert not short, f"outcome: (rated, counted): {short}"
            firsts = sum(sorted(costs, reverse=True)[:2])  # at most the two largest calls
            rated_cost = prom.value(f"sum(increase(effectguard_cost_usd_total[{whole}]))", at=end)
            assert (rated_cost or 0.0) >= (cost1 + cost2 - firsts) * (1 - 1e-9)
        finally:
            if prom is not None:
                prom.stop()
            for proxy in started:
                proxy.kill()
                proxy.process.wait(10)
            http.close()


def pytest_approx(value: Decimal) -> Any:
    """``value`` as a float, compared within float rounding."""
    return pytest.approx(float(value), rel=1e-9, abs=1e-12)
