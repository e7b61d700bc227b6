"""How the SQLite store keeps a call's row (migration 14), and reads a state back.

The calls table is the index the store finds calls by (a call id, a budget root and
key, the unresolved calls by request hash, a worker's in-flight calls), and it held
each call's state for reads: about 295 B a call of the 560 a call costs beyond its
events (``effectguard bench ledger``). Since migration 14:

- ``call_id`` is the 16 bytes a ``call_`` id stands for, as the events hold it
  (:func:`~.sqliteevents.call_key`), ``request_hash`` the raw bytes of a lowercase hex
  hash (:func:`hash_key`; any other hash stays text), ``worker`` the id of its name in
  ``worker_names``;
- ``state`` is kept only while the call is unresolved (:func:`keeps_state`: in flight
  or effect unknown), where the writer's hot path, the sweeper, the retry lookup and
  the metrics' ``held`` read it from the row. A resolved call's state is the
  projection of its events (``rules.workstate.work_state``), folded when it is read
  (:func:`fold`): its row is ``NULL`` there. States stored before (resolved or not, any
  form) read as they were.

The stage, budget, root, key, hash, provider, creation time and worker stay columns:
every query that finds calls reads them. So do a call's model, cost and held amount
(rows.SPEND_COLUMNS, about 29 B a call): the operator page's spend chart reads them for
every call of its window (``SqlReads.call_spend``), where folding each resolved call's
events took 85 µs a call (4.3 s for 50,000). They are written with the row, at
admission and whenever its state changes, so they cost no page of their own.
``verify`` compares each kept state, and every row's columns, with its own fold of the
events; ``lookup_problems`` names an unresolved call whose row keeps no state.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from operator import itemgetter
from typing import Any

from effectguard.ledger import sqliteevents
from effectguard.ledger.rows import (
    CALL_COLUMNS,
    COLUMN_FIELDS,
    INDEX_COLUMNS,
    MUTABLE_CALL_COLUMNS,
    SLIM_FIELDS,
    SPEND_COLUMNS,
    STATE_FIELDS,
    names,
    state_from_json,
)
from effectguard.rules.events import StoredEvent, event_from_data
from effectguard.rules.workstate import UNRESOLVED, WorkState, as_dict, work_state

#: A call's row as the store writes it: :func:`call_params`, then the seq of the call's
#: last event (:mod:`.sqlitelinks`).
ROW_COLUMNS = f"{CALL_COLUMNS}, {SPEND_COLUMNS}, last_seq"
#: What a later write of the row may change (a call's model never does).
MUTABLE_COLUMNS = (*MUTABLE_CALL_COLUMNS, "cost", "held", "last_seq")
_WORKER_NAME = "coalesce((SELECT n.name FROM worker_names n WHERE n.id = calls.worker), worker)"
#: What a read of a call selects ``FROM calls``: :func:`state_from_row` reads it (the
#: columns of rows.COLUMN_FIELDS, the worker's name for its id, the key, the state).
CALL_READ = ", ".join(COLUMN_FIELDS).replace("worker", _WORKER_NAME) + ", idempotency_key, state"
#: Every call's indexed columns (rows.INDEX_COLUMNS), the worker's name for its id:
#: :func:`index_columns` reads a row of it.
INDEX_READ = INDEX_COLUMNS.replace("worker", _WORKER_NAME)
#: Rows that keep a state (``verify`` compares each with the events).
KEPT_READ = (
    f"SELECT {CALL_READ} FROM calls WHERE state IS NOT NULL AND calls.call_id > ? "
    "ORDER BY calls.call_id LIMIT ?"
)
_KEY = names(INDEX_COLUMNS).index("request_hash")
_SLIM = itemgetter(*SLIM_FIELDS)
_COMPACT = json.JSONEncoder(separators=(",", ":"))


def keeps_state(state: WorkState) -> bool:
    """Whether ``state``'s row keeps it (else it is folded from the events on read)."""
    return state.stage in UNRESOLVED


def hash_key(request_hash: str) -> bytes | str:
    """How ``request_hash`` is stored in (and looked up by) the calls' column: the raw
    bytes of lowercase hex, else the text."""
    if request_hash and not len(request_hash) % 2:
        try:
            raw = bytes.fromhex(request_hash)
        except ValueError:
            return request_hash
        if raw.hex() == request_hash:
            return raw
    return request_hash


