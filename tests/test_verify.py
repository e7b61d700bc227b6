"""Ledger verification on SQLite: a clean ledger passes, and seeded corruptions are caught."""

from __future__ import annotations

import json
import sqlite3
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from admitkit import admit_request
from eventkit import completion

from effectguard.errors import LedgerCorrupt
from effectguard.ledger import (
    AdmitRequest,
    Ledger,
    Writer,
    operations,
    sqlitecalls,
    sqliteevents,
    sqliterecords,
    writerformat,
)
from effectguard.ledger.rows import SLIM_FIELDS
from effectguard.ledger.sqliterecords import events_from_row
from effectguard.ops.verify import VerifyReport, verify_ledger
from effectguard.rules.budget import fold as budget_fold
from effectguard.rules.events import (
    AttemptInterrupted,
    AttemptStarted,
    BudgetHeld,
    BudgetReserved,
    BudgetUnheld,
    CallManifest,
    CallReconciled,
    Event,
    StoredEvent,
    canonical_json,
    event_digest,
    stored_digest,
)
from effectguard.rules.workstate import work_state

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
    body = '{"messages": [{"role": "user", "content": "hi"}]}'
    return admit_request(request_hash=f"hash-{key}", key=key, body=body, reserve=R)


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
            completion(
                done.call_id,
                budget="team/run",
                reserved=R,
                actual=700,
                usage={"input_tokens": 1, "output_tokens": 2},
                body='{"ok": true}',
            ),
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
    # Anyone may declare a writer format: it keeps older releases out, not intruders.
    writerformat.declare_sqlite(conn)
    try:
        yield conn
    finally:
        conn.close()


def state_path(field: str) -> str:
    """The JSON path of a call state's ``field`` as SQLite stores it (rows.SLIM_FIELDS;
    the other fields are columns of the calls row)."""
    return f"$[{SLIM_FIELDS.index(field)}]"


def stored_of(path: Path, call_id: str, kind: str) -> StoredEvent:
    """``call_id``'s event of ``kind`` as the store reads it (with the record it is in)."""
    with raw(path) as conn:
        rows = conn.execute(
            f"SELECT {sqliteevents.SELECT_COLUMNS} FROM events e WHERE e.call_id = ? "
            "ORDER BY e.seq",
            (sqliteevents.call_key(call_id),),
        ).fetchall()
    found = [e for row in rows for e in events_from_row(row) if e.kind == kind]
    assert found, f"no {kind} of {call_id}"
    return found[0]


def record_of(path: Path, call_id: str, kind: str) -> tuple[int, int]:
    """The first and last seq of the stored record holding ``call_id``'s ``kind`` event."""
    record = stored_of(path, call_id, kind).record
    assert record is not None, f"{kind} of {call_id} is a row of its own"
    return record


def record_problem(first: int, last: int) -> str:
    """What verify says of a record whose content does not match its digest."""
    return (
        f"events {first}..{last} (one stored record, sealed by event {last}'s digest): their "
        "content does not match that digest; one of these events, or the digest, was "
        "changed (the record cannot tell which event)"
    )


def key(call_id: str) -> tuple[bytes | str]:
    """The parameters naming ``call_id``'s row (the calls table keys a call by its bytes)."""
    return (sqliteevents.call_key(call_id),)


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


async def test_rows_read_a_call_a_page_are_each_compared(built: Built) -> None:
    """verify reads the calls' rows and kept states in pages: with one call a page, a
    wrong column of each of the three calls (three pages) is named, and a call whose
    row is gone is named on no page and still found."""
    calls = (built.completed, built.reconciled, built.in_flight)
    with raw(built.path) as conn:
        for call_id in calls:
            conn.execute("UPDATE calls SET provider = 'elsewhere' WHERE call_id = ?", key(call_id))
    async with Ledger.open(str(built.path)) as ledger:
        report = await verify_ledger(ledger, page=1)
    for call_id in calls:
        assert [p for p in report.problems if p.startswith(f"call {call_id}: columns differ")]
    with raw(built.path) as conn:
        conn.execute("DELETE FROM calls WHERE call_id = ?", key(built.reconciled))
    async with Ledger.open(str(built.path)) as ledger:
        report = await verify_ledger(ledger, page=1)
    gone = f"call {built.reconciled}: stored state None differs from the projection"
    assert [p for p in report.problems if p.startswith(gone)], report.problems


