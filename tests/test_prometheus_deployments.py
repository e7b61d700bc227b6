"""The dashboard with one Prometheus scraping several deployments (contract §10).

Three deployments, each its own scrape job as docs/metrics.md says: ``effectguard``, two
replicas on one PostgreSQL schema (one SQLite replica without a server); ``eg-staging``
and ``eg-dev``, one ``serve`` each on a SQLite ledger of its own. Every ledger has a root
``team`` with its own limit, its own completed calls and its own effect-unknown calls
(a ``serve`` killed right after dispatching). Each panel's expression, read from the
dashboard's JSON, must show every deployment apart, with its own ledger's figures as
`effectguard calls` and `effectguard budgets` tell them: not the largest of the three
(the ``max by`` that merged them), and not a replica's figure counted twice.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
from pgkit import DSN, scratch_schema
from promkit import (
    CHAT,
    JOB,
    NEEDS_PROMETHEUS,
    Prometheus,
    chat,
    concrete,
    effectguard,
    panel,
    scrape_value,
    start_prometheus,
    wait_for,
)

from effectguard.testing import Proxy, fake_provider, start_proxy

pytestmark = NEEDS_PROMETHEUS

#: Per deployment (job): the root ``team``'s limit and period, completions, unknown calls.
PLAN: dict[str, tuple[str, str, int, int]] = {
    JOB: ("10", "month", 3, 1),
    "eg-staging": ("0.5", "month", 1, 2),
    "eg-dev": ("100", "total", 2, 0),
}
TEAM = {"effectguard-budget": "team"}


@dataclass
class Deployment:
    """One deployment: its ledger and the replicas serving it."""

    job: str
    ledger: str
    replicas: list[Proxy]


def crash_one_call(ledger: str, upstreams: dict[str, str], content: str, log: Path) -> None:
    """A ``serve`` that dies (SIGKILL) right after dispatching one call: effect unknown."""
    crashing = start_proxy(
        ledger,
        upstreams=upstreams,
        env={"EFFECTGUARD_CRASH_AT": "after:dispatch"},
        log_path=log,
    )
    try:
        with pytest.raises(httpx.HTTPError):
            httpx.post(crashing.url + CHAT, json=chat(content), headers=TEAM, timeout=10)
        crashing.process.wait(10)
    finally:
        crashing.kill()


def set_up(
    job: str,
    ledger: str,
    upstreams: dict[str, str],
    started: list[Proxy],
    http: httpx.Client,
    logs: Path,
) -> Deployment:
    """The deployment ``job`` on ``ledger``, as PLAN says; two replicas on PostgreSQL."""
    limit, period, completions, unknowns = PLAN[job]
    effectguard("migrate", "--ledger", ledger)
    effectguard("budget", "set", "team", "--limit", limit, "--period", period, "--ledger", ledger)
    for i in range(unknowns):
        crash_one_call(ledger, upstreams, f"{job} lost {i}", logs / f"{job}.crash-{i}.log")
    replicas = [start_proxy(ledger, upstreams=upstreams, log_path=logs / f"{job}.0.log")]
    if ledger.startswith("postgresql"):
        replicas.append(start_proxy(ledger, upstreams=upstreams, log_path=logs / f"{job}.1.log"))
    started.extend(replicas)
    sample = 'effectguard_effect_unknown_calls{provider="openai"}'
    for replica in replicas if unknowns else []:  # the sweeper marks the crashed calls
        wait_for(
            f"{job}'s unknown calls",
            lambda r=replica: scrape_value(http, r, sample) == float(unknowns),
        )
    for i in range(completions):  # spread over the replicas: each counts its own
        replica = replicas[i % len(replicas)]
        response = httpx.post(replica.url + CHAT, json=chat(f"{job} {i}"), headers=TEAM)
        assert response.status_code == 200, response.text
    return Deployment(job, ledger, replicas)


@pytest.fixture(scope="module")
def deployments(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Prometheus, list[Deployment]]]:
    """The three deployments, scraped every second by one Prometheus."""
    tmp = tmp_path_factory.mktemp("deployments")
    started: list[Proxy] = []
    prometheus: Prometheus | None = None
    http = httpx.Client(timeout=10)
    with (
        fake_provider(tmp / "receipts.jsonl") as provider,
        scratch_schema("eg_dash_") if DSN else nullcontext(str(tmp / "prod.db")) as prod,
    ):
        upstreams = {"openai": provider.url}
        try:
            ledgers = {JOB: prod, "eg-staging": str(tmp / "staging.db")}
            ledgers["eg-dev"] = str(tmp / "dev.db")
            found = [
                set_up(job, ledger, upstreams, started, http, tmp)
                for job, ledger in ledgers.items()
            ]
            targets = {d.job: [r.url.removeprefix("http://") for r in d.replicas] for d in found}
            prometheus = start_prometheus(tmp, targets.pop(JOB), http, more_jobs=targets)
            prom = prometheus
            every = len(started)
            wait_for(  # Prometheus applies new targets only after ~5 s
                "every replica scraped",
                lambda: len(prom.query("effectguard_ledger_up == 1")) == every,
                timeout=40,
            )
            yield prometheus, found
        finally:
            if prometheus is not None:
                prometheus.stop()
            for proxy in started:
                proxy.kill()
                proxy.process.wait(10)
            http.close()


def by_job(prom: Prometheus, expr: str, *labels: str) -> dict[tuple[str, ...], float]:
    """An expression's values keyed by (job, *labels): each series must name its job."""
    result = prom.query(concrete(expr))
    keyed = {
        (r["metric"].get("job", "?"), *(r["metric"].get(label, "?") for label in labels)): float(
            r["value"][1]
        )
        for r in result
    }
    assert len(keyed) == len(result), result
    return keyed


