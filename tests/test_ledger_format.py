"""The SQLite event row layout (format 2): pinned rows, exact round trips, and the upgrade
of a format-1 ledger (hex digests, every link stored, bodies inside the JSON)."""

from __future__ import annotations

import base64
import json
import re
import sqlite3
from pathlib import Path
from typing import Any

import admitkit
import pytest
from eventkit import completion
from hypothesis import given
from hypothesis import strategies as st
from test_store_contract import register

from effectguard.ledger import AdmitRequest, Ledger, Writer, sqliteevents
from effectguard.ledger.rows import (
    EVENT_COLUMNS,
    SLIM_FIELDS,
    STATE_FIELDS,
    event_params,
    state_params,
)
from effectguard.ledger.sqliteschema import _ARCHIVED_THROUGH_TRIGGER
from effectguard.ops.archive import archive_sqlite
from effectguard.ops.verify import verify_ledger
from effectguard.rules.events import AttemptObserved, StoredEvent
from effectguard.rules.events import canonical_json as canonical
from effectguard.rules.workstate import WorkState, as_dict

CALL = "call_01a22fe8e4d874a06ea864a3ee239aa9"
#: One format-2 row as SELECT_COLUMNS reads it: the call id's 16 bytes, raw digests, the
#: body out of the JSON, no call in data, the fields' values in FIELDS order.
ROW = (
    7,
    "attempt.observed",
    bytes.fromhex("01a22fe8e4d874a06ea864a3ee239aa9"),
    '[1,200,false,null,null,{},"utf8",false]',
    b'{"ok": "\xc3\xa9"}',
    "w1",
    3,
    2.5,
    bytes.fromhex("ab" * 32),
    bytes.fromhex("cd" * 32),
)


def test_format_2_row_decodes_to_the_pinned_event() -> None:
    """The pinned row reads back as the event that was sealed: body text, call id, hex."""
    stored = sqliteevents.event_from_row(ROW)
    assert stored.data == {
        "attempt": 1,
        "body": '{"ok": "é"}',
        "body_encoding": "utf8",
        "call": CALL,
        "effect_unknown": False,
        "headers": {},
        "not_processed": False,
        "status": 200,
        "usage": None,
        "usage_problem": None,
    }
    assert (stored.prev_digest, stored.digest) == ("ab" * 32, "cd" * 32)
    assert stored.call_id == CALL
    assert isinstance(stored.event, AttemptObserved)


@given(st.text() | st.from_regex(r"call_[0-9a-f]{32}", fullmatch=True))
def test_a_call_id_is_stored_so_that_it_reads_back(call_id: str) -> None:
    """A ``call_`` + 32 hex digits id is stored as its 16 bytes; any other id as itself."""
    key = sqliteevents.call_key(call_id)
    assert sqliteevents.call_from_key(key) == call_id
    canonical = re.fullmatch(r"call_[0-9a-f]{32}", call_id) is not None
    assert isinstance(key, bytes) == canonical


def test_an_object_row_decodes_to_the_same_event() -> None:
    """Data stored as an object (a kind's fields not exactly FIELDS) reads the same."""
    as_object = (
        '{"attempt":1,"body_encoding":"utf8","effect_unknown":false,"headers":{},'
        '"not_processed":false,"status":200,"usage":null,"usage_problem":null}'
    )
    row = (*ROW[:3], as_object, *ROW[4:])
    assert sqliteevents.event_from_row(row) == sqliteevents.event_from_row(ROW)


#: The same event as format 3 (migration 11) stores it: its kind as its index in KINDS
#: (the worker's id is resolved to its name by SELECT_COLUMNS' join).
ROW_3 = (7, 3, *ROW[2:])


def test_format_3_row_decodes_to_the_same_event() -> None:
    """A kind's code reads back as the kind: the event, and so its digest, is the same."""
    assert sqliteevents.KINDS[3] == "attempt.observed"
    assert sqliteevents.event_from_row(ROW_3) == sqliteevents.event_from_row(ROW)


def test_format_3_row_encodes_from_the_pinned_event() -> None:
    """Writing the pinned event gives the pinned row: the kind's code, the worker's id,
    the head's link left to derive, and the link to the call's previous event."""
    stored = sqliteevents.event_from_row(ROW)
    row = (*ROW_3[:5], 2, *ROW_3[6:8], None, ROW[9], 4, None)  # no request hash: not a record
    assert sqliteevents.event_params(stored, 4, 2) == row
    assert sqliteevents.event_params(stored)[5] == "w1"  # no id given: the name itself


