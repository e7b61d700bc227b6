"""Metrics, the Grafana dashboard and the alert rules against a real Prometheus (contract §10).

One stack per module: the fake provider; an effectguard that dies (SIGKILL) right
after dispatching a request, leaving an effect-unknown call; a restarted
effectguard on the same ledger serving completions, a replay and refusals; and
Prometheus on loopback scraping it every second. Every query of every dashboard
panel is then evaluated through Prometheus' HTTP API.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
from promkit import (
    ALERTS,
    ALERTS_TEST,
    CHAT,
    DASHBOARD,
    NEEDS_PROMETHEUS,
    PROMETHEUS_YML,
    Prometheus,
    chat,
    concrete,
    dashboard_queries,
    effectguard,
    panel,
    scrape_value,
    start_prometheus,
    wait_for,
)

from effectguard.rules import periods
from effectguard.testing import FakeProvider, Proxy, fake_provider, free_port, start_proxy

pytestmark = NEEDS_PROMETHEUS


@dataclass
class Stack:
    """The running processes and what the test needs to know about them."""

    tmp: Path
    ledger: Path
    provider: FakeProvider
    proxy: Proxy
    prometheus: Prometheus
    port: int
    started: list[Proxy]
    #: The statuses of the requests to the rpm-1 budget ``rated``.
    rated: list[int]


#: Requests sent to the rpm-1 budget: any three span at most two minutes (they take far
#: less than one), so at most two are admitted and at least one is refused 429, wherever
#: a minute turns.
RATED_REQUESTS = 3


def drive_traffic(proxy: Proxy) -> list[int]:
    """Completions, a replay and refusals (402 budget, 429 rate, 409 effect unknown, 400,
    404); returns the statuses of the requests to the rate-limited budget."""
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        for i in range(3):
            assert client.post(CHAT, json=chat(f"hello {i}")).status_code == 200
        for _ in range(2):  # the second is replayed from the ledger
            response = client.post(CHAT, json=chat("keyed"), headers={"idempotency-key": "k-1"})
            assert response.status_code == 200
        capped = client.post(CHAT, json=chat("pricey"), headers={"effectguard-budget": "capped"})
        assert capped.status_code == 402, capped.text
        limited = [
            client.post(CHAT, json=chat(f"rated {i}"), headers={"effectguard-budget": "rated"})
            for i in range(RATED_REQUESTS)
        ]
        statuses = [r.status_code for r in limited]
        assert set(statuses) <= {200, 429} and 429 in statuses, statuses
        assert all(r.json()["error"]["type"] == "rate_limited" for r in limited if r.is_error)
        unknown = client.post(CHAT, json=chat("crash"), headers={"idempotency-key": "crash-1"})
        assert unknown.status_code == 409, unknown.text
        assert client.post(CHAT, json=chat("x", model="no-such-model")).status_code == 400
        assert client.post("/nope/v1/chat/completions", json=chat("x")).status_code == 404
    return statuses


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Crash one effectguard mid-call, restart it, drive traffic, let Prometheus scrape it."""
    tmp = tmp_path_factory.mktemp("prom")
    http = httpx.Client(timeout=10)
    ledger = tmp / "ledger.db"
    started: list[Proxy] = []
    prometheus: Prometheus | None = None
    with fake_provider(tmp / "receipts.jsonl") as provider:
        upstreams = {"openai": provider.url}
        try:
            crashing = start_proxy(
                ledger, upstreams=upstreams, env={"EFFECTGUARD_CRASH_AT": "after:dispatch"}
            )
            started.append(crashing)
            with pytest.raises(httpx.HTTPError):
                httpx.post(
                    crashing.url + CHAT,
                    json=chat("crash"),
                    headers={"idempotency-key": "crash-1"},
                    timeout=10,
                )
            crashing.process.wait(10)
            effectguard(
                "budget", "set", "capped", "--limit", "0.000001", "--period", "day",
                "--ledger", str(ledger),
            )  # fmt: skip
            effectguard("budget", "set", "rated", "--rpm", "1", "--ledger", str(ledger))
            effectguard(
                "budget", "set", "default", "--limit", "100", "--period", "month",
                "--ledger", str(ledger),
            )  # fmt: skip
            port = free_port()
            proxy = start_proxy(ledger, upstreams=upstreams, port=port)
            started.append(proxy)
            unknown = 'effectguard_effect_unknown_calls{provider="openai"}'
            wait_for(
                "the sweeper to mark the call", lambda: scrape_value(http, proxy, unknown) == 1.0
            )
            rated = drive_traffic(proxy)
            prometheus = start_prometheus(tmp, [f"127.0.0.1:{port}"], http)
            prom = prometheus
            wait_for(  # Prometheus applies new targets only after ~5 s
                "three scrapes",
                lambda: (prom.value("count_over_time(effectguard_ledger_up[1m])") or 0) >= 3,
                timeout=40,
            )
            yield Stack(tmp, ledger, provider, proxy, prometheus, port, started, rated)
        finally:
            if prometheus is not None:
                prometheus.stop()
            for proxy_ in started:
                proxy_.kill()
                proxy_.process.wait(10)
            http.close()


