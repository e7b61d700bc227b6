"""Ledger verification on SQLite: a clean ledger passes, and seeded corruptions are caught."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from effectguard.ledger import AdmitRequest, Ledger, Writer, operations
from effectguard.ops.verify import VerifyReport, verify_ledger
from effectguard.rules.events import (
    AttemptObserved,
    BudgetSettled,
    CallCompleted,
    canonical_json,
    event_digest,
)

R = 1_000


@dataclass(frozen=True)
class Built:
    """A small SQLite ledger and the facts the tests need about it."""

    path: Path
    completed: str
    reconciled: str
    in_flight: str
    events: int


def request(key: str) -> AdmitRequest:
    """An admit request charged to team/run."""
    return AdmitRequest(
        request_hash=f"hash-{key}",
        provider="openai",
        endpoint="/v1/chat/completions",
        method="POST",
        model="gpt-x",
        idempotency_key=key,
        budget="team/run",
        budget_root="team",
        effect_kind="billable",
        body='{"messages": [{"role": "user", "content": "hi"}]}',
        body_encoding="utf8",
        stream=False,
        reserve=R,
    )


@pytest.fixture
async def built(tmp_path: Path) -> Built:
    """A ledger with a limit, one completed, one reconciled and one in-flight call."""
    path = tmp_path / "ledger.db"
    async with Ledger.open(str(path)) as ledger:
        writer = await ledger.store.write(
            Writer("boot", 0),
            lambda tx: operations.register_worker(tx, worker="w1", host="h", pid=1, lease_s=30),
        )
        await ledger.set_limit("team", 10**9)
        done = await ledger.admit(writer, request("a"))
        await ledger.record(
            writer,
            done.call_id,
            1,
            [
                AttemptObserved(
                    call=done.call_id,
                    attempt=1,
                    status=200,
                    not_processed=False,
                    usage={"input_tokens": 1, "output_tokens": 2},
                    usage_problem=None,
                    headers={},
                    body='{"ok": true}',
                ),
                BudgetSettled(call=done.call_id, budget="team/run", reserved=R, actual=700),
                CallCompleted(call=done.call_id, outcome="completed"),
            ],
        )
        unknown = await ledger.admit(writer, request("b"))
        await ledger.interrupt(writer, unknown.call_id, 1, "read timeout")
        await ledger.reconcile(unknown.call_id, applied=True, cost=400, note="seen", by="ann")
        flying = await ledger.admit(writer, request("c"))
        report = await verify_ledger(ledger)
        assert report.ok, report.problems
        return Built(path, done.call_id, unknown.call_id, flying.call_id, report.events)


@contextmanager
def raw(path: Path) -> Iterator[sqlite3.Connection]:
    """A raw connection to the ledger file, the way an intruder (or a bad tool) would edit it."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        yield conn
    finally:
        conn.close()


def seq_of(path: Path, call_id: str, kind: str) -> int:
    """The sequence number of ``call_id``'s event of ``kind``."""
    with raw(path) as conn:
        row = conn.execute(
            "SELECT seq FROM events WHERE call_id = ? AND kind = ?", (call_id, kind)
        ).fetchone()
    assert row is not None
    return int(row[0])


async def verify(path: Path) -> VerifyReport:
    """Open the ledger at ``path`` and verify it."""
    async with Ledger.open(str(path)) as ledger:
        return await verify_ledger(ledger)


async def test_clean_ledger_verifies(built: Built) -> None:
    """An untouched ledger passes, counting its events, calls and budget nodes."""
    report = await verify(built.path)
    assert report.ok
    assert report.problems == []
    assert report.first_broken_seq is None
    assert (report.events, report.calls, report.budgets) == (built.events, 3, 2)


async def test_verify_pages_through_the_whole_chain(built: Built) -> None:
    """A tiny page size still walks every event and verifies."""
    async with Ledger.open(str(built.path)) as ledger:
        report = await verify_ledger(ledger, page=2)
    assert report.ok, report.problems
    assert report.events == built.events


@pytest.mark.parametrize(
    ("kind", "edit"),
    [
        ("budget.reserved", "json_set(data, '$.amount', 999999)"),
        ("call.manifest", "json_set(data, '$.body', 'something else')"),
        ("attempt.observed", "json_set(data, '$.status', 500)"),
    ],
)
async def test_edited_payload_is_named(built: Built, kind: str, edit: str) -> None:
    """An edited event payload breaks its digest; that event is the first one named."""
    seq = seq_of(built.path, built.completed, kind)
    with raw(built.path) as conn:
        conn.execute("DROP TRIGGER events_no_update")
        conn.execute(f"UPDATE events SET data = {edit} WHERE seq = ?", (seq,))
    report = await verify(built.path)
    assert not report.ok
    assert report.first_broken_seq == seq
    assert report.problems[0] == f"event {seq}: digest does not match its content"