#: Edits of one event's data, each stored back into its record without resealing it.
EDITS: list[tuple[str, Callable[[dict[str, Any]], dict[str, Any]]]] = [
    ("call.manifest", lambda data: data | {"body": "something else"}),
    ("budget.reserved", lambda data: data | {"amount": 999999}),
    ("attempt.started", lambda data: data | {"attempt": 2}),
    ("attempt.observed", lambda data: data | {"status": 500}),
    ("budget.settled", lambda data: data | {"actual": 1}),
    ("call.completed", lambda data: data | {"outcome": "failed"}),
]


def edit_in_record(path: Path, call_id: str, kind: str, edit: Callable[..., Any]) -> None:
    """Store ``call_id``'s ``kind`` event edited by ``edit`` back in its record, the
    record's other events and its digest as they were."""
    _, last = record_of(path, call_id, kind)
    with raw(path) as conn:
        conn.execute("DROP TRIGGER events_no_update")
        row = conn.execute(
            f"SELECT {sqliteevents.SELECT_COLUMNS} FROM events e WHERE e.seq = ?", (last,)
        ).fetchone()
        run = [replace(e, data=edit(e.data)) if e.kind == kind else e for e in events_from_row(row)]
        params = sqliterecords.record_params(run, None, None)
        conn.execute(
            "UPDATE events SET data = ?, body = ?, hash = ? WHERE seq = ?",
            (params[3], params[4], params[11], last),
        )


@pytest.mark.parametrize(("kind", "edit"), EDITS)
async def test_an_edited_event_inside_a_record_names_the_records_events(
    built: Built, kind: str, edit: Callable[[dict[str, Any]], dict[str, Any]]
) -> None:
    """An event edited inside a stored record (any of an admission's or an observation's)
    no longer reaches the one digest the record keeps: verify names the record's events,
    first to last, and says it cannot tell which of them was edited."""
    first, last = record_of(built.path, built.completed, kind)
    edit_in_record(built.path, built.completed, kind, edit)
    report = await verify(built.path)
    assert not report.ok
    assert record_problem(first, last) in report.problems
    assert report.first_broken_seq is not None and first <= report.first_broken_seq <= last


@pytest.mark.parametrize(
    ("kind", "edit"),
    [
        ("budget.reserved", "data = json_set(data, '$[1][1]', 999999)"),  # a compact amount
        ("attempt.observed", "digest = randomblob(32)"),  # the record's one digest
    ],
)
async def test_an_edit_of_a_records_row_names_the_records_events(
    built: Built, kind: str, edit: str
) -> None:
    """The same for an edit made in SQL (a compact item's value, [code, values...]; the
    stored digest itself): the record's events are named, at its last."""
    first, last = record_of(built.path, built.completed, kind)
    with raw(built.path) as conn:
        conn.execute("DROP TRIGGER events_no_update")
        conn.execute(f"UPDATE events SET {edit} WHERE seq = ?", (last,))
    report = await verify(built.path)
    assert report.first_broken_seq == last
    assert report.problems[0] == record_problem(first, last)


async def test_a_body_no_event_of_its_record_takes_is_refused(built: Built) -> None:
    """A body put into a record's row where none of its events takes one (here beside an
    admission whose manifest keeps its body in its data) is not silently ignored: the
    record does not read, and verify says which."""
    first, last = record_of(built.path, built.completed, "call.manifest")
    with raw(built.path) as conn:
        conn.execute("DROP TRIGGER events_no_update")
        conn.execute("UPDATE events SET body = x'00' WHERE seq = ?", (last,))
    with pytest.raises(LedgerCorrupt, match=f"events {first}..{last}"):
        await verify(built.path)


