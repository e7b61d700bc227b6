"""SQLite's event records (format 4, ledger/sqliterecords): an operation's run of events in
one row reads back exactly as sealed, its digests derived where they are not stored."""

from __future__ import annotations

import dataclasses
import hashlib
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from eventkit import completion
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ledger_calls import request
from test_store_contract import register

from effectguard.ledger import Ledger, sqliteevents, sqliterecords, writerformat
from effectguard.ledger.sqliteschema import migrate
from effectguard.rules.events import (
    Event,
    StoredEvent,
    canonical_json,
    stored_digest,
)

CALL = "call_01a22fe8e4d874a06ea864a3ee239aa9"
KEY = bytes.fromhex(CALL[5:])
HASH = hashlib.sha256(b"the request").hexdigest()
AT = 1_700_000_000.25
CALL_KINDS = sorted(k for k in sqliteevents.FIELDS if k in sqliteevents.KIND_CODES)


def _sealed(
    seq: int,
    kind: str,
    call: str,
    data: dict[str, Any],
    writer: tuple[str, int],
    at: float,
    prev: str,
) -> StoredEvent:
    """An event as the store seals it, its digest over its content and ``prev``."""
    draft = StoredEvent(seq, kind, call, data, *writer, at, prev, "")
    return dataclasses.replace(draft, digest=stored_digest(draft))


def _chain(
    items: list[tuple[str, dict[str, Any]]], first: int, prev: str, at: float = AT
) -> list[StoredEvent]:
    """``items`` sealed as events ``first``, ``first + 1``, ... of CALL, written by w1."""
    out = []
    for seq, (kind, data) in enumerate(items, start=first):
        out.append(_sealed(seq, kind, CALL, data, ("w1", 3), at, prev))
        prev = out[-1].digest
    return out


#: An observation as the guard records it: status, the four usage counts, the answer's
#: headers and body, its settlement and its completion.
OBSERVATION = _chain(
    [
        (
            "attempt.observed",
            {
                "call": CALL,
                "attempt": 1,
                "status": 200,
                "not_processed": False,
                "usage": {
                    "input_tokens": 12,
                    "output_tokens": 16,
                    "cached_input_tokens": 0,
                    "cache_write_tokens": 0,
                },
                "usage_problem": None,
                "headers": {"content-type": "application/json"},
                "body": '{"ok": "é"}',
                "body_encoding": "utf8",
                "effect_unknown": False,
            },
        ),
        (
            "budget.settled",
            {
                "call": CALL,
                "budget": "team/run",
                "reserved": 1000,
                "actual": 10,
                "flagged": None,
                "tokens": None,
                "periods": {},
            },
        ),
        ("call.completed", {"call": CALL, "outcome": "completed"}),
    ],
    first=5,
    prev="ab" * 32,
)
#: The row the observation is stored as (SELECT_COLUMNS order; the worker's name joined
#: in, the first event's predecessor derived from the row before).
ROW = (
    7,
    -3,
    KEY,
    '[[3,1,200,false,[12,16,0,0],null,{"content-type":"application/json"}],'
    '[4,"team/run",1000,10],[5,"completed"]]',
    '{"ok": "é"}'.encode(),
    "w1",
    3,
    AT,
    bytes.fromhex("ab" * 32),
    bytes.fromhex(OBSERVATION[-1].digest),
    None,
)


def test_an_observation_is_stored_as_the_pinned_record() -> None:
    """The guard's three observation events are one row: minus three as its kind, each
    event an item of its kind's code and values (usage as its four counts, trailing
    defaults left out, the body in the row's BLOB), one digest: the last event's."""
    params = sqliterecords.record_params(OBSERVATION, 4, 2)
    # INSERT_COLUMNS: the worker's id, no stored predecessor, the call's previous row.
    assert params == (*ROW[:5], 2, *ROW[6:8], None, ROW[9], 4, None)


def test_the_pinned_record_reads_back_as_the_sealed_events() -> None:
    """Reading the pinned row gives back the three events exactly, each with its digest
    (the first two derived on read) and its record."""
    read = sqliterecords.events_from_row(ROW)
    assert read == OBSERVATION
    assert [e.digest for e in read] == [e.digest for e in OBSERVATION]
    assert [e.prev_digest for e in read] == [e.prev_digest for e in OBSERVATION]
    assert {e.record for e in read} == {(5, 7)}
    assert [canonical_json(e.data) for e in read] == [canonical_json(e.data) for e in OBSERVATION]