def truth(deployment: Deployment) -> dict[str, Any]:
    """The deployment's ledger, as the CLI reads it: its unknown calls and root ``team``."""
    unknown = json.loads(
        effectguard("calls", "--state", "effect_unknown", "--json", "--ledger", deployment.ledger)
    )
    roots = json.loads(effectguard("budgets", "--json", "--ledger", deployment.ledger))
    (team,) = [r for r in roots if r["path"] == "team"]
    return {"unknown": len(unknown), "team": team}


def money(node: dict[str, Any], *fields: str) -> float:
    """The sum of a budget node's ``fields`` (``spent``, ``reserved``, ``held``)."""
    return float(sum(Decimal(node[f"{f}_usd"]) for f in fields))


def test_ledger_gauge_panels_show_each_deployment_once(
    deployments: tuple[Prometheus, list[Deployment]],
) -> None:
    """The unknown-effect, in-flight and budget panels show one value per deployment, its
    own ledger's, however many of its replicas are scraped."""
    prom, found = deployments
    truths = {d.job: truth(d) for d in found}
    assert [truths[job]["unknown"] for job in PLAN] == [p[3] for p in PLAN.values()]
    (unknown,) = panel("Unknown effects")
    assert by_job(prom, unknown) == {(j,): t["unknown"] for j, t in truths.items()}
    (held,) = panel("Held by unknown effects")
    assert by_job(prom, held) == pytest.approx(
        {(j,): money(t["team"], "held") for j, t in truths.items()}
    )
    (in_flight,) = panel("Calls in flight")
    assert by_job(prom, in_flight) == {(j,): 0 for j in truths}
    (oldest,) = panel("Oldest unknown effect")
    assert set(by_job(prom, oldest)) == {(j,) for j, t in truths.items() if t["unknown"]}
    by_provider, _ = panel("Unknown effects by provider")
    shown = by_job(prom, by_provider, "provider")  # every declared provider: others at 0
    assert {k: n for k, n in shown.items() if k[1] == "openai"} == {
        (j, "openai"): t["unknown"] for j, t in truths.items()
    }
    assert not {k: n for k, n in shown.items() if k[1] != "openai" and n}
    (use,) = panel("Budget use per root")
    assert by_job(prom, use, "budget") == pytest.approx(
        {
            (j, "team"): money(t["team"], "spent", "reserved", "held")
            / float(t["team"]["limit_usd"])
            for j, t in truths.items()
        }
    )
    spent, limit = panel("Spent against limit")
    assert by_job(prom, spent, "budget") == pytest.approx(
        {(j, "team"): money(t["team"], "spent") for j, t in truths.items()}
    )
    assert by_job(prom, limit, "budget") == pytest.approx(
        {(j, "team"): float(t["team"]["limit_usd"]) for j, t in truths.items()}
    )
    period_use, _ = panel("Budget use this period")
    assert set(by_job(prom, period_use, "budget")) == {
        (j, "team") for j, plan in PLAN.items() if plan[1] != "total"
    }


def counter_of(expr: str) -> str:
    """A rate panel's expression over its counters themselves: what the replicas counted."""
    counter, replaced = re.subn(r"rate\((.*?)\[\$__rate_interval\]\)", r"\1", expr)
    assert replaced == 1, expr
    return counter.removesuffix(" * 3600")


def test_counter_panels_show_each_deployment_apart(
    deployments: tuple[Prometheus, list[Deployment]],
) -> None:
    """Spend and requests are each deployment's own: its replicas' counters summed, equal
    to what its ledger settled (the crashed calls were never completed)."""
    prom, found = deployments
    truths = {d.job: truth(d) for d in found}
    (spend,) = panel("Spend rate by provider and model")
    spent = by_job(prom, f"({counter_of(spend)}) > 0", "provider")  # the others are at 0
    assert spent == pytest.approx(
        {(j, "openai"): money(t["team"], "spent") for j, t in truths.items()}
    )
    requests = panel("Requests by outcome")[0]  # then the internal errors
    assert by_job(prom, f"({counter_of(requests)}) > 0", "outcome") == {
        (j, "completed"): plan[2] for j, plan in PLAN.items()
    }


def test_each_deployment_names_its_ledger(
    deployments: tuple[Prometheus, list[Deployment]],
) -> None:
    """``effectguard_ledger_info`` names each replica's ledger (its store, and a hash of
    where it is, never the URL): the replicas of one deployment agree, the deployments
    differ, so the query docs/metrics.md gives finds a job that mixes ledgers."""
    prom, found = deployments
    info = prom.query("effectguard_ledger_info")
    assert len(info) == sum(len(d.replicas) for d in found), info
    ledgers = {(r["metric"]["job"], r["metric"]["ledger"], r["metric"]["store"]) for r in info}
    assert {job for job, _, _ in ledgers} == set(PLAN)
    assert len(ledgers) == len(PLAN), ledgers  # one per job, none shared
    stores = {job: store for job, _, store in ledgers}
    assert stores == {JOB: "postgresql" if DSN else "sqlite"} | {
        job: "sqlite" for job in PLAN if job != JOB
    }
    assert not any("postgres" in r["metric"]["ledger"] for r in info)
    mixed = "count by (job) (count by (job, ledger) (effectguard_ledger_info)) > 1"
    assert prom.query(mixed) == []
    merged = "count(count by (ledger) (effectguard_ledger_info))"
    assert prom.value(merged) == len(PLAN)