async def test_an_edited_event_of_its_own_row_is_named(built: Built) -> None:
    """An event stored in a row of its own (here the limit an operator set) is named alone."""
    with raw(built.path) as conn:
        (seq,) = conn.execute("SELECT seq FROM events WHERE kind = 'budget.limit_set'").fetchone()
        conn.execute("DROP TRIGGER events_no_update")
        conn.execute("UPDATE events SET data = json_set(data, '$[1]', 5) WHERE seq = ?", (seq,))
    report = await verify(built.path)
    assert report.first_broken_seq == seq
    assert report.problems[0] == f"event {seq}: digest does not match its content"


async def test_resealed_edit_is_caught_by_the_next_link(built: Built) -> None:
    """An edit whose record is resealed (every digest in it recomputed, the last stored)
    still breaks the next row, whose digests cover the record's original digest (SQLite
    derives the link from the row before, so it is the next record's own digest that no
    longer matches)."""
    _, last = record_of(built.path, built.completed, "call.manifest")
    with raw(built.path) as conn:
        conn.execute("DROP TRIGGER events_no_update")
        row = conn.execute(
            f"SELECT {sqliteevents.SELECT_COLUMNS} FROM events e WHERE e.seq = ?", (last,)
        ).fetchone()
        prev, forged = "", []
        for old in events_from_row(row):
            data = old.data | {"body": "forged"} if old.kind == "call.manifest" else old.data
            prev = prev or old.prev_digest
            forged.append(replace(old, data=data, prev_digest=prev, digest=sealed(old, data, prev)))
            prev = forged[-1].digest
        params = sqliterecords.record_params(forged, None, None)
        conn.execute(
            "UPDATE events SET data = ?, body = ?, digest = ? WHERE seq = ?",
            (params[3], params[4], params[9], last),
        )
    after = record_of(built.path, built.completed, "attempt.observed")
    report = await verify(built.path)
    assert not report.ok
    assert report.first_broken_seq == after[1] == after[0] + 2 and after[0] == last + 1
    assert report.problems[0] == record_problem(*after)


def sealed(old: StoredEvent, data: dict[str, Any], prev: str) -> str:
    """``old``'s digest with ``data`` and predecessor ``prev``, as a forger computes it."""
    return stored_digest(replace(old, data=data, prev_digest=prev))


async def test_deleted_event_is_named(built: Built) -> None:
    """A deleted row (here an admission's record) leaves a gap; the event after it is named
    and the first missing number given."""
    first, last = record_of(built.path, built.reconciled, "attempt.started")
    with raw(built.path) as conn:
        conn.execute("DROP TRIGGER events_no_delete")
        conn.execute("DELETE FROM events WHERE seq = ?", (last,))
    report = await verify(built.path)
    assert not report.ok
    assert report.first_broken_seq == last + 1
    assert report.problems[0] == (
        f"event {last + 1}: expected sequence number {first} (an event is missing)"
    )
    assert f"event {last + 1}: predecessor digest does not match" in report.problems


async def test_deleted_last_event_shows_in_the_call_state(built: Built) -> None:
    """Deleting the newest event leaves no gap, but the stored call state no longer matches."""
    with raw(built.path) as conn:
        conn.execute("DROP TRIGGER events_no_delete")
        conn.execute("DELETE FROM events WHERE seq = (SELECT max(seq) FROM events)")
    report = await verify(built.path)
    assert not report.ok
    assert any(built.in_flight in p for p in report.problems)


@pytest.mark.parametrize("column", ["spent", "reserved", "held"])
@pytest.mark.parametrize("path", ["team", "team/run"])
async def test_budget_counter_disagreeing_with_events_is_named(
    built: Built, column: str, path: str
) -> None:
    """A budget counter that is not the fold of the events is reported by path and period."""
    with raw(built.path) as conn:
        conn.execute(f"UPDATE budget_periods SET {column} = {column} + 1 WHERE path = ?", (path,))
    report = await verify(built.path)
    assert not report.ok
    assert len(report.problems) == 1
    assert report.problems[0].startswith(f"budget {path!r} period total: stored ")
    assert report.first_broken_seq is not None