def test_every_dashboard_query_returns_data(stack: Stack) -> None:
    """Every expr of every dashboard panel returns a non-empty result from real Prometheus."""
    queries = dashboard_queries()
    assert len(queries) >= 20
    empty = [
        f"{title}: {concrete(expr)}"
        for title, expr in queries
        if not stack.prometheus.query(concrete(expr))
    ]
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)


def test_template_variables_find_values(stack: Stack) -> None:
    """The dashboard's provider, budget and deployment (job) variables list the values the
    stack produced."""
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    expected = {"provider": "openai", "budget": "capped", "job": "effectguard"}
    for name, value in expected.items():
        match = re.fullmatch(r"label_values\((\w+), (\w+)\)", variables[name]["definition"])
        assert match is not None, variables[name]
        metric, label = match.groups()
        assert label == name
        response = stack.prometheus.http.get(
            f"{stack.prometheus.url}/api/v1/label/{label}/values", params={"match[]": metric}
        )
        assert value in response.json()["data"]


def test_panel_values_match_the_traffic(stack: Stack) -> None:
    """The ledger gauges and counters Prometheus scraped agree with the traffic driven."""
    prom = stack.prometheus
    assert prom.value('max(effectguard_effect_unknown_calls{provider="openai"})') == 1
    assert (prom.value('max(effectguard_effect_unknown_held_usd{provider="openai"})') or 0) > 0
    assert prom.value('max(effectguard_budget_limit_usd{budget="capped"})') == pytest.approx(1e-6)
    assert (prom.value('max(effectguard_budget_spent_usd{budget="default"})') or 0) > 0
    outcomes = {
        r["metric"]["outcome"]: float(r["value"][1])
        for r in prom.query("sum by (outcome) (effectguard_requests_total) > 0")
    }  # the other outcomes are there at 0 (docs/metrics.md: a series' first count)
    # 3, the keyed call, and the rated calls admitted (one or two: a minute may turn).
    assert outcomes == {"completed": 4 + stack.rated.count(200), "replayed": 1}
    reasons = {r["metric"]["reason"] for r in prom.query("effectguard_refusals_total")}
    assert {"budget_exceeded", "effect_unknown", "rate_limited"} <= reasons
    assert prom.value("sum(effectguard_replays_total)") == 1


def test_the_rate_limit_panel_counts_the_429s_sent(stack: Stack) -> None:
    """ "Rate-limit refusals" counts exactly the 429s the rated budget answered: its counter
    (the panel's selector without the rate) equals them, by provider."""
    (expr,) = panel("Rate-limit refusals")
    counter, replaced = re.subn(r"rate\((.*)\[\$__rate_interval\]\)", r"\1", expr)
    assert replaced == 1, expr
    counted = {
        r["metric"]["provider"]: float(r["value"][1])
        for r in stack.prometheus.query(concrete(counter))
    }  # every declared provider is there, the others at 0 (docs/metrics.md)
    assert {p: n for p, n in counted.items() if n} == {"openai": stack.rated.count(429)}
    assert stack.rated.count(429) >= 1