def test_a_single_event_is_a_format_3_row() -> None:
    """A run of one event is stored as format 3 stores it: its kind's code, no record."""
    params = sqliterecords.record_params(OBSERVATION[2:], 6, 2)
    assert params == sqliteevents.event_params(OBSERVATION[2], 6, 2)
    assert params[1] == sqliteevents.KIND_CODES["call.completed"]


def test_what_a_row_cannot_imply_stays_in_its_item() -> None:
    """An event that does not fit its compact item exactly (a usage of other counts, a
    started attempt naming another worker) is an object item holding its data as it is."""
    odd = [
        (k, d | {"usage": {"input_tokens": 1}} if k == "attempt.observed" else d)
        for k, d in ((e.kind, e.data) for e in OBSERVATION)
    ]
    events = _chain(odd, first=5, prev="ab" * 32)
    params = sqliterecords.record_params(events, 4, 2)
    assert params[3].startswith('[{"data":{"attempt":1,"body":"{\\"ok\\": \\"é\\"}"')
    assert params[4] is None  # the body stayed in the object item
    row = (*params[:5], "w1", *params[6:8], bytes.fromhex("ab" * 32), params[9], None)
    assert sqliterecords.events_from_row(row) == events


#: An admission as the guard records it, at a whole second (so that 5 and 5.0 differ).
ADMISSION = [
    (
        "call.manifest",
        {
            "call": CALL,
            **dict.fromkeys(sqliteevents.FIELDS["call.manifest"]),
            "request_hash": HASH,
            "budget": "team/run",
            "body": "{}",
            "body_encoding": "utf8",
            "headers": {},
            "stream": False,
            "at": 5.0,
        },
    ),
    (
        "budget.reserved",
        {"call": CALL, "budget": "team/run", "amount": 10, "tokens": 0, "periods": {}},
    ),
    (
        "attempt.started",
        {
            "call": CALL,
            "attempt": 1,
            "worker": "w1",
            "generation": 3,
            "provider_idempotency_key": None,
            "at": 5.0,
        },
    ),
]


def test_an_event_with_a_body_after_one_with_a_body_starts_a_row() -> None:
    """A row holds one body: an observation right after its call's manifest (one writer,
    one time) is not added to the manifest's record, and each keeps its body compact."""
    items = [ADMISSION[0], *((e.kind, e.data) for e in OBSERVATION)]
    events = _chain(items, first=4, prev="ab" * 32, at=5.0)
    runs = _grouped(events)
    assert [len(run) for run in runs] == [1, 3]
    rows = [sqliterecords.record_params(run, None, None) for run in runs]
    assert [(row[1], row[4]) for row in rows] == [(0, b"{}"), (-3, '{"ok": "é"}'.encode())]
    # Given one run all the same, the codec keeps the second body in its event's item.
    params = sqliterecords.record_params(events, None, None)
    row = (*params[:8], bytes.fromhex("ab" * 32), params[9], params[11])
    assert params[4] == b"{}" and sqliterecords.events_from_row(row) == events


@pytest.mark.parametrize(
    ("index", "field", "value"),
    [
        (0, "at", -0.0),  # the row's time is 0.0: equal, but another digest
        (0, "request_hash", HASH.upper()),  # not what its raw bytes give back
        (0, "request_hash", "0"),
        (0, "at", 5),  # the row's time, but an int: another digest
        (0, "stream", 0),  # a trailing default's value, not its type
        (0, "retry_of", False),
        (1, "budget", "team"),  # not the manifest's budget
        (1, "tokens", False),
        (1, "periods", []),
        (2, "generation", 3.0),
        (2, "worker", "w2"),
        (2, "provider_idempotency_key", 0),
        (3, "effect_unknown", 0),
        (3, "body_encoding", "base64"),  # a body that is not base64 stays in the item
        (3, "usage", {"input_tokens": 1}),
        (4, "flagged", False),
        (4, "periods", {"team": "total"}),
    ],
)
def test_a_value_alike_but_not_the_same_is_kept(index: int, field: str, value: Any) -> None:
    """What a compact item implies or leaves out is left out only when it is the very
    value (type included): anything else alike reads back as it was sealed."""
    items = [*ADMISSION, *((e.kind, e.data) for e in OBSERVATION)]
    items[index] = (items[index][0], items[index][1] | {field: value})
    at = 0.0 if value == 0.0 and type(value) is float else 5.0
    items = [
        (k, d | {"at": at} if "at" in d and (k, field) != ("call.manifest", "at") else d)
        for k, d in items
    ]
    admission = _chain(items[:3], first=2, prev="ab" * 32, at=at)
    observation = _chain(items[3:], first=5, prev=admission[-1].digest, at=at)
    read: list[StoredEvent] = []
    for run in (admission, observation):
        params = sqliterecords.record_params(run, None, None)
        prev = run[0].prev_digest
        read += sqliterecords.events_from_row(
            (*params[:8], bytes.fromhex(prev), params[9], params[11])
        )
    _same_events(read, [*admission, *observation])