def test_kind_codes_are_the_pinned_list() -> None:
    """KINDS is part of the stored format: a code, once written, names one kind forever
    (append only), and no kind that SQL text names is coded."""
    assert sqliteevents.KINDS[:20] == (
        "call.manifest",
        "budget.reserved",
        "attempt.started",
        "attempt.observed",
        "budget.settled",
        "call.completed",
        "call.refused",
        "budget.released",
        "budget.held",
        "budget.unheld",
        "budget.corrected",
        "attempt.not_sent",
        "attempt.interrupted",
        "attempt.late_answer",
        "call.reconciled",
        "call.resend_authorized",
        "key.created",
        "key.revoked",
        "worker.registered",
        "worker.taken_over",
    )
    assert not {"budget.limit_set", "ledger.archived"} & set(sqliteevents.KINDS)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)


_KINDS = st.sampled_from([*sqliteevents.FIELDS, "ledger.archived", "no.such_kind"])


@st.composite
def _fields(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A kind and data: its exact FIELDS (positional), a subset, or any other names."""
    kind = draw(_KINDS)
    names = list(sqliteevents.FIELDS.get(kind, ()))
    shape = draw(st.sampled_from(["exact", "subset", "any"]))
    if shape == "exact":
        return kind, {name: draw(_JSON) for name in names}
    if shape == "subset" and names:
        chosen = draw(st.lists(st.sampled_from(names), unique=True))
        return kind, {name: draw(_JSON) for name in chosen}
    keys = st.text().filter(lambda k: k not in ("call", "body"))
    return kind, draw(st.dictionaries(keys, _JSON, max_size=4))


@given(
    fields=_fields(),
    body=st.none() | st.text() | st.binary(),
    call=st.none() | st.just("call_x") | st.text(),
    column=st.none() | st.just("call_x"),
)
def test_split_then_join_gives_back_the_same_data(
    fields: tuple[str, dict[str, Any]],
    body: str | bytes | None,
    call: str | None,
    column: str | None,
) -> None:
    """Any data (any body text, lone surrogates included, binary bodies as base64, a call
    that differs from its row's) is stored so that reading it gives back exactly the data
    the digest covered. (A row with a call id always has a ``call``: only call events,
    whose ``call`` the column copies, have one.)"""
    kind, rest = fields
    data = dict(rest)
    if call is not None or column is not None:
        data["call"] = call if call is not None else column
    if isinstance(body, bytes):
        data |= {"body": base64.b64encode(body).decode(), "body_encoding": "base64"}
    elif body is not None:
        data |= {"body": body}
    data_json, blob = sqliteevents.split(kind, data, column)
    assert sqliteevents.join(kind, data_json, blob, column) == data


def _format_1(path: Path, events: list[StoredEvent], states: list[WorkState]) -> None:
    """Rewrite the ledger's events table as format 1 (migration 5) wrote it, and its calls
    table as migration 7 made it."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("BEGIN")
        for sql in (
            "DROP TRIGGER meta_archived_through",
            "DROP TABLE events",
            "DROP TABLE chain_cuts",
            """CREATE TABLE events (
                seq INTEGER PRIMARY KEY, kind TEXT NOT NULL, call_id TEXT, data TEXT NOT NULL,
                worker TEXT NOT NULL, generation INTEGER NOT NULL, at REAL NOT NULL,
                prev_digest TEXT NOT NULL, digest TEXT NOT NULL)""",
            "CREATE INDEX events_call ON events(call_id, seq) WHERE call_id IS NOT NULL",
            "CREATE INDEX events_limits ON events(seq) WHERE kind = 'budget.limit_set'",
            _ARCHIVED_THROUGH_TRIGGER,
            "DELETE FROM migrations WHERE version IN (6, 10, 11, 13)",
            "DROP TABLE worker_names",
        ):
            conn.execute(sql)
        _calls_before_14(conn, states, {})
        marks = ", ".join("?" * 9)
        conn.executemany(
            f"INSERT INTO events({EVENT_COLUMNS}) VALUES ({marks})",
            [event_params(e, canonical(e.data)) for e in events],
        )
        conn.execute("COMMIT")
    finally:
        conn.close()


def _calls_before_14(
    conn: sqlite3.Connection, states: list[WorkState], last_seq: dict[str, int]
) -> None:
    """The calls table as migration 14 found it: text keys, hashes and workers, every
    state kept (``last_seq``: each call's last event, where migration 10 has run)."""
    linked = ", last_seq INTEGER" if last_seq else ""
    conn.execute("DROP TABLE calls")
    conn.execute(
        f"""CREATE TABLE calls (
            call_id TEXT PRIMARY KEY, stage TEXT NOT NULL, budget TEXT NOT NULL,
            budget_root TEXT NOT NULL, idempotency_key TEXT, request_hash TEXT NOT NULL,
            provider TEXT NOT NULL, created_at REAL NOT NULL, worker TEXT NOT NULL,
            state TEXT NOT NULL{linked}) WITHOUT ROWID"""
    )
    conn.execute(
        """CREATE UNIQUE INDEX calls_key ON calls(budget_root, idempotency_key)
        WHERE idempotency_key IS NOT NULL"""
    )
    conn.execute(
        """CREATE INDEX calls_unresolved ON calls(budget_root, request_hash, created_at)
        WHERE stage IN ('in_flight', 'effect_unknown')"""
    )
    for state in states:
        link = (last_seq[state.call_id],) if last_seq else ()
        marks = ", ".join("?" * (10 + len(link)))
        conn.execute(f"INSERT INTO calls VALUES ({marks})", (*state_params(state), *link))
    conn.execute("DELETE FROM migrations WHERE version = 14")


def admit_request(n: int) -> AdmitRequest:
    """A keyed chat admission whose body needs escaping (an accent, quotes)."""
    body = '{"messages": [{"content": "é \\"quoted\\""}]}'
    return admitkit.admit_request(request_hash=f"h{n}", key=f"k{n}", body=body, reserve=1000)


async def _calls(ledger: Ledger, writer: Writer, numbers: range) -> None:
    for n in numbers:
        admitted = await ledger.admit(writer, admit_request(n))
        outcome = completion(
            admitted.call_id,
            budget="team/run",
            reserved=1000,
            actual=10,
            body=base64.b64encode(b"\xff\x00binary").decode(),
            body_encoding="base64",
        )
        await ledger.record(writer, admitted.call_id, 1, outcome)


async def _archived_once(path: Path) -> tuple[Writer, list[StoredEvent], list[WorkState]]:
    """Three calls archived, two more live: the writer, the live events and call states."""
    async with Ledger.open(str(path)) as ledger:
        writer = await register(ledger, "w1", lease_s=60)
        await _calls(ledger, writer, range(3))
    archive_sqlite(str(path), before=2e9, out=path.with_name("a.jsonl.gz"))
    async with Ledger.open(str(path)) as ledger:
        await _calls(ledger, writer, range(3, 5))
        return writer, await ledger.store.events_after(0, 1000), await ledger.calls(limit=1000)


async def test_a_format_1_ledger_with_an_archive_cut_upgrades_and_verifies(
    tmp_path: Path,
) -> None:
    """A format-1 ledger (here: archived once, so its first live event links to a deleted
    one) is converted on open: the same events read back, verify passes, and only the
    link that cannot be derived is stored."""
    path = tmp_path / "ledger.db"
    _, before, states = await _archived_once(path)
    _format_1(path, before, states)

    async with Ledger.open(str(path)) as ledger:
        after = await ledger.store.events_after(0, 1000)
        report = await verify_ledger(ledger)
        calls = {e.call_id for e in before if e.call_id is not None}
        found = {c: await ledger.store.call_events(c) for c in calls}
    assert after == before
    # Migration 9 linked each call's events: they are found without an index.
    assert found == {c: [e for e in before if e.call_id == c] for c in calls}
    assert report.ok, report.problems
    conn = sqlite3.connect(path)
    try:
        stored_links = conn.execute(
            "SELECT seq FROM events WHERE prev_digest IS NOT NULL"
        ).fetchall()
        bodies = conn.execute("SELECT count(*) FROM events WHERE body IS NOT NULL").fetchone()
    finally:
        conn.close()
    assert stored_links == [(before[0].seq,)]
    assert bodies == (4,)  # two manifests, two observations


@pytest.mark.parametrize("older", ["object", "all fields"])
async def test_an_unresolved_calls_state_is_kept_positionally_and_older_forms_read_the_same(
    tmp_path: Path, older: str
) -> None:
    """The SQLite store keeps an unresolved call's state as the array of rows.SLIM_FIELDS
    (the other fields are the row's columns); a state stored as an object, or as the
    array of all STATE_FIELDS (both as before), reads as the same state and counts the
    same held, in every read (the reader's and the writer's)."""
    path = tmp_path / "ledger.db"
    async with Ledger.open(str(path)) as ledger:
        writer = await register(ledger, "w1", lease_s=60)
        await _calls(ledger, writer, range(1))
        unknown = await ledger.admit(writer, admit_request(9))
        await ledger.interrupt(writer, unknown.call_id, 1, "read timeout")
        positional = await ledger.store.get_call(unknown.call_id)
        counts = await ledger.store.stage_counts()
    assert positional is not None and positional.held == 1000
    assert counts == [("openai", "effect_unknown", 1, 1000, positional.created_at)]
    fields = as_dict(positional)
    stored = {
        "object": state_params(positional)[-1],
        "all fields": json.dumps([fields[f] for f in STATE_FIELDS]),
    }[older]
    key = sqliteevents.call_key(unknown.call_id)
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        (text,) = conn.execute("SELECT state FROM calls WHERE call_id = ?", (key,)).fetchone()
        assert json.loads(text) == [fields[f] for f in SLIM_FIELDS]
        conn.execute("UPDATE calls SET state = ? WHERE call_id = ?", (stored, key))
    finally:
        conn.close()
    async with Ledger.open(str(path)) as ledger:
        assert await ledger.store.get_call(unknown.call_id) == positional
        assert await ledger.store.stage_counts() == counts
        assert await ledger.calls(stage="effect_unknown") == [positional]
        report = await verify_ledger(ledger)
        # The writer reads it too: reconciling the call folds onto the stored state.
        await ledger.reconcile(unknown.call_id, applied=False, cost=0, note="no", by="ann")
        settled = await ledger.store.get_call(unknown.call_id)
        after = await verify_ledger(ledger)
    assert report.ok, report.problems
    assert after.ok, after.problems
    assert settled is not None and settled.stage != "effect_unknown" and settled.held == 0


def _format_3(path: Path, events: list[StoredEvent], states: list[WorkState]) -> None:
    """Rewrite the ledger's events as format 3 (migration 12) stored them: one row per
    event, kinds and workers coded, the call's previous event linked, no hash column;
    and its calls as they were before migration 14 (text keys, every state kept)."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("BEGIN")
        # Before migration 15 no writer format was required (a release then declared none).
        for trigger in (
            "events_writer_format",
            "workers_writer_format_insert",
            "workers_writer_format_update",
        ):
            conn.execute(f"DROP TRIGGER {trigger}")
        conn.execute("DELETE FROM migrations WHERE version = 15")
        conn.execute("DROP TRIGGER events_no_delete")
        conn.execute("DELETE FROM events")
        conn.execute("ALTER TABLE events DROP COLUMN hash")
        conn.execute("DELETE FROM migrations WHERE version = 13")
        workers = dict(conn.execute("SELECT name, id FROM worker_names"))
        tails: dict[str | None, int] = {}
        rows = []
        for e in events:
            rows.append(
                sqliteevents.event_params(e, tails.get(e.call_id), workers.get(e.worker))[:11]
            )
            if e.call_id is not None:
                tails[e.call_id] = e.seq
        columns = sqliteevents.INSERT_COLUMNS.rsplit(",", 1)[0]
        conn.executemany(f"INSERT INTO events({columns}) VALUES ({', '.join('?' * 11)})", rows)
        _calls_before_14(conn, states, {c: s for c, s in tails.items() if c is not None})
        conn.execute(
            """CREATE TRIGGER events_no_delete BEFORE DELETE ON events
            WHEN OLD.seq > coalesce((SELECT value FROM meta WHERE key = 'archived_through'), 0)
            BEGIN SELECT RAISE(ABORT, 'events are append-only'); END"""
        )
        conn.execute("COMMIT")
    finally:
        conn.close()


async def test_a_format_3_ledger_upgrades_in_place_and_verifies(tmp_path: Path) -> None:
    """A format-3 ledger (one row per event; here with an archive cut) is upgraded by
    adding a column, not by copying: its rows read as the same events, verify passes,
    new operations are stored as records beside them, and verify still passes."""
    path = tmp_path / "ledger.db"
    writer, before, states = await _archived_once(path)
    _format_3(path, before, states)
    conn = sqlite3.connect(path)
    rows_before = conn.execute("SELECT count(*) FROM events").fetchone()[0]
    conn.close()
    assert rows_before == len(before)

    async with Ledger.open(str(path)) as ledger:
        assert await ledger.store.events_after(0, 1000) == before
        upgraded = await verify_ledger(ledger)
        await _calls(ledger, writer, range(5, 7))
        after = await ledger.store.events_after(0, 1000)
        calls = {e.call_id for e in after if e.call_id is not None}
        found = {c: await ledger.store.call_events(c) for c in calls}
        report = await verify_ledger(ledger)
    assert upgraded.ok, upgraded.problems
    assert report.ok, report.problems
    assert after[: len(before)] == before
    assert found == {c: [e for e in after if e.call_id == c] for c in calls}
    conn = sqlite3.connect(path)
    try:
        kinds = [
            k for (k,) in conn.execute("SELECT kind FROM events WHERE seq > ?", (before[-1].seq,))
        ]
    finally:
        conn.close()
    # The two new calls: an admission and an observation each, three events a row.
    assert kinds == [-3, -3, -3, -3]
    # Migration 14 copied the call rows (keys as bytes, each old state kept as it was);
    # the new calls, resolved, keep none.
    conn = sqlite3.connect(path)
    try:
        stored = conn.execute("SELECT call_id, state FROM calls").fetchall()
    finally:
        conn.close()
    kept = {sqliteevents.call_from_key(k): (type(k), text) for k, text in stored}
    old = {s.call_id: (bytes, state_params(s)[-1]) for s in states}
    assert {c: kept[c] for c in old} == old
    assert [text for c, (_, text) in kept.items() if c not in old] == [None, None]