@pytest.mark.parametrize("path", ["team", "team/run"])
async def test_budget_limit_disagreeing_with_events_is_named(built: Built, path: str) -> None:
    """A stored budget policy that is not the one the events declared is reported by path."""
    with raw(built.path) as conn:
        conn.execute(
            "INSERT INTO budgets(path, limit_nanos) VALUES (?, 1) "
            "ON CONFLICT(path) DO UPDATE SET limit_nanos = coalesce(limit_nanos, 0) + 1",
            (path,),
        )
    report = await verify(built.path)
    assert not report.ok
    assert len(report.problems) == 1
    assert report.problems[0].startswith(f"budget {path!r}: stored policy ")


async def test_deleted_budget_row_is_named(built: Built) -> None:
    """A budget node missing from the table is reported."""
    with raw(built.path) as conn:
        conn.execute("DELETE FROM budget_periods WHERE path = 'team/run'")
    report = await verify(built.path)
    assert not report.ok
    assert any(p.startswith("budget 'team/run'") for p in report.problems)


async def test_call_state_disagreeing_with_events_is_named(built: Built) -> None:
    """A call row whose stored state is not the projection of its events is reported by id."""
    with raw(built.path) as conn:
        # A state's stage is its row's stage column (rows.COLUMN_FIELDS).
        conn.execute("UPDATE calls SET stage = 'completed' WHERE call_id = ?", key(built.in_flight))
    report = await verify(built.path)
    assert not report.ok
    assert (
        f"call {built.in_flight}: stored state completed differs from the projection of its "
        "events (in_flight)"
    ) in report.problems
    assert all(built.in_flight in p for p in report.problems)


async def test_call_state_money_disagreeing_is_named(built: Built) -> None:
    """A call whose kept state's money differs from its events is reported (not only its
    stage); so is a state put into the row of a resolved call, which keeps none."""
    with raw(built.path) as conn:
        conn.execute(
            "UPDATE calls SET state = json_set(state, ?, 1) WHERE call_id = ?",
            (state_path("reserved"), *key(built.in_flight)),
        )
        (kept,) = conn.execute(
            "SELECT state FROM calls WHERE call_id = ?", key(built.in_flight)
        ).fetchone()
        conn.execute("UPDATE calls SET state = ? WHERE call_id = ?", (kept, *key(built.completed)))
    report = await verify(built.path)
    assert not report.ok
    assert [p for p in report.problems if p.startswith(f"call {built.in_flight}: stored state")]
    assert [p for p in report.problems if p.startswith(f"call {built.completed}: stored state")]


async def test_an_unresolved_call_whose_row_keeps_no_state_is_named(built: Built) -> None:
    """An in-flight call's row must keep its state (the sweeper, the retry lookup and the
    metrics read it there): a row without one is named."""
    with raw(built.path) as conn:
        conn.execute("UPDATE calls SET state = NULL WHERE call_id = ?", key(built.in_flight))
    report = await verify(built.path)
    assert [p for p in report.problems if p.startswith(f"call {built.in_flight}: in_flight, yet")]


async def test_deleted_call_row_is_named(built: Built) -> None:
    """A call whose row is gone is reported."""
    with raw(built.path) as conn:
        conn.execute("DELETE FROM calls WHERE call_id = ?", key(built.reconciled))
    report = await verify(built.path)
    assert not report.ok
    assert any(built.reconciled in p for p in report.problems)


async def test_stage_column_disagreeing_with_events_is_named(built: Built) -> None:
    """A calls.stage column that disagrees with the events is reported, since queries use it
    (a resolved call's too, whose row keeps no state)."""
    with raw(built.path) as conn:
        conn.execute("UPDATE calls SET stage = 'completed' WHERE call_id = ?", key(built.in_flight))
        conn.execute("UPDATE calls SET stage = 'failed' WHERE call_id = ?", key(built.completed))
    report = await verify(built.path)
    assert not report.ok
    assert any(built.in_flight in p for p in report.problems)