# -- the property: any run of events reads back as sealed ------------------------------


_TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)))
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
    max_leaves=6,
)


#: Values a compact item implies or leaves out, and values alike but not the same
#: (0 and False, 1 and 1.0 and True, 0.0 and -0.0 and 0).
_ALIKE = [None, False, 0, {}, "utf8", 0.0, -0.0, 1, 1.0, True, [], ""]


@st.composite
def _value(draw: st.DrawFn, field: str, row: dict[str, Any]) -> Any:
    """A field's value: mostly one that fits a compact item (what the row implies, a
    hex hash, the four usage counts), else a value alike but not the same, or anything."""
    fits: list[Any] = []
    if field in row:
        value = row[field]
        fits = [value, value, value, value]
        if type(value) in (int, float) and value == int(value):
            fits += [int(value), float(value), bool(value)]  # alike, not the same
    elif field == "request_hash":
        fits = [HASH, HASH, HASH, HASH.upper(), "abc", "0"]
    elif field == "usage":
        counts = sqliterecords.USAGE
        fits = [None, dict.fromkeys(counts, 3), dict.fromkeys(counts, 1.0), {"input_tokens": 1}]
    if fits and draw(st.integers(0, 3)):
        return draw(st.sampled_from(fits))
    return draw(st.sampled_from(_ALIKE) | _JSON)


@st.composite
def _data(draw: st.DrawFn, kind: str, call: str, row: dict[str, Any]) -> dict[str, Any]:
    """An event's data: mostly its kind's fields exactly (which may fit a compact item),
    else any other keys."""
    if draw(st.integers(0, 3)):
        data = {f: draw(_value(f, row)) for f in sqliteevents.FIELDS[kind]}
        data["call"] = draw(st.sampled_from([call, call, call, "call_other", None]))
        if kind in ("call.manifest", "attempt.observed") and draw(st.integers(0, 5)):
            data["body"] = draw(_TEXT | st.binary().map(lambda b: b.hex()))
        return data
    return draw(st.dictionaries(_TEXT, _JSON, max_size=4))


@st.composite
def _runs(draw: st.DrawFn, first: int) -> tuple[list[StoredEvent], str]:
    """Events ``first``, ... mostly of one call by one writer at one time (as one
    operation writes them), and the digest before them: they may break into rows."""
    call = draw(st.sampled_from([CALL, "call_not_hex", "x"]))
    at = draw(st.floats(min_value=1.0, max_value=2e9) | st.integers(1, 9).map(float))
    worker, generation = draw(_TEXT.filter(bool)), draw(st.integers(0, 2**62) | st.just(1))
    row = {"at": at, "worker": worker, "generation": generation, "budget": "team/run"}
    prev = prev0 = draw(st.binary(min_size=32, max_size=32)).hex()
    events = []
    for seq in range(first, first + draw(st.integers(1, 5))):
        if draw(st.integers(0, 5)) == 0:  # another call's event, or another writer's or time
            call = draw(st.sampled_from([CALL, "call_" + "0" * 32, "x"]))
            at = draw(st.sampled_from([at, float(int(at)), at + 1.0]))
            worker = draw(st.sampled_from([worker, worker + "2"]))
            generation = draw(st.sampled_from([generation, generation + 1]))
        kind = draw(st.sampled_from(CALL_KINDS))
        data = draw(_data(kind, call, row))
        events.append(_sealed(seq, kind, call, data, (worker, generation), at, prev))
        prev = events[-1].digest
    return events, prev0


def _grouped(events: list[StoredEvent]) -> list[list[StoredEvent]]:
    """``events`` as the writer groups them into rows."""
    runs: list[list[StoredEvent]] = []
    for event in events:
        if runs and sqliterecords.joins(runs[-1], event):
            runs[-1].append(event)
        else:
            runs.append([event])
    return runs