async def test_resealed_edit_is_caught_by_the_next_link(built: Built) -> None:
    """An edit whose digest is recomputed still breaks the successor's predecessor link."""
    seq = seq_of(built.path, built.completed, "call.manifest")
    with raw(built.path) as conn:
        conn.execute("DROP TRIGGER events_no_update")
        kind, call_id, data, worker, generation, at, prev = conn.execute(
            "SELECT kind, call_id, data, worker, generation, at, prev_digest FROM events "
            "WHERE seq = ?",
            (seq,),
        ).fetchone()
        payload = json.loads(data)
        payload["body"] = "forged"
        data_json = canonical_json(payload)
        digest = event_digest(
            seq=seq,
            kind=kind,
            call_id=call_id,
            data_json=data_json,
            worker=worker,
            generation=generation,
            at=at,
            prev_digest=prev,
        )
        conn.execute(
            "UPDATE events SET data = ?, digest = ? WHERE seq = ?", (data_json, digest, seq)
        )
    report = await verify(built.path)
    assert not report.ok
    assert report.first_broken_seq == seq + 1
    assert report.problems[0] == f"event {seq + 1}: predecessor digest does not match"


async def test_deleted_event_is_named(built: Built) -> None:
    """A deleted event leaves a gap; the event after it is named and the missing number given."""
    seq = seq_of(built.path, built.reconciled, "attempt.started")
    with raw(built.path) as conn:
        conn.execute("DROP TRIGGER events_no_delete")
        conn.execute("DELETE FROM events WHERE seq = ?", (seq,))
    report = await verify(built.path)
    assert not report.ok
    assert report.first_broken_seq == seq + 1
    assert report.problems[0] == (
        f"event {seq + 1}: expected sequence number {seq} (an event is missing)"
    )
    assert f"event {seq + 1}: predecessor digest does not match" in report.problems


async def test_deleted_last_event_shows_in_the_call_state(built: Built) -> None:
    """Deleting the newest event leaves no gap, but the stored call state no longer matches."""
    with raw(built.path) as conn:
        conn.execute("DROP TRIGGER events_no_delete")
        conn.execute("DELETE FROM events WHERE seq = (SELECT max(seq) FROM events)")
    report = await verify(built.path)
    assert not report.ok
    assert any(built.in_flight in p for p in report.problems)


@pytest.mark.parametrize("column", ["spent", "reserved", "held", "limit_nanos"])
@pytest.mark.parametrize("path", ["team", "team/run"])
async def test_budget_counter_disagreeing_with_events_is_named(
    built: Built, column: str, path: str
) -> None:
    """A budget counter that is not the fold of the events is reported by path."""
    with raw(built.path) as conn:
        conn.execute(
            f"UPDATE budgets SET {column} = coalesce({column}, 0) + 1 WHERE path = ?", (path,)
        )
    report = await verify(built.path)
    assert not report.ok
    assert len(report.problems) == 1
    assert report.problems[0].startswith(f"budget {path!r}: stored ")
    assert report.first_broken_seq is not None


async def test_deleted_budget_row_is_named(built: Built) -> None:
    """A budget node missing from the table is reported."""
    with raw(built.path) as conn:
        conn.execute("DELETE FROM budgets WHERE path = 'team/run'")
    report = await verify(built.path)
    assert not report.ok
    assert any(p.startswith("budget 'team/run'") for p in report.problems)


async def test_call_state_disagreeing_with_events_is_named(built: Built) -> None:
    """A call row whose stored state is not the projection of its events is reported by id."""
    with raw(built.path) as conn:
        conn.execute(
            "UPDATE calls SET stage = 'completed', state = json_set(state, '$.stage', 'completed') "
            "WHERE call_id = ?",
            (built.in_flight,),
        )
    report = await verify(built.path)
    assert not report.ok
    assert (
        f"call {built.in_flight}: stored state completed differs from the projection of its "
        "events (in_flight)"
    ) in report.problems
    assert all(built.in_flight in p for p in report.problems)


async def test_call_state_money_disagreeing_is_named(built: Built) -> None:
    """A call whose stored cost differs from its events is reported (not only its stage)."""
    with raw(built.path) as conn:
        conn.execute(
            "UPDATE calls SET state = json_set(state, '$.cost', 1) WHERE call_id = ?",
            (built.completed,),
        )
    report = await verify(built.path)
    assert not report.ok
    assert any(built.completed in p for p in report.problems)


async def test_deleted_call_row_is_named(built: Built) -> None:
    """A call whose row is gone is reported."""
    with raw(built.path) as conn:
        conn.execute("DELETE FROM calls WHERE call_id = ?", (built.reconciled,))
    report = await verify(built.path)
    assert not report.ok
    assert any(built.reconciled in p for p in report.problems)


async def test_stage_column_disagreeing_with_events_is_named(built: Built) -> None:
    """A calls.stage column that disagrees with the events is reported, since queries use it."""
    with raw(built.path) as conn:
        conn.execute("UPDATE calls SET stage = 'completed' WHERE call_id = ?", (built.in_flight,))
    report = await verify(built.path)
    assert not report.ok
    assert any(built.in_flight in p for p in report.problems)
