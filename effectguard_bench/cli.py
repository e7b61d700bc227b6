"""``effectguard bench``: effectguard against a bare proxy, measured in the same run.

``effectguard bench [all|proxy|transport|ledger]`` starts the fake provider,
a bare pass-through proxy with no ledger (the baseline) and ``effectguard
serve`` on a fresh SQLite ledger, drives each with a load generator (``wrk``
when installed, else a Python client) at every ``--concurrency``, plain and
streaming, and prints one table: added latency (p50/p99 minus the fake
provider's own), requests per second, proxy CPU per request, RSS, streams'
time-to-first-byte, and effectguard's ratio to the baseline for each. The
``transport`` part measures the in-process ``AsyncGuardTransport`` against the
plain transport it wraps; the ``ledger`` part counts admit+settle pairs per
second at 1 and 64 callers (SQLite, and PostgreSQL with ``--pg DSN``).
``--recovery-calls N`` builds a ledger of N calls and times start-up on it.

Benchmarks print numbers; nothing here fails on a slow figure. The parts live
in :mod:`effectguard_bench`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from effectguard_bench import (
    commitfloor,
    ledgerbench,
    proxybench,
    recoverybench,
    replicabench,
    report,
    storagebench,
    transportbench,
)
from effectguard_bench.loadgen import LoadRunner
from effectguard_bench.processes import (
    Child,
    Pinning,
    machine,
    python_module,
    spawn_announcing,
    this_thread_on,
)

PARTS = ("all", "proxy", "transport", "ledger")
_FAKE_LISTENING = "fake-provider listening on "

_PROXY_COLUMNS = [
    ("SCENARIO", "scenario"),
    ("C", "concurrency"),
    ("TARGET", "target"),
    ("P50_MS", "p50_ms"),
    ("+P50_MS", "added_p50_ms"),
    ("+P99_MS", "added_p99_ms"),
    ("REQ/S", "rps"),
    ("CPU_MS/REQ", "cpu_ms_per_request"),
    ("RSS_MB", "peak_rss_mb"),
    ("TTFB_MS", "ttfb_ms"),
    ("x+P50", "ratio.added_p50_ms"),
    ("xREQ/S", "ratio.rps"),
    ("xCPU", "ratio.cpu_ms_per_request"),
    ("xRSS", "ratio.peak_rss_mb"),
    ("xTTFB", "ratio.ttfb_ms"),
]
_TRANSPORT_COLUMNS = [
    ("SCENARIO", "scenario"),
    ("C", "concurrency"),
    ("VARIANT", "variant"),
    ("P50_MS", "p50_ms"),
    ("P99_MS", "p99_ms"),
    ("+P50_MS", "added_p50_ms"),
    ("REQ/S", "rps"),
    ("CPU_MS/REQ", "cpu_ms_per_request"),
    ("TTFB_MS", "ttfb_p50_ms"),
    ("xP50", "ratio.p50_ms"),
    ("xREQ/S", "ratio.rps"),
    ("xCPU", "ratio.cpu_ms_per_request"),
]
_LEDGER_COLUMNS = [
    ("ENGINE", "engine"),
    ("CALLERS", "callers"),
    ("PAIRS/S", "pairs_per_second"),
    ("PAIR_P50_MS", "pair_p50_ms"),
    ("PAIR_P99_MS", "pair_p99_ms"),
    ("COMMITS", "commits"),
    ("OPS/COMMIT", "operations_per_commit"),
]

_FLEET_COLUMNS = [
    ("REPLICAS", "replicas"),
    ("CALLERS_EACH", "callers_per_replica"),
    ("PAIRS/S", "pairs_per_second"),
    ("PAIR_P50_MS", "pair_p50_ms"),
    ("PAIR_P99_MS", "pair_p99_ms"),
    ("OPS/COMMIT", "operations_per_commit"),
]


def _concurrency(value: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(part) for part in value.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of counts: {value!r}"
        ) from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be positive")
    return levels


def _seconds(value: str) -> float:
    seconds = float(value)
    if not 0 < seconds <= 600:
        raise argparse.ArgumentTypeError("--duration must be in (0, 600] seconds")
    return seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``bench`` options to ``parser``."""
    parser.add_argument(
        "what", nargs="?", default="all", choices=PARTS, help="which part to run (default all)"
    )
    parser.add_argument(
        "--duration", type=_seconds, default=5.0, help="seconds per measurement (default 5)"
    )
    parser.add_argument(
        "--concurrency",
        type=_concurrency,
        default=(1, 32, 128),
        metavar="N,N,...",
        help="concurrent clients (default 1,32,128)",
    )
    parser.add_argument("--json", action="store_true", help="print every figure as JSON")
    parser.add_argument("--pg", metavar="DSN", help="also run the ledger part on PostgreSQL")
    parser.add_argument(
        "--replicas",
        type=_concurrency,
        metavar="R,R,...",
        help="ledger part: only PostgreSQL (--pg), as R replica processes on one ledger",
    )
    parser.add_argument(
        "--replica-callers",
        type=_concurrency,
        default=(1, 64),
        metavar="N,N,...",
        help="callers in each replica process with --replicas (default 1,64)",
    )
    parser.add_argument(
        "--recovery-calls",
        type=int,
        default=0,
        metavar="N",
        help="build a ledger of N calls and time start-up on it (slow to build; default 0: skip)",
    )
    parser.add_argument(
        "--no-pin", action="store_true", help="do not pin proxies and load to separate CPUs"
    )
    parser.add_argument(
        "--loadgen",
        choices=("auto", "wrk", "python"),
        default="auto",
        help="load generator (default auto: wrk when installed)",
    )