def _same_events(read: list[StoredEvent], sealed: list[StoredEvent]) -> None:
    assert read == sealed
    for got, want in zip(read, sealed, strict=True):
        assert canonical_json(got.data) == canonical_json(want.data)
        assert repr(got.at) == repr(want.at)
        assert got.digest == stored_digest(got) == want.digest


@given(_runs(first=1))
@settings(max_examples=300)
def test_any_run_reads_back_as_sealed(case: tuple[list[StoredEvent], str]) -> None:
    """Any events of one operation (any data, fitting a compact item or not) stored as
    the writer groups them read back exactly: the same data (the same canonical JSON),
    and digests equal to event_digest over what was read."""
    events, prev = case
    read: list[StoredEvent] = []
    for run in _grouped(events):
        params = sqliterecords.record_params(run, None, None)
        # As SELECT_COLUMNS gives it: the worker's name, the derived predecessor.
        row = (*params[:8], bytes.fromhex(read[-1].digest if read else prev), *params[9:10])
        read += sqliterecords.events_from_row((*row, params[11]))
    _same_events(read, events)


@given(_runs(first=3))
@settings(max_examples=100, deadline=None)
def test_any_run_reads_back_as_sealed_from_a_sqlite_table(
    case: tuple[list[StoredEvent], str],
) -> None:
    """The same through a real events table (column affinities, the derived predecessor
    of each row, the first from an archive's kept link)."""
    events, prev = case
    conn = sqlite3.connect(":memory:")
    writerformat.declare_sqlite(conn)  # as the store's connections do
    try:
        migrate(conn)
        conn.execute("INSERT INTO chain_cuts VALUES (3, ?)", (bytes.fromhex(prev),))
        rows = [sqliterecords.record_params(run, None, None) for run in _grouped(events)]
        marks = sqliteevents.INSERT_MARKS
        conn.executemany(
            f"INSERT INTO events({sqliteevents.INSERT_COLUMNS}) VALUES ({marks})", rows
        )
        read = [
            e
            for r in conn.execute(sqliteevents.ALL_EVENTS)
            for e in sqliterecords.events_from_row(r)
        ]
    finally:
        conn.close()
    _same_events(read, events)


async def test_events_after_a_seq_inside_a_record_start_after_it(tmp_path: Path) -> None:
    """Reading from a seq that falls inside a record gives the events after that seq
    only, and never more than the limit asks, though rows hold several events each."""
    async with Ledger.open(str(tmp_path / "l.db")) as ledger:
        writer = await register(ledger, "w1", lease_s=60)
        admitted = await ledger.admit(writer, request(0))
        await ledger.record(writer, admitted.call_id, 1, _outcome(admitted.call_id))
        events = await ledger.store.events_after(0, 100)
        assert [e.record for e in events[1:]] == [(2, 4)] * 3 + [(5, 7)] * 3
        assert [e.seq for e in await ledger.store.events_after(2, 100)] == [3, 4, 5, 6, 7]
        assert [e.seq for e in await ledger.store.events_after(3, 2)] == [4, 5]
        assert [e.seq for e in await ledger.store.events_after(0, 2)] == [1, 2]
        assert await ledger.store.events_after(7, 100) == []


def _outcome(call_id: str) -> list[Event]:
    usage = dict.fromkeys(sqliterecords.USAGE, 3)
    return completion(call_id, budget="team/run", reserved=1000, actual=5, usage=usage)


async def test_a_guard_shaped_call_is_two_compact_records(tmp_path: Path) -> None:
    """A call as the guard writes it (a SHA-256 request hash, the four usage counts) is
    two rows of three compact items each: no event falls back to an object item."""
    path = tmp_path / "l.db"
    async with Ledger.open(str(path)) as ledger:
        writer = await register(ledger, "w1", lease_s=60)
        admitted = await ledger.admit(writer, request(0))
        await ledger.record(writer, admitted.call_id, 1, _outcome(admitted.call_id))
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute(
            "SELECT kind, data, length(body), hash FROM events WHERE call_id IS NOT NULL"
        ).fetchall()
    finally:
        conn.close()
    assert rows == [
        (
            -3,
            '[[0,"openai","/v1/chat/completions","POST","gpt-x",null,"team/run","team",'
            '"at_most_once"],[1,1000],[2,1]]',
            2,
            bytes.fromhex(request(0).request_hash),
        ),
        (
            -3,
            '[[3,1,200,false,[3,3,3,3],null,{}],[4,"team/run",1000,5],[5,"completed"]]',
            2,
            None,
        ),
    ]
