"""A real Prometheus for tests (contract §10): the shipped scrape config and rules, the
dashboard's queries made concrete, and the CLI and polling helpers those tests share."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from effectguard.testing import Proxy, free_port

#: A Prometheus test module's marks (``pytestmark = NEEDS_PROMETHEUS``).
NEEDS_PROMETHEUS = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("prometheus") is None or shutil.which("promtool") is None,
        reason="needs prometheus and promtool (Debian package `prometheus`; .ci/run installs it)",
    ),
]

GRAFANA = Path(__file__).resolve().parent.parent / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "effectguard.json"
ALERTS = GRAFANA / "prometheus" / "alerts.yml"
ALERTS_TEST = GRAFANA / "prometheus" / "alerts.test.yml"
PROMETHEUS_YML = GRAFANA / "prometheus" / "prometheus.yml"
CHAT = "/openai/v1/chat/completions"
#: What the test substitutes for Grafana's built-in and template variables.
VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m"}
TEMPLATE_DEFAULT = ".*"


def chat(content: str, model: str = "gpt-4o-mini") -> dict[str, Any]:
    """A small chat completion request."""
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 5}


def effectguard(*args: str) -> str:
    """Run the effectguard CLI; its stdout."""
    done = subprocess.run(
        [sys.executable, "-m", "effectguard", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def wait_for(what: str, check: Callable[[], Any], timeout: float = 20.0) -> Any:
    """Poll ``check`` until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.25)


def scrape_value(http: httpx.Client, proxy: Proxy, sample: str) -> float | None:
    """One sample's value from the proxy's ``/metrics`` (exact series text)."""
    text = http.get(proxy.url + "/metrics").text
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name == sample:
            return float(value)
    return None


@dataclass
class Prometheus:
    """A Prometheus process on loopback and its HTTP API."""

    url: str
    process: subprocess.Popen[bytes]
    http: httpx.Client

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query's result vector, now or ``at`` (Unix time); raises on a
        query error."""
        params = {"query": expr} | ({} if at is None else {"time": f"{at:.3f}"})
        response = self.http.get(self.url + "/api/v1/query", params=params)
        body = response.json()
        assert body["status"] == "success", f"{expr}: {body.get('error')}"
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def value(self, expr: str, at: float | None = None) -> float | None:
        """The single value of a one-series query, or None if it has no data."""
        result = self.query(expr, at)
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> None:
        """Terminate, then kill."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


#: The shipped config's one scrape job: the dashboard and alerts name it.
JOB = "effectguard"


def shipped_config(targets: list[str], more_jobs: dict[str, list[str]] | None = None) -> str:
    """The shipped prometheus.yml, scraping ``targets`` every second with the shipped
    rules: only the intervals, the rule file's path and the targets differ. Each of
    ``more_jobs`` (job name: targets) is a copy of the shipped job under another name:
    another deployment, as docs/metrics.md tells an operator to add one."""
    config = PROMETHEUS_YML.read_text()
    for old, new in (
        ("scrape_interval: 15s", "scrape_interval: 1s"),
        ("evaluation_interval: 15s", "evaluation_interval: 1s"),
        ("  - alerts.yml", f"  - {json.dumps(str(ALERTS))}"),
    ):
        assert config.count(old) == 1, old
        config = config.replace(old, new)
    head, marker, job = config.partition("scrape_configs:\n")
    assert marker and job.count("job_name: effectguard ") == 1, config
    blocks = [job.replace('["127.0.0.1:8787"]', json.dumps(targets))]
    for name, its_targets in (more_jobs or {}).items():
        block = job.replace("job_name: effectguard ", f"job_name: {name} ")
        blocks.append(block.replace('["127.0.0.1:8787"]', json.dumps(its_targets)))
    return head + marker + "".join(blocks)


def start_prometheus(
    tmp: Path,
    targets: list[str],
    http: httpx.Client,
    more_jobs: dict[str, list[str]] | None = None,
) -> Prometheus:
    """Prometheus scraping ``targets`` (and ``more_jobs``) every second, with the shipped
    alert rules loaded."""
    config = tmp / "prometheus.yml"
    config.write_text(shipped_config(targets, more_jobs))
    port = free_port()
    log = (tmp / "prometheus.log").open("ab")
    process = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    prom = Prometheus(f"http://127.0.0.1:{port}", process, http)

    def ready() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"prometheus exited:\n{(tmp / 'prometheus.log').read_text()}")
        try:
            return http.get(prom.url + "/-/ready").status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for("prometheus to be ready", ready)
    except BaseException:
        prom.stop()
        raise
    return prom


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expr) for every target of every panel, rows included."""
    dashboard = json.loads(DASHBOARD.read_text())
    found: list[tuple[str, str]] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            found.extend((panel["title"], t["expr"]) for t in panel.get("targets", []))
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    return found


def concrete(expr: str) -> str:
    """``expr`` with Grafana's variables replaced by values Prometheus accepts."""
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    expr = re.sub(r"\$\{?(\w+)\}?", TEMPLATE_DEFAULT, expr)
    assert "$" not in expr, expr
    return expr


def panel(title: str) -> list[str]:
    """The exprs of the dashboard panel titled ``title``, in target order."""
    exprs = [expr for name, expr in dashboard_queries() if name == title]
    assert exprs, f"no panel {title!r}"
    return exprs