@pytest.mark.parametrize(
    ("call", "column", "value", "named"),
    [
        ("completed", "model", "gpt-cheap", "model='gpt-cheap' (events: 'gpt-x')"),
        ("completed", "model", None, "model=None (events: 'gpt-x')"),
        ("completed", "cost", 1, "cost=1 (events: 700)"),
        ("reconciled", "cost", None, "cost=None (events: 400)"),
        ("completed", "held", 5, "held=5 (events: 0)"),
        ("in_flight", "cost", 0, "cost=0 (events: None)"),
    ],
)
async def test_spend_column_disagreeing_with_events_is_named(
    built: Built, call: str, column: str, value: object, named: str
) -> None:
    """A call's model, cost or held column (the spend chart reads them, for a resolved
    call whose row keeps no state too) that is not its events' fold is named, column and
    all, and nothing else is."""
    call_id = getattr(built, call)
    with raw(built.path) as conn:
        conn.execute(f"UPDATE calls SET {column} = ? WHERE call_id = ?", (value, *key(call_id)))
    report = await verify(built.path)
    assert report.problems == [f"call {call_id}: columns differ: {named}"]


# -- meaning: forgeries an attacker reseals and re-projects with the store's own code ------------
@dataclass
class Row:
    """One event as an attacker edits it before resealing the chain."""

    kind: str
    call_id: str | None
    data: dict[str, Any]
    worker: str
    generation: int
    at: float = 1.0


def reseal(path: Path, edit: Callable[[list[Row]], list[Row]]) -> list[StoredEvent]:
    """Rewrite the events table as ``edit`` says, renumber and reseal the whole chain, then
    rebuild the calls and budgets tables with the store's own fold (rules.workstate and
    rules.budget): everything the old, fold-sharing verify checked agrees afterwards."""
    with raw(path) as conn:
        conn.execute("DROP TRIGGER events_no_update")
        conn.execute("DROP TRIGGER events_no_delete")
        rows = [
            Row(e.kind, e.call_id, e.data, e.worker, e.generation, e.at)
            for row in conn.execute(sqliteevents.ALL_EVENTS)
            for e in events_from_row(row)
        ]
        conn.execute("DELETE FROM events")
        prev, chain = "0" * 64, []
        tails: dict[str | None, int] = {}  # each call's last event (the store's links)
        for seq, row in enumerate(edit(rows), start=1):
            data_json = canonical_json(row.data)
            digest = event_digest(
                seq=seq,
                kind=row.kind,
                call_id=row.call_id,
                data_json=data_json,
                worker=row.worker,
                generation=row.generation,
                at=row.at,
                prev_digest=prev,
            )
            stored = StoredEvent(
                seq,
                row.kind,
                row.call_id,
                row.data,
                row.worker,
                row.generation,
                row.at,
                prev,
                digest,
            )
            conn.execute(
                f"INSERT INTO events ({sqliteevents.INSERT_COLUMNS}) "
                f"VALUES ({sqliteevents.INSERT_MARKS})",
                sqliteevents.event_params(stored, tails.get(row.call_id)),
            )
            if row.call_id is not None:
                tails[row.call_id] = seq
            chain.append(stored)
            prev = digest
        per_call: dict[str, list[Event]] = {}
        for stored in chain:
            if stored.call_id is not None:
                per_call.setdefault(stored.call_id, []).append(stored.event)
        conn.execute("DELETE FROM calls")
        for call_id, events in per_call.items():
            state = work_state(events)
            conn.execute("INSERT OR IGNORE INTO worker_names(name) VALUES (?)", (state.worker,))
            (worker,) = conn.execute(
                "SELECT id FROM worker_names WHERE name = ?", (state.worker,)
            ).fetchone()
            conn.execute(
                f"INSERT INTO calls ({sqlitecalls.ROW_COLUMNS}) VALUES ({', '.join('?' * 14)})",
                (*sqlitecalls.call_params(state, worker), tails[call_id]),
            )
        conn.execute("DELETE FROM budget_periods")
        for node in budget_fold(s.event for s in chain).nodes.values():
            conn.execute(
                "INSERT INTO budget_periods (path, period, reserved, spent, held) "
                "VALUES (?,?,?,?,?)",
                (node.path, node.period, node.reserved, node.spent, node.held),
            )
    return chain


def generation_of(path: Path, worker: str) -> int:
    """``worker``'s generation as the workers table keeps it."""
    with raw(path) as conn:
        row = conn.execute("SELECT generation FROM workers WHERE worker = ?", (worker,)).fetchone()
    return int(row[0])