def test_the_period_panel_shows_each_budgets_use_of_its_current_period(stack: Stack) -> None:
    """ "Budget use this period" shows, for each root with a calendar period (and only
    those), (spent + reserved + held) / limit of the period `effectguard budgets` shows,
    and the period-end gauge behind its "resets in" is the end of that period."""
    use, resets_in = (concrete(e) for e in panel("Budget use this period"))

    def budgets() -> dict[str, dict[str, Any]]:
        listed = effectguard("budgets", "--json", "--ledger", str(stack.ledger))
        return {n["path"]: n for n in json.loads(listed) if n["resets"] != "total"}

    before = budgets()
    shown = {r["metric"]["budget"]: float(r["value"][1]) for r in stack.prometheus.query(use)}
    end_expr = resets_in.replace(" - time()", "")
    assert end_expr != resets_in, resets_in
    ends = {r["metric"]["budget"]: float(r["value"][1]) for r in stack.prometheus.query(end_expr)}
    after = budgets()  # a period may end between the reads: either side is right
    assert set(shown) == set(ends) == set(before) == {"capped", "default"}
    for path, value in shown.items():
        expected = set()
        for node in (before[path], after[path]):
            used = sum(Decimal(node[f]) for f in ("spent_usd", "reserved_usd", "held_usd"))
            bounds = periods.bounds(node["period"], node["tz"])
            assert bounds is not None
            expected.add((float(used / Decimal(node["limit_usd"])), bounds[1]))
        assert any(
            value == pytest.approx(ratio) and ends[path] == end for ratio, end in expected
        ), (path, value, ends[path], expected)
    assert shown["default"] > 0  # the traffic's spending is this month's


def test_alert_rules_pass_promtool() -> None:
    """`promtool check config` accepts the shipped scrape config (its rule file included),
    `promtool check rules` the rules, and `promtool test rules` passes their tests."""
    for command in (
        ["check", "config", str(PROMETHEUS_YML)],
        ["check", "rules", str(ALERTS)],
        ["test", "rules", str(ALERTS_TEST)],
    ):
        done = subprocess.run(
            ["promtool", *command], capture_output=True, text=True, timeout=30, check=False
        )
        assert done.returncode == 0, done.stdout + done.stderr


