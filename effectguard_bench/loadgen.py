"""Load generators: ``wrk`` when installed, else a Python client in its own process.

Both run a fixed number of keep-alive connections, each sending the next
request as soon as the last answer is read, for a fixed duration, and report
requests, errors, and p50/p99 latency. Only the Python client measures
time-to-first-byte (the first body chunk of an answer), which is what a
streaming caller waits for.

``python -m effectguard_bench.loadgen --url URL --concurrency C --duration S
[--body-file F]`` prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from effectguard_bench.processes import python_module, run_pinned

MODEL = "gpt-4o-mini"  # priced by the bundled openai declaration


def request_body(stream: bool) -> bytes:
    """A small chat completion request, streaming or not."""
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say ok."}],
        "max_tokens": 16,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body, separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True)
class Load:
    """What one load run measured (latencies in milliseconds)."""

    tool: str
    concurrency: int
    requests: int
    errors: int
    seconds: float
    p50_ms: float
    p99_ms: float
    ttfb_p50_ms: float | None = None
    ttfb_p99_ms: float | None = None

    @classmethod
    def from_samples(
        cls,
        tool: str,
        concurrency: int,
        latencies: list[float],
        ttfbs: list[float],
        errors: int,
        seconds: float,
    ) -> Load:
        """A load from per-request latencies and times to first byte (in seconds)."""
        latencies, ttfbs = sorted(latencies), sorted(ttfbs)
        return cls(
            tool=tool,
            concurrency=concurrency,
            requests=len(latencies),
            errors=errors,
            seconds=seconds,
            p50_ms=percentile(latencies, 50) * 1000,
            p99_ms=percentile(latencies, 99) * 1000,
            ttfb_p50_ms=percentile(ttfbs, 50) * 1000,
            ttfb_p99_ms=percentile(ttfbs, 99) * 1000,
        )

    @property
    def rps(self) -> float:
        """Successful requests per second."""
        return self.requests / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        """The figures as a JSON-ready dict (with ``rps``)."""
        figures = asdict(self)
        for key in ("seconds", "p50_ms", "p99_ms", "ttfb_p50_ms", "ttfb_p99_ms"):
            if figures[key] is not None:
                figures[key] = round(figures[key], 3)
        return figures | {"rps": round(self.rps, 1)}


def have_wrk() -> bool:
    """Whether ``wrk`` is on the PATH."""
    return shutil.which("wrk") is not None


_WRK_SCRIPT = """\
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [==[{body}]==]
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '\\n{{"requests":%d,"duration_us":%d,"p50_us":%d,"p99_us":%d,"errors":%d,"status":%d}}\\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.connect + e.read + e.write + e.timeout, e.status))
end
"""


def run_wrk(
    url: str,
    body: bytes,
    concurrency: int,
    duration: float,
    cpus: frozenset[int] | None,
    work: Path,
) -> Load:
    """One ``wrk`` run (whole seconds: wrk takes no fractions)."""
    script = work / "post.lua"
    script.write_text(_WRK_SCRIPT.format(body=body.decode()))
    threads = max(1, min(concurrency, len(cpus) if cpus else 1))
    seconds = max(1, round(duration))
    command = ["wrk", f"-t{threads}", f"-c{concurrency}", f"-d{seconds}s", "--timeout", "10s"]
    command += ["-s", str(script), url]
    status, out, err = run_pinned(command, cpus, timeout=seconds + 30)
    line = next((x for x in out.splitlines() if x.startswith('{"requests"')), None)
    if status != 0 or line is None:
        raise RuntimeError(f"wrk failed ({status}): {err or out}")
    raw = json.loads(line)
    failed = raw["errors"] + raw["status"]
    return Load(
        tool="wrk",
        concurrency=concurrency,
        requests=max(0, raw["requests"] - raw["status"]),
        errors=failed,
        seconds=raw["duration_us"] / 1e6,
        p50_ms=raw["p50_us"] / 1000,
        p99_ms=raw["p99_us"] / 1000,
    )


def run_python(
    url: str,
    body: bytes,
    concurrency: int,
    duration: float,
    cpus: frozenset[int] | None,
    work: Path,
) -> Load:
    """One run of the Python client in a child process (so it has its own CPU)."""
    body_file = work / "body.json"
    body_file.write_bytes(body)
    command = python_module(
        "effectguard_bench.loadgen",
        "--url",
        url,
        "--concurrency",
        str(concurrency),
        "--duration",
        str(duration),
        "--body-file",
        str(body_file),
    )
    status, out, err = run_pinned(command, cpus, timeout=duration + 60)
    if status != 0:
        raise RuntimeError(f"load generator failed ({status}): {err}")
    return Load(**json.loads(out))


@dataclass(frozen=True, slots=True)
class LoadRunner:
    """Runs loads with one tool on the load CPUs; streams' TTFB always with the Python client."""

    tool: str
    cpus: frozenset[int] | None
    work: Path

    @classmethod
    def choose(cls, wanted: str, cpus: frozenset[int] | None, work: Path) -> LoadRunner:
        """``wanted`` is ``auto`` (wrk if installed), ``wrk`` or ``python``."""
        if wanted == "wrk" and not have_wrk():
            raise RuntimeError("--loadgen wrk: wrk is not installed (apt-get install wrk)")
        tool = "wrk" if wanted == "wrk" or (wanted == "auto" and have_wrk()) else "python"
        return cls(tool, cpus, work)

    def run(self, url: str, body: bytes, concurrency: int, duration: float) -> Load:
        """Requests, errors and latency percentiles for one load."""
        if self.tool == "wrk":
            return run_wrk(url, body, concurrency, duration, self.cpus, self.work)
        return run_python(url, body, concurrency, duration, self.cpus, self.work)

    def ttfb(self, url: str, body: bytes, duration: float) -> Load:
        """One caller, measuring time to the first body chunk as well."""
        return run_python(url, body, 1, duration, self.cpus, self.work)