def call_events(call: str, writer: tuple[str, int], *, started: bool = True) -> list[Row]:
    """A new call's admission (and, with ``started``, its attempt) as ``writer`` would write it."""
    worker, generation = writer
    manifest = CallManifest(
        call=call,
        request_hash="forged",
        provider="openai",
        endpoint="/v1/chat/completions",
        method="POST",
        model="gpt-x",
        idempotency_key=None,
        budget="team/run",
        budget_root="team",
        effect_kind="billable",
        body="{}",
    )
    rows = [
        Row(manifest.kind, call, manifest.to_data(), worker, generation),
        Row(
            "budget.reserved",
            call,
            BudgetReserved(call=call, budget="team/run", amount=R).to_data(),
            worker,
            generation,
        ),
    ]
    if started:
        start = AttemptStarted(call=call, attempt=1, worker=worker, generation=generation)
        rows.append(Row(start.kind, call, start.to_data(), worker, generation))
    return rows


def settlement(call: str, writer: tuple[str, int]) -> list[Row]:
    """Attempt 1's observed 200, settlement and completion, written by ``writer``."""
    events = completion(call, budget="team/run", reserved=R, actual=R, usage_problem="missing")
    return [Row(e.kind, call, e.to_data(), *writer) for e in events]


async def test_resealed_forgery_by_an_unknown_worker_is_named(built: Built) -> None:
    """A resealed, re-projected interrupt written by a worker never registered is named."""
    ghost = ("ghost", 99)
    interrupted = AttemptInterrupted(call=built.in_flight, attempt=1, reason="x", by="ghost")
    held = BudgetHeld(call=built.in_flight, budget="team/run", amount=R)
    reseal(
        built.path,
        lambda rows: [
            *rows,
            *(Row(e.kind, built.in_flight, e.to_data(), *ghost) for e in (interrupted, held)),
        ],
    )
    report = await verify(built.path)
    forged = built.events + 1
    assert report.first_broken_seq == forged
    assert report.problems[0] == (
        f"event {forged}: written by unknown worker 'ghost' (generation 99): "
        "no worker.registered for it"
    )


async def test_resealed_forgery_at_the_operators_generation_by_another_name_is_named(
    built: Built,
) -> None:
    """A resealed interrupt, hold, not-applied reconcile and unhold of a live call, written
    by "ghost" at generation 0 (every kind one an operator may write), is named: generation
    0 belongs to the operator alone."""
    call = built.in_flight
    forged = [
        AttemptInterrupted(call=call, attempt=1, reason="x", by="ghost"),
        BudgetHeld(call=call, budget="team/run", amount=R),
        CallReconciled(call=call, applied=False, cost=0, note="", by="ghost"),
        BudgetUnheld(call=call, budget="team/run", amount=R, spent=0),
    ]
    reseal(
        built.path,
        lambda rows: [*rows, *(Row(e.kind, call, e.to_data(), "ghost", 0) for e in forged)],
    )
    report = await verify(built.path)
    first = built.events + 1
    assert report.first_broken_seq == first
    assert report.problems == [
        f"event {seq}: {e.kind} written at generation 0 by 'ghost', which is not the "
        "operator ('operator'): no such writer"
        for seq, e in enumerate(forged, start=first)
    ]


async def test_the_audits_forged_reconcile_is_named(built: Built) -> None:
    """The audit's case: a resealed call.reconciled on a completed call by worker 99 is named."""
    reconciled = CallReconciled(call=built.completed, applied=True, cost=0, note="", by="x")
    reseal(
        built.path,
        lambda rows: [
            *rows,
            Row(reconciled.kind, built.completed, reconciled.to_data(), "ghost", 99),
        ],
    )
    report = await verify(built.path)
    forged = built.events + 1
    assert report.first_broken_seq == forged
    assert any("unknown worker 'ghost'" in p for p in report.problems)
    assert any(
        "illegal transition: call.reconciled cannot follow call.completed" in p
        for p in report.problems
    )


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        ({"result": "@@", "result_encoding": "base64"}, "its result is not valid base64"),
        ({"result_encoding": "utf8"}, "result_encoding without a result"),
        ({"result": "{}", "applied": False, "cost": 0}, "a not-applied decision keeps a result"),
        ({"result": 7}, "its result is not text in utf8 or base64"),
    ],
)
async def test_a_decisions_kept_result_that_cannot_be_replayed_is_named(
    built: Built, edit: dict[str, Any], problem: str
) -> None:
    """A recovered result kept with a decision is named when it is on a not-applied one,
    is not text in a body encoding, or an encoding stands without it (resealed chain)."""
    report = await resealed_with(built, built.reconciled, "call.reconciled", edit)
    assert any(problem in p for p in report.problems), report.problems


