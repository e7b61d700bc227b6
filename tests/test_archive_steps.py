"""``effectguard archive`` in bounded steps, on SQLite.

An archive used to plan from every event and call state of the ledger and delete its
whole range in one transaction: on a 400,000-call ledger it took 4.5 GB and held the
write lock past the proxy's 5 s busy wait, so live requests were answered 503. It now
cuts in steps of at most ``--step-events`` events, each its own file, transaction and
``ledger.archived`` checkpoint. These tests drive it from outside: through the proxy,
the CLI and a real SIGKILL at its crash points.
"""

from __future__ import annotations

import gzip
import itertools
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from observing import call_stages, ledger_events
from test_archive import CHAT, archive, chat, cli, later, send_chats, verify

from effectguard.ops.cli import main
from effectguard.testing import Proxy, fake_provider, running_proxy
from effectguard_bench.recoverybench import build_ledger

pytestmark = pytest.mark.slow

#: Large enough that no step limit applies: the archive as one step.
ONE_STEP = "10000000"


def checkpoints(ledger: Path) -> list[dict[str, Any]]:
    """The ``ledger.archived`` events of the live ledger, in order."""
    return [e for e in ledger_events(ledger) if e["kind"] == "ledger.archived"]


def event_lines(path: Path) -> list[str]:
    """The event lines of an archive file (not its header, body or checkpoint lines)."""
    with gzip.open(path, "rt", encoding="utf-8") as src:
        rows = src.read().splitlines()
    return [r for r in rows[1:] if not r.startswith(('{"body":', '{"checkpoint":'))]


def keys_kept(ledger: Path) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT * FROM archived_keys ORDER BY 1, 2").fetchall()
    finally:
        conn.close()


def overlapping_calls(proxy: Proxy, numbers: range) -> None:
    """A call per number, in waves of four (a wave's events interleave), odd ones keyed.

    Each wave ends before the next begins, so a cut falls between waves however loaded
    the machine: sent all at once, calls can overlap end to end and leave no cut at all.
    """

    def one(n: int) -> int:
        headers = {"Idempotency-Key": f"key-{n}"} if n % 2 else {}
        return httpx.post(proxy.url + CHAT, json=chat(n), headers=headers, timeout=30).status_code

    with ThreadPoolExecutor(4) as pool:
        for start in range(0, len(numbers), 4):
            assert set(pool.map(one, numbers[start : start + 4])) == {200}


