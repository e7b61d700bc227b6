"""SQLite's call rows (migration 14, ledger/sqlitecalls): keys, hashes and workers in
their short forms, a state kept only while the call is unresolved, and every read of a
resolved call folded from its events."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sqlite3
from pathlib import Path

import pytest
from eventkit import completion
from test_store_contract import register
from test_verify import request as verify_request

from effectguard.ledger import AdmitRequest, Ledger, sqlitecalls, sqliteevents, sqlitereads
from effectguard.ledger.rows import SLIM_FIELDS, STATE_FIELDS
from effectguard.ops.verify import verify_ledger
from effectguard.rules.events import Event
from effectguard.rules.workstate import WorkState, as_dict, work_state

R = 1000


def request(n: int, key: str | None = None) -> AdmitRequest:
    """A chat admission whose request hash is a SHA-256, as the guard makes it."""
    sha = hashlib.sha256(f"request {n}".encode()).hexdigest()
    chat = dataclasses.replace(verify_request(f"n{n}"), body="{}", effect_kind="at_most_once")
    return dataclasses.replace(chat, request_hash=sha, idempotency_key=key)


def failure(call_id: str) -> list[Event]:
    """Attempt 1 answered 500 (an error the provider does not declare unprocessed)."""
    observed, settled, completed = completion(call_id, budget="team/run", reserved=R, actual=R)
    return [
        dataclasses.replace(observed, status=500),
        settled,
        dataclasses.replace(completed, outcome="failed"),
    ]


def rows(path: Path) -> dict[str, tuple[object, ...]]:
    """Each call's row as stored: its key, request hash, worker and state columns."""
    conn = sqlite3.connect(path)
    try:
        found = conn.execute("SELECT call_id, request_hash, worker, state FROM calls")
        return {str(sqliteevents.call_from_key(r[0])): tuple(r) for r in found}
    finally:
        conn.close()


async def test_a_resolved_calls_row_keeps_no_state_and_reads_as_its_events(
    tmp_path: Path,
) -> None:
    """An in-flight call's row keeps its state; a completed or failed call's row keeps
    none, and every read of it gives its events' projection, the state the writer
    computed: the reader's, the listing's, a keyed replay's (the writer's) and a
    reconcile's (the writer's, then stored as the new state's fold)."""
    path = tmp_path / "l.db"
    async with Ledger.open(str(path)) as ledger:
        writer = await register(ledger, "w1", lease_s=60)
        done = await ledger.admit(writer, request(1, key="k1"))
        events = completion(done.call_id, budget="team/run", reserved=R, actual=7)
        done_state = await ledger.record(writer, done.call_id, 1, events)
        bad = await ledger.admit(writer, request(2))
        bad_state = await ledger.record(writer, bad.call_id, 1, failure(bad.call_id))
        flying = await ledger.admit(writer, request(3))
        stored = rows(path)
        assert await ledger.store.get_call(done.call_id) == done_state
        assert await ledger.store.get_call(bad.call_id) == bad_state
        listed = {s.call_id: s for s in await ledger.calls()}
        assert (listed[done.call_id], listed[bad.call_id]) == (done_state, bad_state)
        replay = await ledger.admit(writer, request(1, key="k1"))
        await ledger.reconcile(bad.call_id, applied=False, cost=0, note="no", by="ann")
        reconciled = await ledger.store.get_call(bad.call_id)
        projected = work_state(e.event for e in await ledger.store.call_events(bad.call_id))
        report = await verify_ledger(ledger)
    assert report.ok, report.problems
    assert (replay.action, replay.call_id) == ("replay", done.call_id)
    assert reconciled == projected and reconciled.stage == "reconciled_not_applied"
    key, hash_, worker, state = stored[done.call_id]
    assert key == bytes.fromhex(done.call_id[5:]) and hash_ == bytes.fromhex(
        request(1).request_hash
    )
    assert type(worker) is int and state is None
    assert stored[bad.call_id][3] is None
    assert stored[flying.call_id][3] is not None  # in flight: kept


@pytest.mark.parametrize("page", [500, 3])
async def test_a_listing_folds_its_calls_from_one_walk_of_their_events(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, page: int
) -> None:
    """Listing calls whose rows keep no state folds each from its own events (walked
    for a page of calls at once), whatever the page size: each call's state is the one
    read for it alone."""
    monkeypatch.setattr(sqlitereads, "_FOLD_PAGE", page)
    async with Ledger.open(str(tmp_path / "l.db")) as ledger:
        writer = await register(ledger, "w1", lease_s=60)
        for n in range(10):
            admitted = await ledger.admit(writer, request(n))
            outcome = completion(admitted.call_id, budget="team/run", reserved=R, actual=n)
            if n % 3:
                await ledger.record(writer, admitted.call_id, 1, outcome)
        listed = await ledger.calls()
        alone = [await ledger.store.get_call(s.call_id) for s in listed]
    assert listed == alone
    assert sorted(s.cost for s in listed if s.cost is not None) == [1, 2, 4, 5, 7, 8]
    assert len([s for s in listed if s.stage == "in_flight"]) == 4


def test_a_request_hash_is_stored_so_that_it_reads_back() -> None:
    """Lowercase hex of whole bytes is stored raw; any other hash as its text."""
    for text in ("ab" * 32, "AB" * 32, "abc", "", "hash-1", "0g"):
        key = sqlitecalls.hash_key(text)
        assert sqlitecalls.hash_from_key(key) == text
        assert isinstance(key, bytes) == (text == "ab" * 32)


def test_migration_14_reads_a_calls_spend_from_a_state_in_any_stored_form() -> None:
    """A state stored before migration 14 (an object, the array of every field, or the
    slim array) gives its model, cost and held to the row's spend columns."""
    state = WorkState(call_id="c", provider="p", model="m", cost=12, held=3, stage="completed")
    fields = as_dict(state)
    forms = [
        json.dumps(fields),
        json.dumps([fields[f] for f in STATE_FIELDS]),
        json.dumps([fields[f] for f in SLIM_FIELDS]),
    ]
    for text in forms:
        spend = [sqlitecalls.stored_field(text, f) for f in ("model", "cost", "held")]
        assert spend == ["m", 12, 3], text
    assert sqlitecalls.stored_field(None, "cost") is None
    assert sqlitecalls.stored_field(json.dumps({"stage": "completed"}), "model") is None
