"""``effectguard backup``: a consistent online copy of a SQLite ledger, and its restore.

A real proxy serves a few dozen concurrent calls (some answered, some held upstream, more
arriving) while the copy is taken. The copy verifies, and a new proxy opened on it changes
no call's stage, except that calls in flight at the copy become ``effect_unknown`` through
the sweeper (docs/contract.md §7): nothing is resent and nothing answered is forgotten.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import sqlite3
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from mountkit import read_only, small_tmpfs
from observing import call_stages, cli_json, wait_for

from effectguard.ops.backup import backup_sqlite
from effectguard.ops.cli import main
from effectguard.testing import fake_provider, running_proxy
from effectguard_bench.recoverybench import build_ledger

pytestmark = pytest.mark.slow

CHAT = "/openai/v1/chat/completions"
#: Short leases so the restored proxy's sweeper takes over the copied worker quickly.
LEASE = """
[server]
lease_s = 1
heartbeat_s = 0.3
sweep_s = 0.3
"""
HELD = 12  # calls held upstream across the copy
HOLD_S = 6  # how long the provider holds them (the copy is taken well inside this)
ANSWERED = 12  # calls answered before the copy
RUNNING = 24  # calls answered while the copy is taken


def chat(n: int) -> dict[str, Any]:
    """A small chat completion request."""
    content = f"backup {n}"
    return {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
    }


def head(ledger: Path) -> int:
    """The last committed event's number, as a new reader sees it (WAL included)."""
    conn = sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)
    try:
        return int(conn.execute("SELECT coalesce(max(seq), 0) FROM events").fetchone()[0])
    finally:
        conn.close()


