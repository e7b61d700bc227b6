"""``effectguard archive`` on PostgreSQL: into the archive table, verify across the cut.

Real ``effectguard serve`` replicas on one PostgreSQL ledger (a fresh schema per test)
serve the fake provider; archives are taken with the CLI while they serve. After each,
``verify`` passes on the live ledger (continuity across the cut) and ``verify
--archived`` on the archive table on its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from observing import wait_for
from pgkit import NEEDS_PG, pg_url
from test_archive import CHAT, archive, chat, cli, later, reseal_mark

from effectguard.ledger.pgschema import Target
from effectguard.ops.cli import main
from effectguard.testing import Proxy, fake_provider, running_proxy, start_proxy

_ = (pg_url,)  # fixtures

pytestmark = [*NEEDS_PG, pytest.mark.slow]


def verified(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``verify`` passes on the live ledger and ``verify --archived`` on the table."""
    code, report = cli(capsys, "verify", "--ledger", url)
    assert code == 0, report["problems"]
    code, report = cli(capsys, "verify", "--archived", "--ledger", url)
    assert code == 0, report["problems"]


def sql(url: str, query: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Run ``query`` in the ledger's schema as the database owner."""
    conn = Target.parse(url).connect()
    try:
        cursor = conn.execute(query, params)
        return cursor.fetchall() if cursor.description else []
    finally:
        conn.close()


def post(proxy: Proxy, n: int, **headers: str) -> httpx.Response:
    return httpx.post(proxy.url + CHAT, json=chat(n), headers=headers, timeout=30)


def test_pg_archive_verifies_across_the_cut_and_an_archived_key_is_never_resent(
    tmp_path: Path, pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Keyed completed calls move to the archive table; verify passes live and on the
    table; a resent key answers 409 archived (422 for another body), and the provider
    sees nothing more; a second archive continues the chain."""
    with (
        fake_provider(tmp_path / "receipts.jsonl") as fake,
        running_proxy(
            pg_url, upstreams={"openai": fake.url}, log_path=tmp_path / "proxy.log"
        ) as proxy,
    ):
        for n in range(4):
            r = post(proxy, n, **{"Idempotency-Key": f"key-{n}", "Effectguard-Budget": "team/a"})
            assert r.status_code == 200, r.text
        _, spent_before = cli(capsys, "budgets", "--ledger", pg_url)
        moved = archive(pg_url, capsys)
        assert (moved["path"], moved["first_seq"]) == ("archived_events", 1)
        assert moved["calls"] == 4 and moved["keys"] == 4
        assert sql(pg_url, "SELECT count(*) FROM calls") == [(0,)]
        assert archive(pg_url, capsys)["events"] == 0  # no call left: nothing more to move
        verified(pg_url, capsys)
        assert cli(capsys, "budgets", "--ledger", pg_url)[1] == spent_before

        sent = len(fake.receipts())
        again = post(proxy, 0, **{"Idempotency-Key": "key-0", "Effectguard-Budget": "team/a"})
        assert again.status_code == 409, again.text
        assert again.json()["error"]["type"] == "archived"
        assert again.headers["x-should-retry"] == "false"
        other = post(proxy, 99, **{"Idempotency-Key": "key-1", "Effectguard-Budget": "team/a"})
        assert other.status_code == 422, other.text
        assert len(fake.receipts()) == sent  # never resent

        for n in range(10, 13):
            assert post(proxy, n).status_code == 200
        second = archive(pg_url, capsys)
        assert second["first_seq"] == moved["checkpoint_seq"]
        verified(pg_url, capsys)
        # The first checkpoint is archived too now, and still the chain's.
        assert sql(pg_url, "SELECT count(*) FROM archives") == [(2,)]
    # A range row gone from the middle of the archive leaves a gap that is named.
    sql_script(pg_url, "DELETE FROM archives WHERE first_seq = 1")
    code, report = cli(capsys, "verify", "--archived", "--ledger", pg_url)
    assert code == 1
    assert any("follows event 0" in p for p in report["problems"]), report["problems"]


def test_pg_archive_takes_a_keyed_call_that_had_no_effect_and_keeps_its_key(
    tmp_path: Path, pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A keyed call the provider refused (400: ``not_processed``) once held the cut until
    its key came again. It had no effect, so it leaves with the calls around it; the table
    verifies, and its key answers 409 archived from then on, nothing sent."""
    key = {"Idempotency-Key": "refused-1"}
    with (
        fake_provider(tmp_path / "receipts.jsonl", error_status=400) as fake,
        running_proxy(
            pg_url, upstreams={"openai": fake.url}, log_path=tmp_path / "proxy.log"
        ) as proxy,
    ):
        refused = post(proxy, 0, **key)
        assert refused.status_code == 400, refused.text
        assert sql(pg_url, "SELECT stage FROM calls") == [("not_processed",)]
        moved = archive(pg_url, capsys)
        assert (moved["calls"], moved["keys"], moved.get("held_by")) == (1, 1, None), moved
        verified(pg_url, capsys)
        sent = len(fake.receipts())
        again = post(proxy, 0, **key)
        assert again.status_code == 409 and again.json()["error"]["type"] == "archived"
        assert again.headers["effectguard-call-id"] == refused.headers["effectguard-call-id"]
        assert len(fake.receipts()) == sent


def test_pg_archive_never_takes_an_unresolved_call(
    tmp_path: Path, pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A call in flight during an archive stays live with everything after it; once it
    completes, the next archive takes it."""
    with (
        fake_provider(tmp_path / "receipts.jsonl") as fake,
        running_proxy(
            pg_url, upstreams={"openai": fake.url}, log_path=tmp_path / "proxy.log"
        ) as proxy,
        ThreadPoolExecutor(1) as pool,
    ):
        assert post(proxy, 0).status_code == 200
        held = pool.submit(post, proxy, 1, **{"x-fake-delay": "4"})
        wait_for(
            lambda: sql(pg_url, "SELECT 1 FROM calls WHERE stage = 'in_flight'"),
            20,
            "the held call to start",
        )
        assert post(proxy, 2).status_code == 200
        assert archive(pg_url, capsys)["calls"] == 1  # only the call before the held one
        stages = sorted(s for (s,) in sql(pg_url, "SELECT stage FROM calls"))
        assert stages == ["completed", "in_flight"]
        verified(pg_url, capsys)
        assert held.result(timeout=30).status_code == 200
        assert archive(pg_url, capsys)["calls"] == 2
        verified(pg_url, capsys)


def test_pg_archive_under_two_replicas_serving(
    tmp_path: Path, pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two replicas serve keyed calls without pause while archives run: every archive
    commits or is told to run again, verify passes after each, and every key answers
    (200 when live, 409 once archived) without a second provider call."""
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        replicas = [
            start_proxy(pg_url, upstreams={"openai": fake.url}, log_path=tmp_path / f"r{i}.log")
            for i in range(2)
        ]
        try:
            stop = time.monotonic() + 8

            def load(i: int) -> int:
                n = 0
                while time.monotonic() < stop:
                    r = post(replicas[i % 2], 1000 * i + n, **{"Idempotency-Key": f"k{i}-{n}"})
                    assert r.status_code == 200, r.text
                    n += 1
                return n

            with ThreadPoolExecutor(4) as pool:
                sent = pool.map(load, range(4))
                moved = 0
                while time.monotonic() < stop:
                    code, result = cli(capsys, "archive", "--ledger", pg_url, "--before", later())
                    assert code == 0 or "run archive again" in result["err"], result
                    moved += result.get("calls", 0)
                    verified(pg_url, capsys)
                    time.sleep(0.5)
                counts = list(sent)
            assert moved > 0
            moved += archive(pg_url, capsys)["calls"]
            verified(pg_url, capsys)
            assert moved == sum(counts) == len(fake.receipts())
            for i in range(4):  # archived keys are refused, never resent
                r = post(replicas[i % 2], 1000 * i, **{"Idempotency-Key": f"k{i}-0"})
                assert r.status_code == 409, r.text
            assert len(fake.receipts()) == sum(counts)
        finally:
            for proxy in replicas:
                proxy.stop()


def test_pg_archive_in_steps_copies_the_chain_range_by_range_and_survives_a_crash(
    tmp_path: Path, pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Calls that overlap, archived in steps of 5 events: each step is its own
    transaction, ``archives`` row and checkpoint, ``archived_events`` holds the live
    chain's rows exactly, and ``verify --archived`` passes. SIGKILL between two steps
    leaves a ledger that verifies, and the next archive goes on from that cut."""
    with (
        fake_provider(tmp_path / "receipts.jsonl") as fake,
        running_proxy(
            pg_url, upstreams={"openai": fake.url}, log_path=tmp_path / "proxy.log"
        ) as proxy,
        ThreadPoolExecutor(4) as pool,
    ):
        # Three waves of four: calls of a wave overlap, and a cut falls between waves
        # however loaded the machine, so what the killed step leaves takes 2 steps or more
        # (12 calls sent at once overlapped end to end on a busy CI and left one cut).
        for wave in range(3):
            ns = range(4 * wave, 4 * wave + 4)
            keyed = [pool.submit(post, proxy, n, **{"Idempotency-Key": f"s-{n}"}) for n in ns]
            assert {f.result().status_code for f in keyed} == {200}
        rows = "SELECT seq, kind, call_id, data, digest FROM {} WHERE seq <= %s ORDER BY seq"
        head = sql(pg_url, "SELECT max(seq) FROM events")[0][0]
        before = sql(pg_url, rows.format("events"), (head,))

        env = {**os.environ, "EFFECTGUARD_CRASH_AT": "after:archive-step"}
        command = [sys.executable, "-m", "effectguard", "archive", "--ledger", pg_url]
        killed = subprocess.run(
            [*command, "--before", later(), "--step-events", "5"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert killed.returncode == -9, killed.stderr
        assert sql(pg_url, "SELECT count(*) FROM archives") == [(1,)]
        verified(pg_url, capsys)

        rest = archive(pg_url, capsys, "--step-events", "5")
        assert rest["steps"] >= 2 and rest["files"] == [], rest
        assert sql(pg_url, "SELECT count(*) FROM calls") == [(0,)]
        assert sql(pg_url, "SELECT count(*) FROM archives") == [(rest["steps"] + 1,)]
        assert sql(pg_url, rows.format("archived_events"), (head,)) == before
        verified(pg_url, capsys)
        sent = len(fake.receipts())
        assert post(proxy, 3, **{"Idempotency-Key": "s-3"}).status_code == 409
        assert len(fake.receipts()) == sent == 12


def test_pg_tampering_with_the_archive_table_is_caught(
    tmp_path: Path, pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The archive tables refuse changes; an owner who disables the triggers and edits a
    body, drops an event, or reseals a range end to end is caught by verify --archived."""
    with (
        fake_provider(tmp_path / "receipts.jsonl") as fake,
        running_proxy(
            pg_url, upstreams={"openai": fake.url}, log_path=tmp_path / "proxy.log"
        ) as proxy,
    ):
        for n in range(3):
            assert post(proxy, n).status_code == 200
        archive(pg_url, capsys)
    verified(pg_url, capsys)
    with pytest.raises(psycopg.errors.RaiseException, match="append-only"):
        sql(pg_url, "UPDATE archived_events SET data = data WHERE seq = 2")
    with pytest.raises(psycopg.errors.RaiseException, match="append-only"):
        sql(pg_url, "DELETE FROM archives")

    def tampered(*statements: str) -> list[str]:
        """Problems verify --archived names after ``statements`` (then undone)."""
        conn = Target.parse(pg_url).connect()
        try:
            conn.execute("BEGIN")
            conn.execute("SET LOCAL session_replication_role = replica")  # triggers off
            for statement in statements:
                conn.execute(statement)
            conn.execute("SET LOCAL session_replication_role = origin")
            conn.execute("COMMIT")
            code, report = cli(capsys, "verify", "--archived", "--ledger", pg_url)
            assert code == 1, report
            problems: list[str] = report["problems"]
            return problems
        finally:
            conn.close()

    edited = "UPDATE archived_events SET data = replace(data, 'archive 1', 'archive 7')"
    problems = tampered("CREATE TABLE saved AS SELECT * FROM archived_events", edited)
    assert any("digest" in p for p in problems), problems
    restore = "DELETE FROM archived_events; INSERT INTO archived_events SELECT * FROM saved"
    sql_script(pg_url, restore)
    verified(pg_url, capsys)
    problems = tampered("DELETE FROM archived_events WHERE seq = 3")
    assert any("expected sequence number" in p for p in problems), problems
    sql_script(pg_url, restore)

    # A forger who reseals the range (fresh chain, fresh checkpoint row) passes the
    # range's own checks, but not the checkpoint the live chain holds.
    resealed = _resealed(pg_url)
    problems = tampered(*resealed)
    assert problems and all("not this archive's" in p for p in problems), problems
    # Events in the table that no range row accounts for are named.
    problems = tampered("DELETE FROM archives")
    assert any("belong to no archived range" in p for p in problems), problems


def sql_script(url: str, script: str) -> None:
    """Run ``script`` with the archive tables' triggers off (to undo a tampering)."""
    conn = Target.parse(url).connect()
    try:
        conn.execute("BEGIN")
        conn.execute("SET LOCAL session_replication_role = replica")
        for statement in script.split(";"):
            conn.execute(statement)
        conn.execute("COMMIT")
    finally:
        conn.close()


def _resealed(url: str) -> list[str]:
    """Statements rewriting archived event 2's body, resealing the range and its row."""
    from effectguard.ops.archivefile import event_line, lines_sha256
    from effectguard.rules.events import StoredEvent, canonical_json, event_digest

    rows = sql(
        url,
        "SELECT seq, kind, call_id, data, worker, generation, at, prev_digest, "
        "digest FROM archived_events ORDER BY seq",
    )
    (line,) = sql(url, "SELECT checkpoint FROM archives")[0]
    events, prev, statements = [], rows[0][7], []
    for seq, kind, call_id, data, worker, gen, at, _, _ in rows:
        body = json.loads(data)
        if seq == 2:
            body["body"] = body["body"].replace("archive", "forged!")
        digest = event_digest(
            seq=seq,
            kind=kind,
            call_id=call_id,
            data_json=canonical_json(body),
            worker=worker,
            generation=gen,
            at=at,
            prev_digest=prev,
        )
        events.append(StoredEvent(seq, kind, call_id, body, worker, gen, at, prev, digest))
        statements.append(
            f"UPDATE archived_events SET data = {_lit(canonical_json(body))}, "
            f"prev_digest = {_lit(prev)}, digest = {_lit(digest)} WHERE seq = {seq}"
        )
        prev = digest
    mark = json.loads(line)
    reseal_mark(mark, prev, lines_sha256([event_line(e) for e in events]))
    statements.append(f"UPDATE archives SET checkpoint = {_lit(canonical_json(mark))}")
    return statements


def _lit(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def test_pg_events_refuse_a_delete_outside_an_archive(pg_url: str) -> None:
    """Only events up to a checkpoint's range may be deleted, and the mark that allows it
    moves only with a checkpoint as the newest event."""
    assert main(["migrate", "--ledger", pg_url]) == 0
    assert main(["budget", "set", "team", "--limit", "5", "--ledger", pg_url]) == 0
    with pytest.raises(psycopg.errors.RaiseException, match="append-only"):
        sql(pg_url, "DELETE FROM events WHERE seq = 1")
    with pytest.raises(psycopg.errors.RaiseException, match="append-only"):
        sql(pg_url, "UPDATE events SET kind = kind WHERE seq = 1")
    with pytest.raises(psycopg.errors.RaiseException, match="checkpoint"):
        sql(pg_url, "UPDATE meta SET value = 1 WHERE key = 'archived_through'")
    # Deleting the mark itself does not open the table either.
    sql(pg_url, "DELETE FROM meta WHERE key = 'archived_through'")
    with pytest.raises(psycopg.errors.RaiseException, match="append-only"):
        sql(pg_url, "DELETE FROM events WHERE seq = 1")


def test_pg_verify_refuses_archive_file_and_archived_together(
    tmp_path: Path, pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``verify --archive FILE --archived`` on PostgreSQL is refused with exit 2 naming
    both options, as on SQLite, rather than proving the table and ignoring the file."""
    assert main(["migrate", "--ledger", pg_url]) == 0
    file = tmp_path / "a.jsonl.gz"
    file.write_bytes(b"not an archive")
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        main(["verify", "--archive", str(file), "--archived", "--ledger", pg_url])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "--archived" in err and "--archive" in err.replace("--archived", "")
