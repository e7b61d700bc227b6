"""``effectguard bench`` in a tiny mode: it runs end to end and its JSON has every figure.

No timing is asserted anywhere: benchmarks print numbers, tests check shapes.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pgkit import scratch_schema

from effectguard.ledger import Ledger
from effectguard.ledger.sqliteevents import ROW_EVENTS
from effectguard.ops.cli import main
from effectguard.ops.verify import verify_ledger
from effectguard.rules.liveness import LEASE_EXPIRED, TAKEN_OVER
from effectguard_bench import floorbench, gonebench, spendbench
from effectguard_bench.recoverybench import build_ledger

pytestmark = pytest.mark.slow

PG_DSN = os.environ.get("EFFECTGUARD_TEST_PG_DSN", "")
TINY = ["--duration", "0.5", "--concurrency", "1", "--loadgen", "python", "--json"]


def _bench(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["bench", *args, *TINY]) == 0
    payload: dict[str, Any] = json.loads(capsys.readouterr().out)
    return payload


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and value >= 0


def test_bench_all_reports_every_part_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    """A tiny full run prints machine, proxy, transport, ledger, recovery and targets."""
    payload = _bench(capsys, "all", "--recovery-calls", "50")

    assert payload["machine"]["loadgen"] == "python"
    assert {"nproc", "python", "proxy_cpus", "load_cpus"} <= payload["machine"].keys()

    rows = payload["proxy"]["rows"]
    cells = {(r["scenario"], r["concurrency"], r["target"]) for r in rows}
    assert cells == {
        (s, 1, t) for s in ("plain", "stream") for t in ("direct", "baseline", "effectguard")
    }
    for row in rows:
        assert row["requests"] > 0 and row["errors"] == 0
        assert all(_is_number(row[k]) for k in ("p50_ms", "p99_ms", "rps"))
        if row["target"] != "direct":
            assert _is_number(row["cpu_ms_per_request"]) and _is_number(row["peak_rss_mb"])
        if row["target"] == "effectguard":
            assert {"added_p50_ms", "rps", "cpu_ms_per_request", "peak_rss_mb", "ttfb_ms"} <= row[
                "ratio"
            ].keys()
    assert set(payload["proxy"]["ttfb"]) == {"direct", "baseline", "effectguard"}
    assert set(payload["proxy"]["start_to_first_served_s"]) == {"baseline", "effectguard"}

    variants = {(r["scenario"], r["variant"]) for r in payload["transport"]}
    assert variants == {(s, v) for s in ("plain", "stream") for v in ("plain", "effectguard")}
    assert all("ratio" in r for r in payload["transport"] if r["variant"] == "effectguard")

    ledger = payload["ledger"]["samples"]
    assert [(s["engine"], s["callers"]) for s in ledger] == [("sqlite", 1), ("sqlite", 64)]
    assert all(s["pairs"] > 0 and s["commits"] > 0 for s in ledger)

    assert payload["recovery"]["calls"] == 50
    assert payload["recovery"]["interrupted_by_sweep"] == payload["recovery"]["in_flight"]

    names = [t["name"] for t in payload["targets"]]
    assert {
        "p50 added above baseline at 1 plain (ms)",
        "req/s at 32 plain, ratio to baseline",
        "CPU per request at 32 plain, ratio to baseline",
        "stream TTFB above baseline at 1 (ms)",
    } <= set(names)
    # the tiny run has one client: the 32-client ratios are reported as not measured
    cpu = next(t for t in payload["targets"] if t["name"].startswith("CPU per request"))
    assert (cpu["value"], cpu["met"], cpu["limit"]) == (None, None, 1.5)
    p50 = next(t for t in payload["targets"] if t["name"].startswith("p50 added above"))
    assert p50["value"] is not None and p50["limit"] == 0.6
    assert "SQLite admit+settle pairs/s at 64 callers" in names
    keys = {"name", "value", "limit", "at_most", "met", "floor", "floor_note"}
    assert all(set(t) == keys for t in payload["targets"])
    # the one-client targets carry this disk's durable commit floor, measured in the run
    floor = payload["commit_floor"]
    assert floor["fdatasync_ms"] > 0 and floor["sqlite_commit_ms"] > 0
    assert p50["floor"] == pytest.approx(2 * floor["sqlite_commit_ms"], abs=0.002)
    ttfb = next(t for t in payload["targets"] if t["name"].startswith("stream TTFB"))
    assert ttfb["floor"] == pytest.approx(floor["sqlite_commit_ms"], abs=0.001)


def test_bench_ledger_alone_starts_no_proxy(capsys: pytest.CaptureFixture[str]) -> None:
    """``bench ledger`` reports only the ledger part (and the targets it covers)."""
    payload = _bench(capsys, "ledger", "--no-pin")

    assert "proxy" not in payload and "transport" not in payload
    assert payload["machine"]["proxy_cpus"] is None
    assert [t["name"] for t in payload["targets"]] == [
        "SQLite admit+settle pairs/s at 64 callers",
        "SQLite WAL pages per single-operation commit (worst of admit, observe)",
        "SQLite ledger bytes per call beyond the bodies",
    ]
    storage = payload["ledger"]["storage"]
    assert storage["calls"] > 0 and storage["page_size"] > 0
    for name in ("bytes_per_call", "body_bytes_per_call", "overhead_bytes_per_call"):
        assert _is_number(storage[name])
    # Counts, not timings: a single-operation commit writes at least one page.
    assert storage["admission_wal_pages"] >= 1 and storage["observation_wal_pages"] >= 1
    assert storage["admission_wal_pages_mean"] >= 1 and storage["observation_wal_pages_mean"] >= 1
    assert "events" in storage["objects_bytes_per_call"]


def test_bench_text_output_is_one_table_per_part(capsys: pytest.CaptureFixture[str]) -> None:
    """Without ``--json`` the bench prints tables with the column headers and targets."""
    assert main(["bench", "ledger", "--duration", "0.2"]) == 0
    text = capsys.readouterr().out

    assert "PAIRS/S" in text and "OPS/COMMIT" in text
    assert "B per call" in text and "WAL pages per single-operation commit" in text
    assert "Targets" in text


async def test_bulk_loaded_recovery_ledger_verifies(tmp_path: Path) -> None:
    """The recovery bench's bulk loader writes a ledger that ``verify`` accepts."""
    path = tmp_path / "bulk.db"
    build_ledger(path, calls=120, in_flight=3)

    async with Ledger.open(str(path)) as ledger:
        report = await verify_ledger(ledger)
        in_flight = await ledger.calls(stage="in_flight")
    assert report.ok, report.problems
    assert report.calls == 123
    assert len(in_flight) == 3