def verify_ok(ledger: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """``effectguard verify --json`` on ``ledger``; asserts exit 0 and returns the report."""
    capsys.readouterr()
    code = main(["verify", "--json", "--ledger", str(ledger)])
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert code == 0, report["problems"]
    return report


def test_backup_under_load_verifies_and_restores_without_changing_a_stage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A copy taken mid-load verifies; reopened, answered calls stay put, in-flight ones
    become effect_unknown, and nothing is sent again."""
    ledger, copy = tmp_path / "ledger.db", tmp_path / "copy.db"
    config = tmp_path / "lease.toml"
    config.write_text(LEASE)
    args = ["--config", str(config)]
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        upstreams = {"openai": fake.url}
        with (
            running_proxy(ledger, upstreams=upstreams, args=args) as proxy,
            ThreadPoolExecutor(HELD + 8) as pool,
        ):

            def post(n: int, delay: float = 0) -> int:
                headers = {"x-fake-delay": str(delay)} if delay else {}
                url = proxy.url + CHAT
                return httpx.post(url, json=chat(n), headers=headers, timeout=60).status_code

            assert list(pool.map(post, range(ANSWERED))) == [200] * ANSWERED
            held = [pool.submit(post, 100 + n, HOLD_S) for n in range(HELD)]
            wait_for(lambda: len(fake.receipts()) >= ANSWERED + HELD, 30, "held calls upstream")
            copying = threading.Event()

            def keep_calling() -> list[int]:
                answers, n = [], 200
                while len(answers) < RUNNING or not copying.is_set():
                    answers.append(post(n))
                    n += 1
                return answers

            running = [pool.submit(keep_calling) for _ in range(4)]
            wait_for(lambda: len(fake.receipts()) >= ANSWERED + HELD + 8, 30, "calls in progress")
            floor = head(ledger)  # committed before the copy began: the copy must hold it
            result = backup_sqlite(str(ledger), copy)  # its own connection, mid-load
            copying.set()
            assert all(code == 200 for f in running for code in f.result(timeout=60))
            # The held calls complete in the ledger; the copy keeps them in flight.
            assert [f.result(timeout=60) for f in held] == [200] * HELD
        sent = len(fake.receipts())

        assert result.head_seq >= floor and head(copy) == result.head_seq
        report = verify_ok(copy, capsys)
        assert report["events"] == result.events
        before = call_stages(copy)
        assert list(before.values()).count("in_flight") >= HELD
        assert list(before.values()).count("completed") >= ANSWERED

        with running_proxy(copy, upstreams=upstreams, args=args):
            wait_for(
                lambda: "in_flight" not in call_stages(copy).values(),
                30,
                "the sweeper to take over",
            )
        after = call_stages(copy)
        assert set(after) == set(before)
        for call_id, stage in before.items():
            assert after[call_id] == ("effect_unknown" if stage == "in_flight" else stage), call_id
        assert len(fake.receipts()) == sent  # the restored ledger resent nothing
    verify_ok(copy, capsys)


def test_backup_command_writes_a_copy_and_refuses_to_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``effectguard backup PATH`` copies a ledger that verifies, and never overwrites PATH."""
    ledger, copy = tmp_path / "ledger.db", tmp_path / "copy.db"
    assert main(["migrate", "--ledger", str(ledger)]) == 0
    assert main(["budget", "set", "team", "--limit", "5", "--ledger", str(ledger)]) == 0
    capsys.readouterr()
    assert main(["backup", str(copy), "--json", "--ledger", str(ledger)]) == 0
    made = json.loads(capsys.readouterr().out)
    assert made["path"] == str(copy) and made["events"] == made["head_seq"] == 1
    assert verify_ok(copy, capsys)["budgets"] == 1
    assert not list(tmp_path.glob(".copy.db.partial*"))
    assert main(["backup", str(copy), "--ledger", str(ledger)]) == 2
    assert "never overwrites" in capsys.readouterr().err


def test_backup_of_a_postgres_ledger_points_to_its_own_tools(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A PostgreSQL ledger is not copied file-wise; the command says what to use instead."""
    code = main(["backup", str(tmp_path / "x.db"), "--ledger", "postgresql://h/db"])
    assert code == 2
    assert "pg_dump" in capsys.readouterr().err


def test_backup_prints_what_the_contract_lists(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Contract §8: the output is the path, the number of events, the last event's
    number and digest, and the size. The text left out the digest, the one value that
    ties a copy to the chain it was taken from (``show`` and ``verify`` name events by
    it); it now says it, as ``--json``'s ``head_digest`` does."""
    ledger, copy, again = tmp_path / "ledger.db", tmp_path / "copy.db", tmp_path / "again.db"
    assert main(["migrate", "--ledger", str(ledger)]) == 0
    assert main(["budget", "set", "team", "--limit", "5", "--ledger", str(ledger)]) == 0
    capsys.readouterr()
    assert main(["backup", str(copy), "--json", "--ledger", str(ledger)]) == 0
    made = json.loads(capsys.readouterr().out)
    assert main(["backup", str(again), "--ledger", str(ledger)]) == 0
    said = capsys.readouterr().out
    assert str(again) in said and f"{made['events']} events" in said, said
    assert f"event {made['head_seq']}" in said and made["head_digest"] in said, said
    assert f"{made['bytes']} bytes" in said, said


def cli_fails(*args: str) -> tuple[int, str]:
    """An ``effectguard`` command's exit code and what it said on stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(args))
    return code, err.getvalue()


def test_a_backup_on_read_only_media_is_read_where_it_lies(tmp_path: Path) -> None:
    """A backup is one WAL-mode file with nothing beside it. On a read-only filesystem
    SQLite could not open it (it makes the ``-shm`` index first), so ``verify``,
    ``calls``, ``show`` and ``budgets`` all said "ledger unavailable" (exit 4). The main
    file holds every commit, so they now read it exactly as they read the original;
    a change is still refused with exit 4, and ``backup`` copies it back to writable
    storage."""
    ledger = tmp_path / "ledger.db"
    build_ledger(ledger, 40, in_flight=3)
    expected = {
        verb: cli_json(verb, "--ledger", str(ledger)) for verb in ("calls", "budgets", "verify")
    }
    some_call = next(c["call_id"] for c in expected["calls"] if c["stage"] == "in_flight")
    shown = cli_json("show", some_call, "--ledger", str(ledger))
    with small_tmpfs(tmp_path / "media", "16m") as disk:
        copy = disk / "copy.db"
        made = cli_json("backup", str(copy), "--ledger", str(ledger))
        assert sorted(p.name for p in disk.iterdir()) == ["copy.db"]
        with read_only(disk):
            for verb, out in expected.items():
                assert cli_json(verb, "--ledger", str(copy)) == out, verb
            # A call in flight shows the command that would decide it, naming the ledger.
            shown_copy = json.loads(json.dumps(shown).replace(str(ledger), str(copy)))
            assert cli_json("show", some_call, "--ledger", str(copy)) == shown_copy
            for change in (["budget", "set", "bench", "--limit", "1"], ["migrate"]):
                code, err = cli_fails(*change, "--ledger", str(copy))
                assert code == 4 and "ledger unavailable" in err and "read" in err, (change, err)
            assert sorted(p.name for p in disk.iterdir()) == ["copy.db"]
            # Restoring it is a backup of the backup, to writable storage.
            back = cli_json("backup", str(tmp_path / "restored.db"), "--ledger", str(copy))
            assert {**back, "path": made["path"]} == made
    assert expected["verify"]["ok"] is True


def test_a_wal_without_its_index_on_read_only_media_is_refused_saying_why(
    tmp_path: Path,
) -> None:
    """A ledger copied with its ``-wal`` file but not its ``-shm`` index, onto read-only
    media: the last commits are only in the ``-wal``, which SQLite cannot read there, and
    reading the main file alone would silently leave them out. Exit 4, saying so and
    what to do, rather than a partial ledger that verifies."""
    ledger = tmp_path / "ledger.db"
    assert main(["migrate", "--ledger", str(ledger)]) == 0
    holder = sqlite3.connect(ledger)  # open, so the -wal outlives the change below
    try:
        holder.execute("SELECT 1 FROM events LIMIT 1").fetchall()
        assert main(["budget", "set", "team", "--limit", "5", "--ledger", str(ledger)]) == 0
        with small_tmpfs(tmp_path / "media", "16m") as disk:
            for name in ("ledger.db", "ledger.db-wal"):
                shutil.copy(tmp_path / name, disk / name)
            holder.close()
            with read_only(disk):
                for verb in ("verify", "budgets", "calls"):
                    code, err = cli_fails(verb, "--ledger", str(disk / "ledger.db"))
                    assert code == 4 and "ledger unavailable" in err, (verb, err)
                    assert "-wal" in err and "writable" in err, (verb, err)
    finally:
        holder.close()