async def resealed_with(
    built: Built, call_id: str, kind: str, edit: dict[str, Any]
) -> VerifyReport:
    """Verify the ledger after ``edit`` is merged into the data of ``call_id``'s ``kind``
    events and the chain resealed: only the verifier's own checks can tell."""

    def forge(rows: list[Row]) -> list[Row]:
        for row in rows:
            if row.kind == kind and row.call_id == call_id:
                row.data = {**row.data, **edit}
        return rows

    reseal(built.path, forge)
    return await verify(built.path)


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        ({"sent_to": ""}, "attempt.started records sent_to ''"),
        ({"op_id_in": None}, "attempt.started records op_id_in None"),
        ({"key_digest": "00" * 8}, "records key_digest without sent_to"),
        ({"sent_to": "https://x", "key_digest": "Bearer sk"}, "not 16 hex digits"),
    ],
)
async def test_an_attempts_record_of_how_it_went_out_is_checked(
    built: Built, edit: dict[str, Any], problem: str
) -> None:
    """Where an attempt wrote its op id, where it was sent and its credential's digest are
    absent where not recorded, never empty or null, and the digest is a digest beside the
    place it was sent (resealed chain)."""
    report = await resealed_with(built, built.completed, "attempt.started", edit)
    assert any(problem in p for p in report.problems), report.problems


@pytest.mark.parametrize("fencing", ["taken_over", "re-registered"])
async def test_event_by_a_fenced_generation_is_named(built: Built, fencing: str) -> None:
    """A new call written by w1's generation after it was taken over (or superseded) is named."""
    old = ("w1", generation_of(built.path, "w1"))
    async with Ledger.open(str(built.path)) as ledger:
        if fencing == "taken_over":
            w2 = await ledger.store.write(
                Writer("boot", 0),
                lambda tx: operations.register_worker(tx, worker="w2", host="h", pid=2, lease_s=30),
            )
            await ledger.store.write(w2, lambda tx: operations.sweep(tx, w2, frozenset({"w1"})))
            why = "taken over at event"
        else:
            await ledger.store.write(
                Writer("boot", 0),
                lambda tx: operations.register_worker(tx, worker="w1", host="h", pid=3, lease_s=30),
            )
            why = "superseded by generation"
        assert (await verify_ledger(ledger)).ok
        events = (await verify_ledger(ledger)).events
    reseal(built.path, lambda rows: [*rows, *call_events("call_forged", old)])
    report = await verify(built.path)
    assert report.first_broken_seq == events + 1
    assert report.problems[0].startswith(
        f"event {events + 1}: written by fenced generation {old[1]} of worker 'w1' ({why}"
    )


async def test_illegal_transition_is_named(built: Built) -> None:
    """An operator's reconcile of a completed call, resealed and re-projected, is illegal."""
    reconciled = CallReconciled(call=built.completed, applied=True, cost=0, note="", by="op")
    unheld = BudgetUnheld(call=built.completed, budget="team/run", amount=0, spent=0)
    reseal(
        built.path,
        lambda rows: [
            *rows,
            *(
                Row(e.kind, built.completed, e.to_data(), "operator", 0)
                for e in (reconciled, unheld)
            ),
        ],
    )
    report = await verify(built.path)
    forged = built.events + 1
    assert report.first_broken_seq == forged
    assert report.problems[0] == (
        f"event {forged}: call {built.completed}: illegal transition: call.reconciled cannot "
        "follow call.completed (phase completed)"
    )