def _note(text: str) -> None:
    print(f"bench: {text}", file=sys.stderr, flush=True)


def _estimate(args: argparse.Namespace) -> float:
    levels = len(args.concurrency)
    seconds = 0.0
    if args.what in ("all", "proxy"):
        seconds += 2 * levels * 3 * args.duration + 3 * min(args.duration, 3.0)
    if args.what in ("all", "transport"):
        seconds += 2 * levels * 2 * args.duration
    if args.what in ("all", "ledger") and args.replicas:
        seconds += len(args.replicas) * len(args.replica_callers) * (args.duration + 3)
    elif args.what in ("all", "ledger"):
        seconds += 2 * args.duration * (2 if args.pg else 1)
    return seconds


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Run the chosen parts in ``work``; every figure, ratio and target as one dict."""
    pins = Pinning.choose(not args.no_pin)
    runner = LoadRunner.choose(args.loadgen, pins.load, work)
    what: str = args.what
    payload: dict[str, Any] = {
        "machine": machine()
        | {
            "loadgen": runner.tool,
            "proxy_cpus": sorted(pins.proxy) if pins.proxy else None,
            "load_cpus": sorted(pins.load) if pins.load else None,
        },
        "settings": {"duration_s": args.duration, "concurrency": list(args.concurrency)},
    }
    proxy_result = ledger_result = recovery_result = floor = None
    proxy_rows: list[report.Row] = []
    _note(f"about {_estimate(args):.0f} s of measurements")
    with contextlib.ExitStack() as stack:
        fake: Child | None = None
        if what != "ledger" or args.recovery_calls:
            command = python_module("effectguard.testing.fakeprovider", "--port", "0")
            fake = spawn_announcing(
                "fake provider", command, pins.load, _FAKE_LISTENING, 20.0, work / "fake.log"
            )
            stack.callback(fake.stop)
        if fake is not None and what in ("all", "proxy"):
            _note("proxy: this disk's durable commit floor, then direct, baseline, effectguard")
            with this_thread_on(pins.proxy):
                floor = commitfloor.measure(work)
            payload["commit_floor"] = floor.to_json()
            proxy_result = proxybench.run(fake, runner, pins, args.concurrency, args.duration, work)
            proxy_rows = report.proxy_rows(proxy_result, args.concurrency)
            payload["proxy"] = {
                "rows": proxy_rows,
                "ttfb": {k: v.to_json() for k, v in proxy_result.ttfb.items()},
                "start_to_first_served_s": {
                    k: round(v, 3) for k, v in proxy_result.start_to_first_served_s.items()
                },
            }
        if fake is not None and what in ("all", "transport"):
            _note("transport: plain vs AsyncGuardTransport, in process")
            samples = transportbench.run(fake.url, pins, args.concurrency, args.duration, work)
            payload["transport"] = report.transport_rows(samples)
        if what in ("all", "ledger") and args.replicas:
            payload["ledger_replicas"] = _fleet(args)
        elif what in ("all", "ledger"):
            _note("ledger: admit+settle pairs")
            with this_thread_on(pins.proxy):
                ledger_result = ledgerbench.run(work, args.duration, args.pg)
                _note("ledger: bytes per call and WAL pages per commit (SQLite)")
                ledger_result.storage = storagebench.run(work)
            payload["ledger"] = {
                "samples": [s.to_json() for s in ledger_result.samples],
                "notes": ledger_result.notes,
                "storage": ledger_result.storage.to_json(),
            }
        if fake is not None and args.recovery_calls:
            _note(f"recovery: building a ledger of {args.recovery_calls} calls")
            recovery_result = recoverybench.run(fake, pins, args.recovery_calls, work)
            payload["recovery"] = recovery_result.to_json()
    found = report.targets(proxy_rows, proxy_result, ledger_result, recovery_result, floor)
    payload["targets"] = [t.to_json() for t in found]
    return payload


def _storage_lines(storage: dict[str, Any]) -> list[str]:
    objects = sorted(storage["objects_bytes_per_call"].items(), key=lambda kv: -kv[1])
    return [
        "",
        f"Ledger storage (SQLite, {storage['calls']} calls, {storage['page_size']} B pages): "
        f"{storage['bytes_per_call']} B per call, of which bodies "
        f"{storage['body_bytes_per_call']} B, overhead {storage['overhead_bytes_per_call']} B; "
        f"WAL pages per single-operation commit: admission {storage['admission_wal_pages']}, "
        f"observation {storage['observation_wal_pages']} "
        f"(means {storage['admission_wal_pages_mean']}, "
        f"{storage['observation_wal_pages_mean']})",
        "  per call by table/index: " + ", ".join(f"{k} {v:g} B" for k, v in objects),
    ]


def _fleet(args: argparse.Namespace) -> list[dict[str, Any]]:
    if not args.pg:
        raise RuntimeError("--replicas measures PostgreSQL replicas: give --pg DSN")
    _note(f"ledger: PostgreSQL replicas {args.replicas} x callers {args.replica_callers}")
    return replicabench.run(args.pg, args.replicas, args.replica_callers, args.duration)


def render(payload: dict[str, Any]) -> str:
    """The payload as the text tables."""
    m = payload["machine"]
    pinned = (
        f"proxies on CPU {m['proxy_cpus']}, load on CPU {m['load_cpus']}"
        if m["proxy_cpus"]
        else "not pinned"
    )
    lines = [
        f"effectguard bench: {m['nproc']} CPUs ({m['allowed_cpus']} allowed), "
        f"Python {m['python']}, load generator {m['loadgen']}, {pinned}, "
        f"load average {m['loadavg']} at start",
        f"{payload['settings']['duration_s']} s per measurement",
    ]
    if "proxy" in payload:
        proxy = payload["proxy"]
        lines += [
            "",
            "Proxy (+ = added over calling the fake provider directly; x = effectguard/baseline)",
            report.table(proxy["rows"], _PROXY_COLUMNS),
            "start to first served request: "
            + ", ".join(f"{k} {v:.3f} s" for k, v in proxy["start_to_first_served_s"].items()),
        ]
    if "transport" in payload:
        lines += [
            "",
            "In-process transport (x = AsyncGuardTransport/plain AiohttpTransport)",
            report.table(payload["transport"], _TRANSPORT_COLUMNS),
        ]
    if "ledger" in payload:
        lines += [
            "",
            "Ledger (admit + settle per pair)",
            report.table(payload["ledger"]["samples"], _LEDGER_COLUMNS),
        ]
        lines += [f"  {note}" for note in payload["ledger"]["notes"]]
        lines += _storage_lines(payload["ledger"]["storage"])
    if "ledger_replicas" in payload:
        lines += [
            "",
            "PostgreSQL replicas x callers (admit + settle per pair; replicas not pinned)",
            report.table(payload["ledger_replicas"], _FLEET_COLUMNS),
        ]
    if "recovery" in payload:
        r = payload["recovery"]
        lines += [
            "",
            f"Recovery: ledger of {r['calls']} calls ({r['ledger_mb']} MB, built in "
            f"{r['build_seconds']} s), {r['in_flight']} in flight for a dead worker: "
            f"first request served {r['start_to_first_served_s']} s after start, "
            f"{r['interrupted_by_sweep']} calls marked effect_unknown",
        ]
    if "commit_floor" in payload:
        f = payload["commit_floor"]
        lines += [
            "",
            f"Durable commit floor on this disk (no effectguard code): fdatasync of "
            f"{commitfloor.PAGES} pages p50 {f['fdatasync_ms']:.3f} ms; a {commitfloor.PAGES}-page "
            f"SQLite commit (WAL, synchronous=FULL) p50 {f['sqlite_commit_ms']:.3f} ms",
        ]
    lines += ["", "Targets (from the issue; figures from this run)"]
    for t in payload["targets"]:
        sign = "<=" if t["at_most"] else ">="
        value = "-" if t["value"] is None else f"{t['value']:.3f}"
        verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        line = f"  {t['name']}: {value} (target {sign} {t['limit']:g}) {verdict}"
        if t.get("floor") is not None:
            below = " (the target is below this floor)" if t["floor"] > t["limit"] else ""
            line += f"; floor here, {t['floor_note']}: {t['floor']:.3f}{below}"
        lines.append(line)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print the tables (or ``--json``). Returns the exit code."""
    with tempfile.TemporaryDirectory(prefix="effectguard-bench-") as tmp:
        try:
            payload = measure(args, Path(tmp))
        except RuntimeError as exc:
            print(f"effectguard bench: {exc}", file=sys.stderr)
            return 1
    print(json.dumps(payload, indent=2) if args.json else render(payload))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``python -m effectguard_bench.cli``."""
    parser = argparse.ArgumentParser(prog="effectguard bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
