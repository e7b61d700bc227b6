"""The proxy benchmark: the fake provider direct, the bare baseline, ``effectguard serve``.

All three answer the same request at the same concurrency, one after another,
so each effectguard figure has a baseline figure from the same minute on the
same machine. Added latency is a target's percentile minus the direct one.
The two proxies run on the proxy CPU; the fake provider and the load
generator run on the others.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from effectguard.testing import free_port
from effectguard_bench.loadgen import Load, LoadRunner, request_body
from effectguard_bench.processes import (
    Child,
    Pinning,
    first_served,
    python_module,
    spawn,
    warm_up,
)

TARGETS = ("direct", "baseline", "effectguard")
SCENARIOS = ("plain", "stream")
CHAT = "/v1/chat/completions"
_START_TIMEOUT = 30.0
_WARM_UP_REQUESTS = 200
_WARM_UP_S = 1.0


@dataclass(frozen=True, slots=True)
class Sample:
    """One target under one load; CPU and memory are the proxy process's (None for direct)."""

    scenario: str
    concurrency: int
    target: str
    load: Load
    cpu_ms_per_request: float | None = None
    rss_mb: float | None = None
    peak_rss_mb: float | None = None

    def to_json(self) -> dict[str, Any]:
        """The sample as a JSON-ready dict."""
        return {
            "scenario": self.scenario,
            "concurrency": self.concurrency,
            "target": self.target,
            **self.load.to_json(),
            "cpu_ms_per_request": _round(self.cpu_ms_per_request),
            "rss_mb": _round(self.rss_mb),
            "peak_rss_mb": _round(self.peak_rss_mb),
        }


@dataclass
class ProxyResult:
    """Every sample, the streams' time-to-first-byte, and each proxy's start-up time."""

    samples: list[Sample] = field(default_factory=list)
    ttfb: dict[str, Load] = field(default_factory=dict)
    start_to_first_served_s: dict[str, float] = field(default_factory=dict)

    def sample(self, scenario: str, concurrency: int, target: str) -> Sample | None:
        """The sample for one cell of the table, if it was measured."""
        return next(
            (
                s
                for s in self.samples
                if (s.scenario, s.concurrency, s.target) == (scenario, concurrency, target)
            ),
            None,
        )


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _start_proxy(name: str, command: list[str], pins: Pinning, work: Path, port: int) -> Child:
    child = spawn(name, command, pins.proxy, work / f"{name}.log")
    child.url = f"http://127.0.0.1:{port}"
    return child


def _started(child: Child, port: int, log: Path) -> float:
    try:
        return first_served(
            child, "127.0.0.1", port, "/openai" + CHAT, request_body(False), _START_TIMEOUT
        )
    except RuntimeError as exc:
        text = log.read_text(errors="replace") if log.exists() else ""
        raise RuntimeError(f"{exc}\n{text[-2000:]}") from exc


def _measure(
    runner: LoadRunner, child: Child | None, url: str, body: bytes, concurrency: int, seconds: float
) -> tuple[Load, float | None, float | None, float | None]:
    before = child.cpu_seconds() if child else 0.0
    load = runner.run(url, body, concurrency, seconds)
    if child is None:
        return load, None, None, None
    cpu = child.cpu_seconds() - before
    rss, peak = child.memory_mb()
    per_request = cpu * 1000 / load.requests if load.requests else None
    return load, per_request, rss, peak


def run(
    fake: Child,
    runner: LoadRunner,
    pins: Pinning,
    concurrencies: Sequence[int],
    duration: float,
    work: Path,
) -> ProxyResult:
    """Start the baseline and effectguard, then measure every scenario × concurrency × target."""
    result = ProxyResult()
    with contextlib.ExitStack() as stack:
        base_port, eg_port = free_port(), free_port()
        baseline = _start_proxy(
            "baseline",
            python_module(
                "effectguard_bench.baseline", "--port", str(base_port), "--upstream", fake.url
            ),
            pins,
            work,
            base_port,
        )
        stack.callback(baseline.stop)
        result.start_to_first_served_s["baseline"] = _started(
            baseline, base_port, work / "baseline.log"
        )
        ledger = work / "proxy-ledger.db"
        effectguard = _start_proxy(
            "effectguard",
            python_module(
                "effectguard",
                "serve",
                "--ledger",
                str(ledger),
                "--host",
                "127.0.0.1",
                "--port",
                str(eg_port),
                "--upstream",
                f"openai={fake.url}",
            ),
            pins,
            work,
            eg_port,
        )
        stack.callback(effectguard.stop)
        result.start_to_first_served_s["effectguard"] = _started(
            effectguard, eg_port, work / "effectguard.log"
        )
        proxies: dict[str, Child | None] = {
            "direct": None,
            "baseline": baseline,
            "effectguard": effectguard,
        }
        urls = {
            "direct": fake.url + CHAT,
            "baseline": baseline.url + "/openai" + CHAT,
            "effectguard": effectguard.url + "/openai" + CHAT,
        }
        for scenario in SCENARIOS:
            body = request_body(scenario == "stream")
            for port in (base_port, eg_port):
                warm_up(
                    "127.0.0.1",
                    port,
                    "/openai" + CHAT,
                    body,
                    _WARM_UP_REQUESTS,
                    min(_WARM_UP_S, duration / 2),
                )
            for concurrency in concurrencies:
                for target in TARGETS:
                    load, cpu, rss, peak = _measure(
                        runner, proxies[target], urls[target], body, concurrency, duration
                    )
                    result.samples.append(
                        Sample(scenario, concurrency, target, load, cpu, rss, peak)
                    )
        stream_body = request_body(True)
        for target in TARGETS:
            result.ttfb[target] = runner.ttfb(urls[target], stream_body, min(duration, 3.0))
    return result