def test_an_archive_in_small_steps_moves_what_one_step_moves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two copies of one ledger: archived in one step, and in steps of 5 events (calls
    interleaved, so most steps must grow to end at a call boundary). The steps archive
    the same range, the same event lines in the same order, the same kept keys and
    budgets, each step its own verified file and checkpoint; ``--out`` names the first
    file and the others beside it by their range."""
    whole, stepped = tmp_path / "whole.db", tmp_path / "stepped.db"
    with (
        fake_provider(tmp_path / "receipts.jsonl") as fake,
        running_proxy(whole, upstreams={"openai": fake.url}) as proxy,
    ):
        overlapping_calls(proxy, range(16))
    assert main(["backup", str(stepped), "--ledger", str(whole)]) == 0
    capsys.readouterr()

    one = archive(whole, capsys, "--step-events", ONE_STEP)
    out = tmp_path / "jan.jsonl.gz"
    many = archive(stepped, capsys, "--step-events", "5", "--out", str(out))

    assert one["steps"] == 1 and many["steps"] > 3, many
    fields = ("first_seq", "last_seq", "events", "calls", "keys")
    assert [many[f] for f in fields] == [one[f] for f in fields]
    assert (one["calls"], one["keys"]) == (16, 8)
    files = [Path(f) for f in many["files"]]
    assert files[0] == out and many["path"] == str(files[-1])
    for path in files[1:]:
        assert path.parent == tmp_path and path.name.startswith("jan-"), path
        assert path.name.endswith(".jsonl.gz")
    assert [line for f in files for line in event_lines(f)] == event_lines(Path(one["path"]))
    assert len(checkpoints(stepped)) == many["steps"]
    assert checkpoints(stepped)[-1]["seq"] == many["checkpoint_seq"]
    assert keys_kept(stepped) == keys_kept(whole)
    assert call_stages(stepped) == call_stages(whole) == {}
    for ledger in (whole, stepped):
        code, report = verify(capsys, "--ledger", str(ledger))
        assert code == 0, report["problems"]
    for path in files:
        code, report = verify(capsys, "--archive", str(path), "--ledger", str(stepped))
        assert code == 0, (path, report["problems"])
    assert cli(capsys, "budgets", "--ledger", str(stepped)) == cli(
        capsys, "budgets", "--ledger", str(whole)
    )
    # Text output: a line per step as it commits, then the sum.
    with (
        fake_provider(tmp_path / "receipts2.jsonl") as fake,
        running_proxy(stepped, upstreams={"openai": fake.url}) as proxy,
    ):
        send_chats(proxy, range(100, 104))  # one after another: a step each
    command = ["archive", "--ledger", str(stepped), "--before", later(), "--step-events", "6"]
    assert main(command) == 0
    said = capsys.readouterr().out.splitlines()
    assert len(said) >= 3 and said[-1].startswith("archive: ") and " steps, events " in said[-1]
    assert all(line.startswith(f"archive {tmp_path}/stepped-archive-") for line in said[:-1])


def _traffic(proxy: Proxy, stop: threading.Event, seen: Counter[int]) -> None:
    with httpx.Client(timeout=60) as client:
        n = 0
        while not stop.is_set():
            n += 1
            seen[client.post(proxy.url + CHAT, json=chat(n)).status_code] += 1


def test_live_traffic_is_answered_while_an_archive_steps_through_the_ledger(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ledger of 2,000 calls archived in steps of 600 events while two clients send
    calls without pause: every live call is answered 200 (none refused 503 waiting for
    the write lock), live calls commit between the archive's steps (its checkpoints are
    not consecutive events), the provider saw exactly the calls answered, and the
    ledger and every file verify."""
    ledger = tmp_path / "ledger.db"
    build_ledger(ledger, 2000, in_flight=0)
    stop = threading.Event()
    seen: Counter[int] = Counter()
    with (
        fake_provider(tmp_path / "receipts.jsonl") as fake,
        running_proxy(ledger, upstreams={"openai": fake.url}) as proxy,
        ThreadPoolExecutor(2) as pool,
    ):
        clients = [pool.submit(_traffic, proxy, stop, seen) for _ in range(2)]
        try:
            moved = archive(ledger, capsys, "--step-events", "600")
        finally:
            stop.set()
            for c in clients:
                c.result(timeout=60)
        assert set(seen) == {200}, seen
        assert len(fake.receipts()) == seen[200]
    assert moved["calls"] >= 2000 and moved["steps"] >= 20, moved
    marks = [e["seq"] for e in checkpoints(ledger)]
    assert len(marks) == moved["steps"]
    assert any(b - a > 1 for a, b in itertools.pairwise(marks)), marks
    code, report = verify(capsys, "--ledger", str(ledger))
    assert code == 0, report["problems"]
    for path in moved["files"]:
        code, report = verify(capsys, "--archive", path, "--ledger", str(ledger))
        assert code == 0, (path, report["problems"])