def test_budget_use_panels_divide_each_ledgers_money_by_its_own_limit(tmp_path: Path) -> None:
    """One Prometheus scraping two ledgers (two deployments, each its own scrape job, each
    with a root ``team-a``): the budget-use panels show each ledger's own ratio, never one
    ledger's money over the other's limit, and the period panel only the root with a
    period (``promtool test rules`` evaluates them on synthetic series)."""
    gauges: dict[str, dict[str, float]] = {  # job: team-a's series there
        "effectguard": {"limit_usd": 100, "spent_usd": 95, "period_end_timestamp_seconds": 2e9},
        "effectguard-staging": {"limit_usd": 1000, "spent_usd": 10},
    }
    series = [
        {
            "series": f'effectguard_budget_{name}{{budget="team-a", instance="{job}:1", '
            f'job="{job}"}}',
            "values": f"{value}x5",
        }
        for job, values in gauges.items()
        for name, value in {**values, "reserved_usd": 0, "held_usd": 0}.items()
    ]
    prod, staging = (f'{{budget="team-a", job="{job}"}}' for job in gauges)
    expected = {
        "Budget use per root": [
            {"labels": prod, "value": 0.95},
            {"labels": staging, "value": 0.01},
        ],
        "Budget use this period": [{"labels": prod, "value": 0.95}],
    }
    tests = [
        {"expr": concrete(panel(title)[0]), "eval_time": "1m", "exp_samples": samples}
        for title, samples in expected.items()
    ]
    unit = tmp_path / "panels.test.yml"  # JSON is YAML
    unit.write_text(
        json.dumps(
            {"tests": [{"interval": "1m", "input_series": series, "promql_expr_test": tests}]}
        )
    )
    done = subprocess.run(
        ["promtool", "test", "rules", str(unit)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_latency_panels_show_an_upstream_that_times_out(tmp_path: Path) -> None:
    """One attempt in four answered within 0.5 s, three timed out at 10 s: the latency
    panel's p50 and p99 show the timeouts (once only answered attempts were timed, and
    the panel showed 0.5 s), and the attempts panel counts each ending per second, by provider
    (``promtool test rules`` on synthetic series)."""
    base = 'effectguard_upstream_duration_seconds_{}{{provider="openai", outcome="{}"{}}}'
    per_step = {"answered": 15, "timeout": 45}  # a step is 15 s: 1 and 3 per second
    within = {"answered": {"0.5", "10", "+Inf"}, "timeout": {"10", "+Inf"}}
    series = [
        {"series": base.format("bucket", outcome, f', le="{le}"'), "values": f"0+{n}x8"}
        for outcome, n in per_step.items()
        for le in ("0.5", "10", "+Inf")
        if le in within[outcome]
    ] + [{"series": base.format("bucket", "timeout", ', le="0.5"'), "values": "0x8"}]
    series += [
        {"series": base.format("count", outcome, ""), "values": f"0+{n}x8"}
        for outcome, n in per_step.items()
    ]
    p50, p99 = panel("Upstream latency vs. effectguard overhead")[:2]
    tests = [
        {"expr": f"({concrete(e)}) > bool 3", "eval_time": "2m", "exp_samples": [{"value": 1}]}
        for e in (p50, p99)
    ]
    (attempts,) = panel("Upstream attempts by ending")
    tests.append(
        {
            "expr": concrete(attempts),
            "eval_time": "2m",
            "exp_samples": [
                {"labels": '{outcome="answered", provider="openai"}', "value": 1},
                {"labels": '{outcome="timeout", provider="openai"}', "value": 3},
            ],
        }
    )
    unit = tmp_path / "latency.test.yml"  # JSON is YAML
    unit.write_text(
        json.dumps(
            {"tests": [{"interval": "15s", "input_series": series, "promql_expr_test": tests}]}
        )
    )
    done = subprocess.run(
        ["promtool", "test", "rules", str(unit)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_rules_evaluate_cleanly_and_unknown_effect_alert_fires(stack: Stack) -> None:
    """Prometheus evaluates every shipped rule without error; the stale-unknown-effect
    expression with its age threshold lowered to 0 fires for the crashed call."""
    prom = stack.prometheus

    def rules() -> list[dict[str, Any]]:
        groups = prom.http.get(prom.url + "/api/v1/rules").json()["data"]["groups"]
        found = [rule for group in groups for rule in group["rules"]]
        return found if found and all("lastEvaluation" in r for r in found) else []

    loaded = wait_for("the rules to be evaluated", rules)
    assert {r["name"] for r in loaded} >= {
        "EffectguardUnknownEffectStale",
        "EffectguardBudgetNearLimit",
        "EffectguardLedgerCommitsFailing",
        "EffectguardLedgerUnreadable",
        "EffectguardJobMixesLedgers",
        "EffectguardDown",
    }
    assert all(r["health"] == "ok" for r in loaded), loaded
    down = next(r for r in loaded if r["name"] == "EffectguardDown")
    assert down["state"] == "inactive" and not down["alerts"], down  # the target is scraped
    mixed = next(r for r in loaded if r["name"] == "EffectguardJobMixesLedgers")
    assert mixed["state"] == "inactive" and not mixed["alerts"], mixed  # one ledger
    stale = next(r for r in loaded if r["name"] == "EffectguardUnknownEffectStale")
    lowered, replaced = re.subn(r">\s*[0-9.]+\s*$", "> 0", stale["query"].strip())
    assert replaced == 1, stale["query"]
    firing = prom.query(lowered)
    assert [r["metric"]["provider"] for r in firing] == ["openai"]


def test_down_alert_and_panel_for_targets_that_answer_no_scrape(
    tmp_path: Path, stack: Stack
) -> None:
    """With the shipped config and rules, `EffectguardDown` goes pending for each target
    Prometheus cannot scrape: a port nobody listens on, an effectguard with a proxy key
    (its /metrics answers 401 to the keyless scrape), and one scraped and then killed;
    the dashboard's "Scraped, ledger readable" then shows 0 for both, not nothing (where
    Grafana's last-value stat showed the killed one's last 1)."""
    ledger = tmp_path / "keyed.db"
    effectguard("migrate", "--ledger", str(ledger))
    effectguard("key", "new", "--root", "team-k", "--ledger", str(ledger))
    upstreams = {"openai": stack.provider.url}
    keyed = start_proxy(ledger, upstreams=upstreams)
    healthy = start_proxy(tmp_path / "healthy.db", upstreams=upstreams)
    stack.started += [keyed, healthy]
    assert stack.prometheus.http.get(keyed.url + "/metrics").status_code == 401
    targets = [f"127.0.0.1:{free_port()}"] + [
        p.url.removeprefix("http://") for p in (keyed, healthy)
    ]
    prom = start_prometheus(tmp_path, targets, stack.prometheus.http)
    try:
        ledger_up = "min(effectguard_ledger_up)"
        wait_for("a scrape of the healthy one", lambda: prom.value(ledger_up) == 1, timeout=40)
        healthy.kill()
        healthy.process.wait(10)

        def pending() -> list[dict[str, Any]]:
            groups = prom.http.get(prom.url + "/api/v1/rules").json()["data"]["groups"]
            rules = {r["name"]: r for group in groups for r in group["rules"]}
            alerts: list[dict[str, Any]] = rules["EffectguardDown"]["alerts"]
            return alerts if len(alerts) == len(targets) else []

        alerts = wait_for("EffectguardDown to be pending", pending, timeout=40)
        assert sorted(a["labels"]["instance"] for a in alerts) == sorted(targets)
        assert {a["labels"]["job"] for a in alerts} == {"effectguard"}
        assert {a["state"] for a in alerts} == {"pending"}  # it fires after 2 minutes
        shown = [prom.value(concrete(expr)) for expr in panel("Scraped, ledger readable")]
        assert shown == [0, 0]
    finally:
        prom.stop()


def test_unknown_effect_gauge_survives_restart_until_reconciled(stack: Stack) -> None:
    """After another restart the unknown-effect gauge still shows the call; once it is
    reconciled it drops to 0 (in /metrics and in Prometheus)."""
    stack.proxy.stop()
    proxy = start_proxy(stack.ledger, upstreams={"openai": stack.provider.url}, port=stack.port)
    stack.started.append(proxy)
    stack.proxy = proxy
    sample = 'effectguard_effect_unknown_calls{provider="openai"}'
    http = stack.prometheus.http
    wait_for("the gauge after the restart", lambda: scrape_value(http, proxy, sample) == 1.0)
    listed = json.loads(
        effectguard("calls", "--state", "effect_unknown", "--json", "--ledger", str(stack.ledger))
    )
    assert len(listed) == 1
    effectguard(
        "reconcile", listed[0]["call_id"], "--not-applied", "--note", "x",
        "--ledger", str(stack.ledger),
    )  # fmt: skip
    wait_for("the gauge to drop", lambda: scrape_value(http, proxy, sample) == 0.0)
    query = 'max(effectguard_effect_unknown_calls{provider="openai"})'
    wait_for("prometheus to see 0", lambda: stack.prometheus.value(query) == 0.0)
    oldest = "effectguard_effect_unknown_oldest_timestamp_seconds"
    assert scrape_value(http, proxy, oldest + '{provider="openai"}') is None