def percentile(sorted_values: list[float], pct: float) -> float:
    """The nearest-rank ``pct`` percentile of an already sorted list (0 if empty)."""
    if not sorted_values:
        return 0.0
    rank = max(0, min(len(sorted_values) - 1, round(pct / 100 * len(sorted_values)) - 1))
    return sorted_values[rank]


async def client(url: str, body: bytes, concurrency: int, duration: float) -> Load:
    """``concurrency`` aiohttp workers posting ``body`` to ``url`` for ``duration`` seconds."""
    import aiohttp

    latencies: list[float] = []
    ttfbs: list[float] = []
    errors = 0
    headers = {"content-type": "application/json"}
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker(deadline: float) -> None:
            nonlocal errors
            while (started := time.perf_counter()) < deadline:
                try:
                    async with session.post(url, data=body, headers=headers) as response:
                        first = await response.content.readany()
                        ttfb = time.perf_counter() - started
                        while first and await response.content.readany():
                            pass
                        ok = response.status == 200
                except aiohttp.ClientError:
                    ok = False
                if not ok:
                    errors += 1
                    continue
                latencies.append(time.perf_counter() - started)
                ttfbs.append(ttfb)

        begin = time.perf_counter()
        await asyncio.gather(*(worker(begin + duration) for _ in range(concurrency)))
        elapsed = time.perf_counter() - begin
    return Load.from_samples("python", concurrency, latencies, ttfbs, errors, elapsed)


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``python -m effectguard_bench.loadgen``."""
    parser = argparse.ArgumentParser(prog="loadgen", description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="URL to POST to")
    parser.add_argument("--concurrency", type=int, default=1, help="connections (default 1)")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds (default 5)")
    parser.add_argument("--body-file", type=Path, help="request body (default: a chat request)")
    args = parser.parse_args(argv)
    body = args.body_file.read_bytes() if args.body_file else request_body(stream=False)
    load = asyncio.run(client(args.url, body, args.concurrency, args.duration))
    json.dump(asdict(load), sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
