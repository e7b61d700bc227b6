"""SQLite finds a call's events through links, not an index (migration 10).

The call's row names its last event; each event names the previous event of its
call. Reads (``show``, resends, late answers) walk the links; ``verify`` re-derives
every link from the events' own call ids and names one that is wrong.
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from eventkit import completion
from test_ledger_format import admit_request

from effectguard.ledger import Ledger, Writer, operations, sqliteevents, sqlitelinks
from effectguard.ops.verify import verify_ledger
from effectguard.rules.events import Event


def _outcome(call_id: str) -> list[Event]:
    return completion(call_id, budget="team/run", reserved=1000, actual=10)


async def _interleaved(path: Path) -> list[str]:
    """Four calls whose events interleave: each admitted before the previous settles,
    one interrupted and reconciled later (events far from its first)."""
    async with Ledger.open(str(path)) as ledger:
        writer = await ledger.store.write(
            Writer("w1", 0),
            lambda tx: operations.register_worker(tx, worker="w1", host="h", pid=1, lease_s=60),
        )
        ids = []
        for n in range(4):
            ids.append((await ledger.admit(writer, admit_request(n))).call_id)
        await ledger.interrupt(writer, ids[0], 1, "read timeout")
        for call_id in ids[1:]:
            await ledger.record(writer, call_id, 1, _outcome(call_id))
        await ledger.reconcile(ids[0], applied=True, cost=400, note="seen", by="ann")
    return ids


async def test_a_calls_events_are_found_by_its_links(tmp_path: Path) -> None:
    """Each call's events, read the way show and resends read them, are exactly the
    ledger's events of that call, in order; and no index of events by call is kept."""
    path = tmp_path / "l.db"
    ids = await _interleaved(path)
    async with Ledger.open(str(path)) as ledger:
        every = await ledger.store.events_after(0, 1000)
        found = {c: await ledger.store.call_events(c) for c in ids}
        report = await verify_ledger(ledger)
    assert report.ok, report.problems
    for call_id in ids:
        assert found[call_id] == [e for e in every if e.call_id == call_id]
        assert len(found[call_id]) >= 3
    conn = sqlite3.connect(path)
    try:
        indexes = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='index'")]
        plan = " ".join(
            str(r[-1])
            for r in conn.execute(
                "EXPLAIN QUERY PLAN " + sqliteevents.CALL_EVENTS,
                (ids[0], sqliteevents.call_key(ids[0])),
            )
        )
    finally:
        conn.close()
    # The partial indexes of the kinds read alone (limits, keys) hold no call's events.
    partial = ("events_limits", "events_keys")
    assert not [i for i in indexes if i.startswith("events_") and i not in partial]
    # Every step reads one event by its seq; nothing scans the events table.
    assert "SEARCH w USING INTEGER PRIMARY KEY" in plan, plan
    assert not re.search(r"SCAN (e|w|events)\b", plan), plan


def _tamper(path: Path, sql: str, params: tuple[object, ...]) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("DROP TRIGGER events_no_update")
        conn.execute(sql, params)
    finally:
        conn.close()


async def test_verify_names_an_event_linked_to_the_wrong_previous_event(tmp_path: Path) -> None:
    """A link is not covered by the hash chain, so verify checks it against call ids."""
    path = tmp_path / "l.db"
    ids = await _interleaved(path)
    async with Ledger.open(str(path)) as ledger:
        last = (await ledger.store.call_events(ids[0]))[-1].seq
    _tamper(path, "UPDATE events SET call_prev = 1 WHERE seq = ?", (last,))
    async with Ledger.open(str(path)) as ledger:
        report = await verify_ledger(ledger)
    assert [p for p in report.problems if f"event {last}: links to 1" in p], report.problems
    assert report.first_broken_seq == last


async def test_verify_names_a_call_row_that_misnames_its_last_event(tmp_path: Path) -> None:
    path = tmp_path / "l.db"
    ids = await _interleaved(path)
    key = sqliteevents.call_key(ids[2])
    _tamper(path, "UPDATE calls SET last_seq = last_seq - 1 WHERE call_id = ?", (key,))
    async with Ledger.open(str(path)) as ledger:
        report = await verify_ledger(ledger)
    assert [p for p in report.problems if p.startswith(f"call {ids[2]}: its row names")], (
        report.problems
    )


def test_the_link_cache_never_drops_a_tail_inside_a_transaction() -> None:
    """A full cache is trimmed between transactions only: inside one, a call's tail may
    be ahead of its row (its event is buffered, its row not yet written), and reading the
    row again would link the call's next event to an older one."""
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE calls (call_id TEXT PRIMARY KEY, last_seq INTEGER)")
    conn.executemany("INSERT INTO calls VALUES (?, ?)", [("x", 3), ("y", 5)])
    links = sqlitelinks.RowLinks(conn, size=1)
    assert links.tail("x") == 3
    links.tails["x"] = 7  # what add() records for x's new event, before its row
    assert links.tail("y") == 5  # a miss while the cache is full
    assert links.tail("x") == 7
    links.trim()  # between transactions the cache is bounded again
    assert links.tails == {}


async def test_a_new_call_is_linked_without_reading_for_its_last_event(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Admitting a new call reads no row for its last event (its manifest opens it), and
    its links still verify."""
    statements: list[str] = []
    connect = sqlite3.connect

    def traced(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        conn = connect(*args, **kwargs)
        conn.set_trace_callback(statements.append)
        return conn

    monkeypatch.setattr(sqlite3, "connect", traced)
    async with Ledger.open(str(tmp_path / "l.db")) as ledger:
        writer = await ledger.store.write(
            Writer("w1", 0),
            lambda tx: operations.register_worker(tx, worker="w1", host="h", pid=1, lease_s=60),
        )
        statements.clear()
        ids = [(await ledger.admit(writer, admit_request(n))).call_id for n in range(3)]
        admitting = list(statements)
        for call_id in ids:
            await ledger.record(writer, call_id, 1, _outcome(call_id))
        report = await verify_ledger(ledger)
    assert report.ok, report.problems
    assert any(s.startswith("INSERT INTO events") for s in admitting), admitting
    assert not [s for s in admitting if "last_seq FROM calls" in s], admitting