async def test_settlement_without_an_attempt_is_named(built: Built) -> None:
    """A forged call settled and completed with no attempt.started is named at the observation."""
    w1 = ("w1", generation_of(built.path, "w1"))
    forged = [*call_events("call_forged", w1, started=False), *settlement("call_forged", w1)]
    reseal(built.path, lambda rows: [*rows, *forged])
    report = await verify(built.path)
    observed = built.events + 3
    assert report.first_broken_seq == observed
    assert report.problems[0] == (
        f"event {observed}: call call_forged: settlement without an attempt: attempt.observed "
        "but no attempt.started"
    )


@pytest.mark.parametrize(
    ("kind", "named"),
    [
        ("attempt.started", "settlement without an attempt: attempt.observed"),
        ("budget.settled", "illegal transition: call.completed cannot follow attempt.observed"),
        ("call.completed", "ends after budget.settled (event {seq}) without the call.completed"),
    ],
)
async def test_deleted_event_with_the_chain_resealed_is_named(
    built: Built, kind: str, named: str
) -> None:
    """An event cut out of a call, the chain renumbered and resealed after it, is still named."""

    def cut(rows: list[Row]) -> list[Row]:
        return [r for r in rows if not (r.call_id == built.completed and r.kind == kind)]

    chain = reseal(built.path, cut)
    assert [s.seq for s in chain] == list(range(1, built.events))  # no gap left to see
    settled = next((s.seq for s in chain if s.kind == "budget.settled"), 0)
    report = await verify(built.path)
    assert not report.ok
    assert any(built.completed in p and named.format(seq=settled) in p for p in report.problems), (
        report.problems
    )


async def test_worker_row_disagreeing_with_events_is_named(built: Built) -> None:
    """A workers row marked fenced that no worker.taken_over fenced is reported."""
    with raw(built.path) as conn:
        conn.execute("UPDATE workers SET fenced = 1 WHERE worker = 'w1'")
    report = await verify(built.path)
    assert not report.ok
    assert report.problems[0].startswith("worker 'w1': stored (generation, fenced)")


async def test_limit_overshoot_is_named(built: Built) -> None:
    """A reservation taking a limited node past its limit is named (contract.md §5)."""
    w1 = ("w1", generation_of(built.path, "w1"))

    def lower(rows: list[Row]) -> list[Row]:
        limit = next(r for r in rows if r.kind == "budget.limit_set")
        limit.data["limit"] = R  # call a's reservation fits; the next one does not
        return rows

    reseal(built.path, lambda rows: [*lower(rows), *call_events("call_forged", w1)])
    report = await verify(built.path)
    assert not report.ok
    assert any(
        "budget 'team': a reservation of 1000 takes it past its limit 1000" in p
        for p in report.problems
    )


async def test_verify_does_not_keep_the_ledgers_request_bodies(tmp_path: Path) -> None:
    """Verify reads the ledger a page at a time and keeps no call's request body once its
    page is done: its peak memory stays far below the bodies' total (a months-old ledger
    holds gigabytes of prompts)."""
    calls, size = 40, 256 * 1024
    path = tmp_path / "ledger.db"
    async with Ledger.open(str(path)) as ledger:
        writer = await ledger.store.write(
            Writer("boot", 0),
            lambda tx: operations.register_worker(tx, worker="w1", host="h", pid=1, lease_s=30),
        )
        for n in range(calls):
            prompt = f"{n:08d}" * (size // 8)  # each body its own string, none shared
            body = json.dumps({"messages": [{"role": "user", "content": prompt}]})
            admitted = await ledger.admit(writer, replace(request(f"k{n}"), body=body))
            events = completion(admitted.call_id, budget="team/run", reserved=R, actual=R)
            await ledger.record(writer, admitted.call_id, 1, events)
    async with Ledger.open(str(path)) as ledger:
        tracemalloc.start()
        try:
            report = await verify_ledger(ledger, page=6)  # a page holds about one call
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert report.ok, report.problems
    assert report.calls == calls
    assert peak < calls * size / 2  # all the bodies kept: about 1.2 times their total