def hash_from_key(value: Any) -> str:
    """Invert :func:`hash_key`."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    return str(value)


def call_params(state: WorkState, worker: int) -> tuple[Any, ...]:
    """Parameters for storing ``state``'s row, in :data:`ROW_COLUMNS` order but its
    ``last_seq`` (``worker``: the id of its worker's name). A refused call does not hold
    its idempotency key: the key stays free for the client's next try."""
    fields = as_dict(state)
    kept = None
    if keeps_state(state):
        # The array of rows.SLIM_FIELDS where the state has exactly rows.STATE_FIELDS.
        kept = _COMPACT.encode(_SLIM(fields) if tuple(fields) == STATE_FIELDS else fields)
    return (
        sqliteevents.call_key(state.call_id),
        state.stage,
        state.budget,
        state.budget_root,
        None if state.stage == "refused" else state.idempotency_key,
        hash_key(state.request_hash),
        state.provider,
        state.created_at,
        worker,
        kept,
        state.model,
        state.cost,
        state.held,
    )


def _columns(row: tuple[Any, ...] | Any) -> dict[str, Any]:
    """The state fields of a :data:`CALL_READ` row's columns, as text."""
    fields = dict(zip(COLUMN_FIELDS, row[: len(COLUMN_FIELDS)], strict=True))
    fields["call_id"] = sqliteevents.call_from_key(fields["call_id"])
    fields["request_hash"] = hash_from_key(fields["request_hash"])
    return fields


def state_from_row(row: tuple[Any, ...] | Any) -> WorkState | None:
    """The state a :data:`CALL_READ` row keeps (None: it keeps none; :func:`fold` the
    call's events): a positional state of rows.SLIM_FIELDS completed by the columns, or
    a state stored whole (an object, or the array of all rows.STATE_FIELDS)."""
    text = row[-1]
    if text is None:
        return None
    stored = json.loads(text)
    if type(stored) is list and len(stored) == len(SLIM_FIELDS):
        fields = _columns(row)
        fields.update(zip(SLIM_FIELDS, stored, strict=True))
        return WorkState(**fields)
    return state_from_json(text)


@functools.lru_cache(maxsize=1)
def _parsed(text: str) -> Any:
    # Migration 14 asks for three fields of each row's state in turn: one parse a row.
    return json.loads(text)


def stored_field(text: str | None, name: str) -> Any:
    """Field ``name`` of a state stored in any of the forms :func:`state_from_row` reads
    (None: no state, or a state without it); migration 14 copies a row's spend with it."""
    if text is None:
        return None
    stored = _parsed(text)
    if type(stored) is dict:
        return stored.get(name)
    fields = SLIM_FIELDS if len(stored) == len(SLIM_FIELDS) else STATE_FIELDS
    return stored[fields.index(name)] if name in fields else None


def row_state(row: tuple[Any, ...] | Any) -> tuple[WorkState, bool]:
    """A :data:`CALL_READ` row's state and True, or, where it keeps none, a state of its
    columns alone (the stage, hash, provider, budget, root, time, worker and key; no
    attempt, money or provider idempotency window) and False."""
    state = state_from_row(row)
    if state is not None:
        return state, True
    return WorkState(**_columns(row), idempotency_key=row[-2]), False


def index_columns(row: tuple[Any, ...] | Any) -> tuple[Any, ...]:
    """An :data:`INDEX_READ` row as text, as the other stores give it."""
    values = list(row)
    values[0] = sqliteevents.call_from_key(values[0])
    values[_KEY] = hash_from_key(values[_KEY])
    return tuple(values)


def fold(events: Iterable[StoredEvent]) -> WorkState:
    """A call's state from its events: what its row kept while it was unresolved."""
    return work_state(e.event for e in events)


def fold_data(events: Iterable[tuple[str, dict[str, Any]]]) -> WorkState:
    """:func:`fold` from each event's kind and data (``sqliterecords.kinds_and_data``)."""
    return work_state(event_from_data(kind, data) for kind, data in events)