@pytest.mark.postgres
@pytest.mark.skipif(not PG_DSN, reason="set EFFECTGUARD_TEST_PG_DSN to run the replica bench")
def test_bench_ledger_replicas_reports_each_fleet(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``--replicas 1,2`` runs 1 then 2 replica processes on one PostgreSQL ledger, each
    point in the JSON with the fleet's pairs per second; SQLite is not run."""
    with scratch_schema("eg_bench_") as url:
        payload = _bench(
            capsys, "ledger", "--pg", url, "--replicas", "1,2", "--replica-callers", "2"
        )
    fleets = payload["ledger_replicas"]
    assert [(f["replicas"], f["callers_per_replica"], f["callers"]) for f in fleets] == [
        (1, 2, 2),
        (2, 2, 4),
    ]
    assert all(f["pairs_per_second"] > 0 for f in fleets)
    assert "ledger" not in payload


def test_bench_replicas_need_a_postgresql_ledger(capsys: pytest.CaptureFixture[str]) -> None:
    """``--replicas`` without ``--pg`` is refused with a reason, not run on SQLite."""
    assert main(["bench", "ledger", "--replicas", "2"]) == 1
    assert "--pg" in capsys.readouterr().err


@pytest.mark.postgres
@pytest.mark.skipif(not PG_DSN, reason="set EFFECTGUARD_TEST_PG_DSN to run the replica bench")
def test_pgcost_prints_round_trips_statements_and_cpu_per_caller_count(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``python -m effectguard_bench.pgcost DSN S`` prints one line per caller count, with
    no more round trips than statements per batch."""
    import re

    from effectguard_bench import pgcost

    with scratch_schema("eg_bench_") as url:
        assert pgcost.main([url, "0.3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    figures = re.compile(r"callers +(\d+): .* ([\d.]+) round trips and +([\d.]+) statements")
    found = [figures.search(line) for line in lines]
    assert [int(m.group(1)) for m in found if m] == [1, 64]
    assert all(m and 0 < float(m.group(2)) <= float(m.group(3)) for m in found)


def test_floorbench_replays_every_row_the_ledger_stored(tmp_path: Path) -> None:
    """The storage floor writes exactly the rows a real ledger stored for its calls (so
    its figure is the cost of that work, not of less), and prints positive figures."""
    floor = floorbench.measure(tmp_path, calls=40, batch=10)
    assert floor.calls == 40 and floor.storage_us > 0 and floor.sealing_us > 0

    def counts(name: str) -> tuple[int, int]:
        conn = sqlite3.connect(tmp_path / name)
        try:
            events = conn.execute(  # a row may hold an operation's events (sqliterecords)
                f"SELECT sum({ROW_EVENTS}) FROM events e WHERE call_id IS NOT NULL"
            )
            calls = conn.execute("SELECT count(*) FROM calls")
            return events.fetchone()[0], calls.fetchone()[0]
        finally:
            conn.close()

    assert counts("floor-target.db") == counts("floor-source.db") == (40 * 6, 40)


def test_phases_marks_every_request_and_prints_each_phase(tmp_path: Path) -> None:
    """The one-client phase split measures every request it drove (each one reached the
    upstream and sent bytes back) and prints a CPU and a wall figure for each phase."""
    # A process of its own: it configures logging for the app it drives, as serve does.
    command = [sys.executable, "-m", "effectguard_bench.phases", "--requests", "20", "--stream"]
    done = subprocess.run(
        [*command, "--ledger-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "20 requests;" in out
    for name in ("before dispatch", "upstream", "to the first byte"):
        line = next(line for line in out.splitlines() if line.strip().startswith(name))
        cpu, wall = (float(line.split(word)[1].split()[0]) for word in ("CPU", "wall"))
        assert cpu >= 0 and wall > 0
        commits = float(line.split("ledger commits")[1].strip(" )"))
        # the admission commits before dispatch; a stream's observation only at its end
        assert (commits > 0) == (name == "before dispatch") and commits < wall


def test_edges_prints_each_hostile_and_ordinary_figure() -> None:
    """The hostile-input benchmark runs its four cases and prints a figure for each."""
    command = [sys.executable, "-m", "effectguard_bench.edges", "--objects", "2000"]
    done = subprocess.run(
        [*command, "--line-mib", "1", "--repeat", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "body of 2000 tiny objects (0.0 MiB)",
        "ordinary 10233 B chat body",
        "one 1 MiB stream line in 16 KiB chunks",
        "ordinary 300-chunk chat stream",
    ]
    assert all(float(line.split(": ")[1].split()[0]) > 0 for line in lines)


def test_streamread_prints_both_readers_for_each_stream_shape() -> None:
    """The stream-reading benchmark feeds each shape to both readers and prints a time
    and a ratio to its baseline for each (their worth is not asserted)."""
    command = [sys.executable, "-m", "effectguard_bench.streamread", "--events", "20"]
    done = subprocess.run(
        [*command, "--big-events", "2", "--repeat", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["small", "one-read", "big"]
    for line in lines:
        assert line.count(" us") == 3 and "streamusage" in line and "addedusage" in line
        assert line.count(", x") == 2


def test_instructions_sums_callgrind_lines_by_shared_object() -> None:
    """The by-object split reads callgrind_annotate's lines, with or without an object
    named, and leaves out the program total."""
    from effectguard_bench.instructions import objects_of

    annotated = """
5,247,059,870 (100.0%)  PROGRAM TOTALS
723,466,450 (13.79%)  build/Python-3.11.7/Python/ceval.c:_PyEval_Eval [/lib/libpython3.11.so.1.0]
 4,071,460 ( 0.88%)  build/Python-3.11.7/Modules/gcmodule.c:visit_reachable
31,548,840 ( 0.60%)  ???:0x00000000000ff650 [/usr/lib/x86_64-linux-gnu/libsqlite3.so.0.8.6]
"""
    assert objects_of(annotated) == {
        "libpython3.11.so.1.0": 723_466_450,
        "libpython": 4_071_460,
        "libsqlite3.so.0.8.6": 31_548_840,
    }


def test_instructions_ledger_harness_writes_pairs(tmp_path: Path) -> None:
    """The ledger harness the instruction count runs under callgrind admits and records."""
    done = subprocess.run(
        [sys.executable, "-m", "effectguard_bench.instructions", "--ledger-pairs", "3"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "103 calls completed"  # 100 to warm up, then the 3 asked


async def test_spendbench_times_the_chart_over_every_call_it_filled(tmp_path: Path) -> None:
    """The spend bench fills a ledger with completed calls, all in the chart's window, and
    times each rendering of the chart over them."""
    url = str(tmp_path / "spend.db")
    await spendbench.fill(url, 30)
    async with Ledger.open(url) as ledger:
        spends = await ledger.call_spend(0.0, 100)
    assert len(spends) == 30 and all(s.cost for s in spends)
    times, loop_cpu = await spendbench.time_spend(url, 2)
    assert len(times) == len(loop_cpu) == 2 and all(t > 0 for t in times)


async def test_gonebench_builds_unknown_and_gone_calls_and_times_the_start_page(
    tmp_path: Path,
) -> None:
    """The gone-workers bench builds a ledger that verifies, with the calls unknown and
    the calls in flight (gone, fenced and alive workers') it was asked for, and times the
    start page on it, which lists the gone and fenced workers' calls."""
    path = tmp_path / "gone.db"
    gonebench.build(path, calls=40, unknown=10, gone=3, per_gone=2, fenced=2, alive=4)
    async with Ledger.open(str(path)) as ledger:
        counts = {stage: n for _, stage, n, _, _ in await ledger.stage_counts()}
        assert counts == {"effect_unknown": 10, "in_flight": 14}
        assert (await verify_ledger(ledger)).ok
    assert any("calls_unresolved" in step for step in gonebench.plan(path, 3))
    assert await gonebench.listed(path) == {LEASE_EXPIRED: 6, TAKEN_OVER: 4}
    times = await gonebench.time_page(path, 2)
    assert all(len(t) == 2 and all(s > 0 for s in t) for t in times.values())
    assert gonebench.time_sweep(path)[1] == 6
    assert gonebench.time_sweep(path)[1] == 6  # rolled back: the same calls again