def run_archive(ledger: Path, *args: str, crash_at: str) -> subprocess.CompletedProcess[str]:
    """``python -m effectguard archive`` with ``EFFECTGUARD_CRASH_AT``."""
    env = {**os.environ, "EFFECTGUARD_CRASH_AT": crash_at}
    command = [sys.executable, "-m", "effectguard", "archive", "--ledger", str(ledger)]
    return subprocess.run(
        [*command, "--before", later(), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def ten_calls(tmp_path: Path) -> Iterator[Path]:
    """A stopped proxy's ledger holding ten completed calls."""
    ledger = tmp_path / "ledger.db"
    with (
        fake_provider(tmp_path / "receipts.jsonl") as fake,
        running_proxy(ledger, upstreams={"openai": fake.url}) as proxy,
    ):
        send_chats(proxy, range(10))
    yield ledger


def test_a_crash_between_steps_leaves_a_verified_ledger_and_the_next_archive_goes_on(
    tmp_path: Path, ten_calls: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGKILL after the first step: its file is in place and verifies, the ledger
    verifies from its checkpoint, and the next archive goes on from that cut. A
    misspelt crash point stops archive at start with exit 2, nothing moved."""
    ledger = ten_calls
    wrong = run_archive(ledger, crash_at="after:archive-stepp")
    assert wrong.returncode == 2 and "EFFECTGUARD_CRASH_AT" in wrong.stderr
    assert len(call_stages(ledger)) == 10

    killed = run_archive(ledger, "--step-events", "12", crash_at="after:archive-step")
    assert killed.returncode == -9, killed.stderr
    (first,) = sorted(tmp_path.glob("ledger-archive-*.jsonl.gz"))
    assert not list(tmp_path.glob(".*.partial"))
    assert len(checkpoints(ledger)) == 1 and 0 < len(call_stages(ledger)) < 10
    code, report = verify(capsys, "--ledger", str(ledger))
    assert code == 0, report["problems"]
    code, report = verify(capsys, "--archive", str(first), "--ledger", str(ledger))
    assert code == 0, report["problems"]

    rest = archive(ledger, capsys, "--step-events", "12")
    assert rest["first_seq"] == json.loads(_last_line(first))["checkpoint"]["data"]["last_seq"] + 1
    assert call_stages(ledger) == {}
    code, report = verify(capsys, "--ledger", str(ledger))
    assert code == 0, report["problems"]


def _last_line(path: Path) -> str:
    with gzip.open(path, "rt", encoding="utf-8") as src:
        return src.read().splitlines()[-1]


def test_a_crash_after_a_step_commits_and_before_its_rename_is_refused_until_resolved(
    tmp_path: Path, ten_calls: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGKILL between a step's commit and its rename leaves the only copy of its events
    in ``.FILE.partial``. The next archive plans a new range under a new name; it used
    to go on and leave that file behind unnoticed. It now refuses (exit 2) naming the
    file and what to do, moves nothing, and goes on once the file is renamed."""
    ledger = ten_calls
    killed = run_archive(ledger, "--step-events", "12", crash_at="after:archive-commit")
    assert killed.returncode == -9, killed.stderr
    (partial,) = tmp_path.glob(".ledger-archive-*.jsonl.gz.partial")
    assert not list(tmp_path.glob("ledger-archive-*"))
    live = call_stages(ledger)
    assert 0 < len(live) < 10

    code, out = cli(capsys, "archive", "--ledger", str(ledger), "--before", later())
    assert code == 2 and str(partial) in out["err"] and "verify --archive" in out["err"], out
    assert call_stages(ledger) == live and partial.exists()

    code, report = verify(capsys, "--archive", str(partial), "--ledger", str(ledger))
    assert code == 0, report["problems"]
    shutil.move(partial, partial.with_name(partial.name[1 : -len(".partial")]))
    rest = archive(ledger, capsys, "--step-events", "12")
    assert rest["calls"] == len(live) and call_stages(ledger) == {}
    code, report = verify(capsys, "--ledger", str(ledger))
    assert code == 0, report["problems"]


def test_an_archive_stopped_at_a_step_keeps_the_steps_before_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A step that cannot be written (its file's name is taken) stops the archive with
    exit 2 and nothing of that step moved; the step before it stays archived, verified,
    and the error names its range, so an operator reading a cron log knows what moved."""
    first, second = tmp_path / "a" / "l.db", tmp_path / "b" / "l.db"
    first.parent.mkdir()
    second.parent.mkdir()
    build_ledger(first, 300, in_flight=0)
    assert main(["backup", str(second), "--ledger", str(first)]) == 0
    out = "--out", "jan.jsonl.gz"
    learned = archive(first, capsys, "--step-events", "500", out[0], str(first.parent / out[1]))
    taken = second.parent / Path(learned["files"][1]).name
    taken.write_text("not an archive")

    code, said = cli(
        capsys,
        "archive",
        "--ledger",
        str(second),
        "--before",
        later(),
        "--step-events",
        "500",
        out[0],
        str(second.parent / out[1]),
    )
    assert code == 2, said
    step = json.loads(_last_line(second.parent / out[1]))["checkpoint"]["data"]
    assert f"(the step before it is archived: events 1..{step['last_seq']})" in said["err"]
    assert taken.read_text() == "not an archive"
    code, report = verify(capsys, "--ledger", str(second))
    assert code == 0, report["problems"]
    code, report = verify(capsys, "--archive", str(second.parent / out[1]), "--ledger", str(second))
    assert code == 0, report["problems"]
