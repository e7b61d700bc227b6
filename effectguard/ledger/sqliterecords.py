"""Events as operation records (format 4, migration 13): one row for a run of events.

An admission writes three events of one call (``call.manifest``, ``budget.reserved``,
``attempt.started``) and an observation three more, each run sharing its call, time,
worker and generation. Stored one row each (format 3, :mod:`.sqliteevents`), every
event paid again for its call id, time, worker, generation, digest and SQLite's own
row overhead: about 80 B of an event row's 180 (``effectguard bench ledger``). A
record stores such a run once:

- ``seq`` is the seq of the run's last event and ``kind`` is minus the number of
  events (a single event's row holds its kind's code or text, as before), so the
  chain head (``queries.HEAD``) is still the last row, and the run's first event is
  ``seq + kind + 1``;
- ``digest`` is the last event's. The others' digests, and the first event's
  ``prev_digest`` (from the row before, as for any row), are derived on read with
  :func:`~effectguard.rules.digest.event_digest`. Each event read still carries its
  digest and its predecessor's; an event edited inside a record changes the digests
  derived after it, so the last no longer matches the stored one and ``verify`` names
  the record's events (it cannot tell which of them was edited: one digest seals them);
- ``data`` is a JSON array of one item per event: ``[code, value, ...]``, the values of
  :func:`item_fields` (its kind's :data:`~.sqliteevents.FIELDS` less what the row
  implies) with trailing values equal to :data:`TRAILING` left out; an event that does
  not fit that form exactly is an object item ``{"kind": code, "data": {...}}``, its
  data as a single row would hold it;
- a compact item implies what the row already holds: its call (``call``), a manifest's
  ``at`` and an ``attempt.started``'s ``worker``, ``generation`` and ``at`` (the row's),
  a ``budget.reserved``'s ``budget`` after its manifest in the same record (the
  manifest's); a usage of exactly the four :data:`USAGE` counts is the array of them;
- a manifest's ``request_hash`` (lowercase hex) is the row's ``hash`` BLOB of its raw
  bytes, and a row's one body (a manifest's request, an observation's response) is its
  ``body`` BLOB, as in format 3. Only a compact item takes them: an event whose body or
  hash cannot be split exactly stays an object item with them inside.

Only call events of one operation are grouped (:func:`joins`); other events, and a
run of one, are single rows exactly as format 3 writes them, which is also how every
row written before format 4 reads: this format needs no rewrite of existing rows.
(A call event whose data has no ``call``, which format 3 would read back with one, is
a record of one.)
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

from effectguard.errors import LedgerCorrupt
from effectguard.ledger import sqliteevents
from effectguard.ledger.sqliteevents import FIELDS, KIND_CODES, KINDS, body_bytes, body_text
from effectguard.rules.events import StoredEvent, canonical_json, event_digest

#: The four usage counts, in the order a compact usage lists them (rules/usage.Usage).
USAGE = ("input_tokens", "output_tokens", "cached_input_tokens", "cache_write_tokens")
_USAGE_KEYS = frozenset(USAGE)
#: Per kind, the values its last item fields default to: trailing values equal to these
#: are left out of a compact item. Part of the format, like FIELDS: never changed.
TRAILING: dict[str, tuple[Any, ...]] = {
    "call.manifest": ("utf8", {}, False, None, None),
    "budget.reserved": (0, {}),
    "attempt.started": (None,),
    "attempt.observed": ("utf8", False),
    "budget.settled": (None, None, {}),
    "budget.released": ({},),
    "budget.held": ({},),
    "budget.unheld": ({},),
    "budget.corrected": ({},),
}
#: Fields a compact item leaves to its row (a reserved budget: to its record's manifest).
_IMPLIED: dict[str, tuple[str, ...]] = {
    "call.manifest": ("request_hash", "at"),
    "attempt.started": ("worker", "generation", "at"),
}
#: Kinds whose ``body`` a compact item leaves to the row's body column.
_BODIES = frozenset({"call.manifest", "attempt.observed"})


@functools.cache
def item_fields(kind: str, after_manifest: bool) -> tuple[str, ...]:
    """The fields a compact item of ``kind`` lists, in order (``after_manifest``: its
    record holds the call's manifest before it)."""
    implied: tuple[str, ...] = _IMPLIED.get(kind, ())
    if kind == "budget.reserved" and after_manifest:
        implied = ("budget",)
    return tuple(f for f in FIELDS[kind] if f not in implied)


@functools.cache
def _keys(kind: str) -> frozenset[str]:
    """The data keys an event of ``kind`` must have, exactly, for a compact item."""
    return frozenset({*FIELDS[kind], "call"} | ({"body"} if kind in _BODIES else set()))


def _same(a: Any, b: Any) -> bool:
    """Equal and alike: the same canonical JSON and the same digest header (0 is not
    False, 1 is not 1.0, -0.0 is not 0.0)."""
    if a is b:
        return True
    return type(a) is type(b) and (repr(a) == repr(b) if type(a) is float else a == b)


def joins(run: Sequence[StoredEvent], event: StoredEvent) -> bool:
    """Whether ``event`` can be stored in the same record as the ``run`` before it."""
    first = run[0]
    return (
        event.call_id is not None
        and event.call_id == first.call_id
        and event.kind in KIND_CODES
        and first.kind in KIND_CODES
        and event.seq == run[-1].seq + 1
        and _same(event.at, first.at)
        and event.worker == first.worker
        and _same(event.generation, first.generation)
        and not ("body" in event.data and any("body" in e.data for e in run))
    )


class _Row:
    """What a record's items share: its call, time, worker and generation, its body and
    hash columns, and its manifest's data once an item has given it."""

    __slots__ = ("at", "body", "call_id", "generation", "hash", "manifest", "taken", "worker")

    def __init__(
        self,
        call_id: str | None,
        at: float,
        worker: str,
        generation: int,
        body: bytes | None = None,
        hash_: bytes | None = None,
    ) -> None:
        self.call_id = call_id
        self.at = at
        self.worker = worker
        self.generation = generation
        self.body = body
        self.hash = hash_
        self.manifest: dict[str, Any] | None = None
        #: How many of the body and hash columns' values an item took (reading).
        self.taken = 0

    @property
    def after_manifest(self) -> bool:
        return self.manifest is not None and "budget" in self.manifest

    def implied(self, kind: str) -> dict[str, Any]:
        """The fields of a compact ``kind`` item that the row (or its manifest) holds."""
        if kind == "call.manifest":
            return {"at": self.at}
        if kind == "attempt.started":
            return {"worker": self.worker, "generation": self.generation, "at": self.at}
        if kind == "budget.reserved" and self.manifest is not None and self.after_manifest:
            return {"budget": self.manifest["budget"]}
        return {}


def _hash_bytes(value: Any) -> bytes | None:
    """A request hash as raw bytes, only where they give back the same text."""
    if type(value) is not str or not value or len(value) % 2:
        return None
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        return None
    return raw if raw.hex() == value else None


# -- writing


def _compact(kind: str, data: dict[str, Any], row: _Row) -> list[Any] | None:
    """The compact item of an event, or None where it does not fit one exactly; gives
    ``row`` the body and hash the item leaves to it."""
    if data.keys() != _keys(kind) or not _same(data["call"], row.call_id):
        return None
    if any(not _same(data[f], v) for f, v in row.implied(kind).items()):
        return None
    fields = item_fields(kind, row.after_manifest)
    values = [data[f] for f in fields]
    if kind == "attempt.observed" and data["usage"] is not None:
        usage = data["usage"]
        if type(usage) is not dict or usage.keys() != _USAGE_KEYS:
            return None
        values[fields.index("usage")] = [usage[k] for k in USAGE]
    body = hash_ = None
    if kind in _BODIES:
        body = body_bytes(data["body"], data["body_encoding"])
        if body is None or row.body is not None:  # one body a row
            return None
    if kind == "call.manifest":
        hash_ = _hash_bytes(data["request_hash"])
        if hash_ is None:
            return None
    row.body = row.body if body is None else body
    row.hash = row.hash if hash_ is None else hash_
    defaults = TRAILING.get(kind, ())
    while defaults and values and _same(values[-1], defaults[-1]):
        values.pop()
        defaults = defaults[:-1]
    return [KIND_CODES[kind], *values]


def _item(event: StoredEvent, row: _Row) -> Any:
    data = event.data
    item: Any = _compact(event.kind, data, row)
    if item is None:  # the data as it is, body and call included
        item = {"kind": KIND_CODES[event.kind], "data": data}
    if event.kind == "call.manifest":
        row.manifest = data
    return item


def record_params(
    run: Sequence[StoredEvent], call_prev: int | None, worker: int | None
) -> tuple[Any, ...]:
    """Parameters for appending ``run`` (events :func:`joins` accepted) as one row, in
    :data:`~.sqliteevents.INSERT_COLUMNS` order (``call_prev``: the seq of the call's
    previous row; ``worker``: the worker's id in ``worker_names``, else its name)."""
    one = run[0]
    if len(run) == 1 and (one.call_id is None or "call" in one.data or one.kind not in KIND_CODES):
        # Format 3 reads it back exactly, but for a call event without a ``call`` (which
        # no writer makes, and format 3 reads back with one): that is a record of one.
        return sqliteevents.event_params(run[0], call_prev, worker)
    first, last = run[0], run[-1]
    row = _Row(first.call_id, first.at, first.worker, first.generation)
    items = [_item(e, row) for e in run]
    return (
        last.seq,
        -len(run),
        None if first.call_id is None else sqliteevents.call_key(first.call_id),
        canonical_json(items),
        row.body,
        first.worker if worker is None else worker,
        first.generation,
        first.at,
        None,  # the first event's predecessor: the previous row's digest, derived on read
        sqliteevents.digest_column(last.digest),
        call_prev,
        row.hash,
    )


# -- reading


def _read_item(item: Any, row: _Row) -> tuple[str, dict[str, Any]]:
    """Invert :func:`_item`: an item's kind and data."""
    if type(item) is dict:
        kind, data = KINDS[item["kind"]], item["data"]
        if type(data) is not dict:
            raise ValueError(f"{kind} item without data")
    else:
        kind = KINDS[item[0]]
        fields = item_fields(kind, row.after_manifest)
        values = list(item[1:])
        missing = len(fields) - len(values)
        defaults = TRAILING.get(kind, ())
        if missing < 0 or missing > len(defaults):
            raise ValueError(f"{kind} item of {len(values)} values")
        values += [dict(d) if type(d) is dict else d for d in defaults[len(defaults) - missing :]]
        data = dict(zip(fields, values, strict=True))
        data.update(row.implied(kind))
        data["call"] = row.call_id
        _read_columns(kind, data, row)
    if kind == "call.manifest":
        row.manifest = data
    return kind, data


def _read_columns(kind: str, data: dict[str, Any], row: _Row) -> None:
    """Put back what a compact item left to the row's columns."""
    if kind == "attempt.observed" and type(data["usage"]) is list:
        data["usage"] = dict(zip(USAGE, data["usage"], strict=True))
    if kind == "call.manifest":
        if row.hash is None:
            raise ValueError("a compact manifest in a row without a request hash")
        data["request_hash"] = bytes(row.hash).hex()
        row.taken += 1
    if kind in _BODIES:
        if row.body is None:
            raise ValueError(f"a compact {kind} in a row without a body")
        data["body"] = body_text(row.body, data["body_encoding"])
        row.taken += 1


def _read_record(row: tuple[Any, ...] | Any) -> tuple[_Row, list[tuple[str, dict[str, Any]]]]:
    """A record row's shared columns, and each of its events' kind and data."""
    seq, code, key, data, body, worker, generation, at, _, _, hash_ = row
    count, last = -int(code), int(seq)
    shared = _Row(sqliteevents.call_from_key(key), float(at), worker, int(generation), body, hash_)
    try:
        items = json.loads(data)
        if type(items) is not list or len(items) != count:
            raise ValueError(f"{count} events but {len(items)} items")
        read = [_read_item(item, shared) for item in items]
        if shared.taken != (body is not None) + (hash_ is not None):
            raise ValueError("a body or request hash that no event of it takes")
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise LedgerCorrupt(
            f"events {last - count + 1}..{last} (one stored record): the record does not "
            f"read ({exc})"
        ) from exc
    return shared, read


def events_from_record(row: tuple[Any, ...] | Any) -> list[StoredEvent]:
    """The events of a row selected with :data:`~.sqliteevents.SELECT_COLUMNS` whose
    ``kind`` is negative (a record); each intermediate digest derived on read."""
    shared, read = _read_record(row)
    last = int(row[0])
    first = last - len(read) + 1
    prev = sqliteevents.hex_digest(row[8])
    out: list[StoredEvent] = []
    for number, (kind, fields) in enumerate(read, start=first):
        own = sqliteevents.hex_digest(row[9])
        if number != last:
            own = event_digest(
                seq=number,
                kind=kind,
                call_id=shared.call_id,
                data_json=canonical_json(fields),
                worker=shared.worker,
                generation=shared.generation,
                at=shared.at,
                prev_digest=prev,
            )
        out.append(
            StoredEvent(
                number,
                kind,
                shared.call_id,
                fields,
                shared.worker,
                shared.generation,
                shared.at,
                prev,
                own,
                record=(first, last),
            )
        )
        prev = own
    return out


def events_from_row(row: tuple[Any, ...] | Any) -> list[StoredEvent]:
    """The events of any row selected with :data:`~.sqliteevents.SELECT_COLUMNS`: a
    record's (negative ``kind``), or a single event's (every format)."""
    code = row[1]
    if type(code) is int and code < 0:
        return events_from_record(row)
    return [sqliteevents.event_from_row(row)]


def kinds_and_data(row: tuple[Any, ...] | Any) -> list[tuple[str, dict[str, Any]]]:
    """What :func:`events_from_row` reads of a row but no digest: each event's kind and
    data, for folding a call's state (about a third of the reading's cost less)."""
    code = row[1]
    if type(code) is int and code < 0:
        return _read_record(row)[1]
    kind = sqliteevents.kind_from_column(code)
    return [(kind, sqliteevents.join(kind, row[3], row[4], sqliteevents.call_from_key(row[2])))]
