"""How the SQLite store lays an event out in its row (format 2, migration 6).

The event itself, and so its digest, is unchanged: what changes is only how its
bytes sit on disk, because a call's six events were most of what a call cost
(about 3 KB of a 4 KB call, measured with ``effectguard bench ledger``):

- ``digest`` is the 32 raw bytes, not 64 hex characters;
- ``prev_digest`` is NULL when it is the previous row's digest (always, as the
  writer appends to the head): a read derives it from the row before (the one ending at
  the seq before its first event), from ``chain_cuts`` where an archive deleted that row,
  or from the genesis digest
  at event 1. The verifier still checks every link, since each digest covers
  its predecessor's;
- ``body`` (a manifest's request, an observation's response) is a BLOB of its
  raw bytes, out of the JSON, where it was an escaped string;
- ``call_id`` is the 16 bytes a ``call_`` and 32 hex digits id stands for (any
  other id stays text);
- ``data`` does not repeat the call id the ``call_id`` column holds, and where it
  has exactly the fields :data:`FIELDS` lists for its kind it is a JSON array of
  their values in that order, not an object repeating every field name;
- ``kind`` is a small integer, its index in :data:`KINDS`, and ``worker`` the id
  of its name in ``worker_names`` (migration 11; about 200 B a call). Kinds not in
  :data:`KINDS` (those SQL names: ``budget.limit_set`` in an index,
  ``ledger.archived`` in the archive's trigger) and a worker not resolved by the
  writer stay text;
- ``call_prev`` (migration 10) is the seq of the previous event of the same call
  (NULL for its first), and the call's row holds its last event's seq
  (``calls.last_seq``): a call's events are found by walking these links
  (:data:`CALL_EVENTS`), with no index of every event by call. The links are
  not part of the event; ``verify`` checks them (``SqliteStore.lookup_problems``).

Since format 4 (migration 13) a row may hold an operation's run of events, one call's,
as one record (:mod:`.sqliterecords`); a row of one event is laid out as described here.

A row whose data cannot be split exactly (a body whose text does not come back
from its bytes, a ``call`` that is not the row's call id) keeps it in ``data``:
reading puts back exactly what was sealed, so the digest check holds. (A row
with a call id and no ``call`` in its data, which no writer makes, reads back
with one: the verifier then names it.)
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Callable, Iterable, Iterator
from operator import itemgetter
from typing import Any

from effectguard.rules.events import GENESIS_DIGEST, StoredEvent, canonical_json

#: Insert order of an event row (``hash``: a record's manifest's request hash,
#: :mod:`.sqliterecords`).
INSERT_COLUMNS = (
    "seq, kind, call_id, data, body, worker, generation, at, prev_digest, digest, call_prev, hash"
)
#: Its placeholders.
INSERT_MARKS = ", ".join("?" * len(INSERT_COLUMNS.split(",")))


def first_seq(alias: str = "e") -> str:
    """SQL: the seq of the first event a row holds (a record, whose ``kind`` is minus
    its count, ends at its ``seq``; any other row holds one event; a text kind is never
    below 0)."""
    return f"({alias}.seq + CASE WHEN {alias}.kind < 0 THEN {alias}.kind + 1 ELSE 0 END)"


#: SQL: how many events a row of ``events e`` holds.
ROW_EVENTS = "(CASE WHEN e.kind < 0 THEN -e.kind ELSE 1 END)"
_FIRST = first_seq()
#: The read order: :func:`events_from_row` reads rows selected with this list ``FROM events e``.
#: The first event's predecessor is the digest of the row before (which ends at the seq
#: before), or the link an archive kept, or genesis.
SELECT_COLUMNS = (
    "e.seq, e.kind, e.call_id, e.data, e.body, "
    "coalesce((SELECT n.name FROM worker_names n WHERE n.id = e.worker), e.worker), "
    "e.generation, e.at, "
    f"coalesce(e.prev_digest, (SELECT p.digest FROM events p WHERE p.seq = {_FIRST} - 1), "
    f"(SELECT c.prev_digest FROM chain_cuts c WHERE c.seq = {_FIRST}), "
    f"CASE WHEN {_FIRST} = 1 THEN zeroblob(32) END), e.digest, e.hash"
)
#: Every event in order, each row as :func:`event_from_row` reads it.
ALL_EVENTS = f"SELECT {SELECT_COLUMNS} FROM events e ORDER BY e.seq"


def _walk(start: str) -> str:
    # Each step reads one row by its seq (the events table's own key); a link that
    # leads to another call's event, or to a row an archive deleted, ends the walk.
    return (
        f"WITH RECURSIVE walk(seq) AS ({start} UNION ALL "
        "SELECT w.call_prev FROM events w JOIN walk ON w.seq = walk.seq "
        "WHERE w.call_id = ?2) "
        f"SELECT {SELECT_COLUMNS} FROM events e "
        "WHERE e.seq IN (SELECT seq FROM walk) AND e.call_id = ?2 ORDER BY e.seq"
    )


#: A call's events in order, from its row's ``last_seq`` (parameters: :func:`call_key`
#: of the call id, twice: the calls and the events hold it alike since migration 14).
CALL_EVENTS = _walk("SELECT last_seq FROM calls WHERE call_id = ?1")
#: The same from a known last seq (parameters: that seq, and the call's key): the
#: writer's, whose transaction may have appended to the call since its row was written.
CALL_EVENTS_FROM = _walk("SELECT ?1")


#: :data:`SELECT_COLUMNS` without the digests (NULL): what folding a call's state reads.
FOLD_COLUMNS = (
    "e.seq, e.kind, e.call_id, e.data, e.body, "
    "coalesce((SELECT n.name FROM worker_names n WHERE n.id = e.worker), e.worker), "
    "e.generation, e.at, NULL, NULL, e.hash"
)


def calls_events(count: int) -> str:
    """The events of ``count`` calls (parameters: their :func:`call_key`), in order, each
    walked from its row as :data:`CALL_EVENTS` walks one; read as :data:`FOLD_COLUMNS`."""
    marks = ", ".join("?" * count)
    return (
        "WITH RECURSIVE walk(key, seq) AS ("
        f"SELECT call_id, last_seq FROM calls WHERE call_id IN ({marks}) UNION ALL "
        "SELECT walk.key, w.call_prev FROM events w JOIN walk ON w.seq = walk.seq "
        "WHERE w.call_id = walk.key) "
        f"SELECT {FOLD_COLUMNS} FROM walk JOIN events e "
        "ON e.seq = walk.seq AND e.call_id = walk.key ORDER BY e.seq"
    )


#: Each kind's fields, in the order a positional row lists their values. Part of the
#: format: a field added to an event later is not appended here (rows with it stay
#: objects), so an existing row never changes meaning. ``ledger.archived`` stays an
#: object: the archive's trigger and queries read its fields with ``json_extract``.
FIELDS: dict[str, tuple[str, ...]] = {
    "attempt.interrupted": ("attempt", "reason", "by"),
    "attempt.late_answer": (
        "attempt",
        "status",
        "effect",
        "body_digest",
        "body_bytes",
        "usage",
        "usage_problem",
        "cost",
        "observed_by",
        "generation",
        "reason",
    ),
    "attempt.not_sent": ("attempt", "reason"),
    "attempt.observed": (
        "attempt",
        "status",
        "not_processed",
        "usage",
        "usage_problem",
        "headers",
        "body_encoding",
        "effect_unknown",
    ),
    "attempt.started": ("attempt", "worker", "generation", "provider_idempotency_key", "at"),
    "budget.corrected": ("budget", "settled", "actual", "periods"),
    "budget.held": ("budget", "amount", "periods"),
    "budget.limit_set": ("path", "limit", "period", "tz", "rpm", "tpm", "concurrency"),
    "budget.released": ("budget", "amount", "periods"),
    "budget.reserved": ("budget", "amount", "tokens", "periods"),
    "budget.settled": ("budget", "reserved", "actual", "flagged", "tokens", "periods"),
    "budget.unheld": ("budget", "amount", "spent", "periods"),
    "call.completed": ("outcome",),
    "call.manifest": (
        "request_hash",
        "provider",
        "endpoint",
        "method",
        "model",
        "idempotency_key",
        "budget",
        "budget_root",
        "effect_kind",
        "body_encoding",
        "headers",
        "stream",
        "retry_of",
        "provider_idempotency_window_s",
        "at",
    ),
    "call.reconciled": ("applied", "cost", "note", "by"),
    "call.refused": ("reason", "status", "message"),
    "call.resend_authorized": ("note", "by"),
    "key.created": ("name", "sha256", "budget_root", "expires_at", "models", "providers"),
    "key.revoked": ("name",),
    "worker.registered": ("worker", "generation", "host", "pid"),
    "worker.taken_over": ("worker", "generation", "by", "reason"),
}

#: The kinds stored as their index here (migration 11). Part of the format: only ever
#: appended to, never reordered. A kind SQL text names stays text (see the module).
KINDS: tuple[str, ...] = (
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
KIND_CODES: dict[str, int] = {kind: code for code, kind in enumerate(KINDS)}


def kind_from_column(value: Any) -> str:
    """A ``kind`` column's kind (an index into :data:`KINDS`, or the kind's text)."""
    return KINDS[value] if type(value) is int else str(value)


_CALL_ID = re.compile(r"call_[0-9a-f]{32}")


def call_key(call_id: str) -> bytes | str:
    """How ``call_id`` is stored in (and looked up by) the events' ``call_id`` column."""
    global _last_key
    last_id, key = _last_key
    if last_id != call_id:
        # An operation appends several events of one call in a row: match each id once.
        key = bytes.fromhex(call_id[5:]) if _CALL_ID.fullmatch(call_id) else call_id
        _last_key = (call_id, key)
    return key


#: The last call id :func:`call_key` converted, and its key (one tuple: read atomically).
_last_key: tuple[str | None, bytes | str] = (None, "")


def call_from_key(value: Any) -> str | None:
    """Invert :func:`call_key` (None stays None: an event of no call)."""
    if isinstance(value, bytes | bytearray | memoryview):
        return "call_" + bytes(value).hex()
    return value if value is None else str(value)


def split(kind: str, data: dict[str, Any], call_id: str | None) -> tuple[str, bytes | None]:
    """``data`` as stored: its JSON without the call id and the body (positional where
    its fields are its kind's :data:`FIELDS`), and the body's bytes."""
    body = None
    text = data.get("body")
    if isinstance(text, str):
        body = body_bytes(text, data.get("body_encoding", "utf8"))
    drop_call = call_id is not None and data.get("call") == call_id
    # On every event of every call: one comparison of key sets and one itemgetter,
    # both in C, instead of building the trimmed dict first.
    layout = _layout(kind, drop_call, body is not None)
    if layout is not None and data.keys() == layout[0]:
        return canonical_json(layout[1](data)), body
    rest = {
        k: v
        for k, v in data.items()
        if not ((k == "call" and drop_call) or (k == "body" and body is not None))
    }
    return canonical_json(rest), body


_LAYOUTS: dict[tuple[str, bool, bool], tuple[frozenset[str], Callable[[Any], Any]] | None] = {}


def _layout(
    kind: str, drop_call: bool, drop_body: bool
) -> tuple[frozenset[str], Callable[[Any], Any]] | None:
    """The keys data must have to be stored positionally, and the getter of its values."""
    key = (kind, drop_call, drop_body)
    if key not in _LAYOUTS:
        names = FIELDS.get(kind)
        if names is None:
            _LAYOUTS[key] = None
        else:
            keys = set(names) | ({"call"} if drop_call else set())
            keys |= {"body"} if drop_body else set()
            getter = itemgetter(*names) if len(names) > 1 else (lambda d: (d[names[0]],))
            _LAYOUTS[key] = (frozenset(keys), getter)
    return _LAYOUTS[key]


def body_bytes(text: Any, encoding: Any) -> bytes | None:
    """A body's text as the bytes stored for it, only where :func:`body_text` gives back
    the same text (the digest covers the text); None: keep the text."""
    if type(text) is not str:
        return None
    if encoding == "base64":
        try:
            raw = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            return None
        return raw if base64.b64encode(raw).decode("ascii") == text else None
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate cannot be stored as UTF-8
        return None


def join(kind: str, data_json: str, body: bytes | None, call_id: str | None) -> dict[str, Any]:
    """Invert :func:`split`."""
    decoded = json.loads(data_json)
    data: dict[str, Any] = (
        dict(zip(FIELDS[kind], decoded, strict=True)) if type(decoded) is list else decoded
    )
    if body is not None and "body" not in data:
        data["body"] = body_text(body, data.get("body_encoding", "utf8"))
    if call_id is not None and "call" not in data:
        data["call"] = call_id
    return data


def body_text(body: bytes, encoding: Any) -> str:
    """Invert :func:`body_bytes`."""
    if encoding == "base64":
        return base64.b64encode(body).decode("ascii")
    return bytes(body).decode("utf-8")


def event_params(
    event: StoredEvent, call_prev: int | None = None, worker: int | None = None
) -> tuple[Any, ...]:
    """Parameters for appending ``event`` at the head, in :data:`INSERT_COLUMNS` order
    (``call_prev``: the seq of the previous event of its call, if any; ``worker``: the
    id of the event's worker in ``worker_names``, else its name is stored)."""
    data_json, body = split(event.kind, event.data, event.call_id)
    return (
        event.seq,
        KIND_CODES.get(event.kind, event.kind),
        None if event.call_id is None else call_key(event.call_id),
        data_json,
        body,
        event.worker if worker is None else worker,
        event.generation,
        event.at,
        None,  # the head's digest: derived on read
        digest_column(event.digest),
        call_prev,
        None,  # the request hash column: a record's (sqliterecords)
    )


def hex_digest(value: Any) -> str:
    """A digest column as hex (raw bytes in format 2; text where a tool wrote hex)."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    return "" if value is None else str(value)


def event_from_row(row: tuple[Any, ...] | Any) -> StoredEvent:
    """A stored event from a row of one event selected with :data:`SELECT_COLUMNS`
    (format 3; a record's events are read by ``sqliterecords.events_from_record``).

    A predecessor that can be derived from nothing (its row deleted outside an
    archive) reads as ``""``, which the verifier reports as a broken link.
    """
    seq, code, key, data, body, worker, generation, at, prev_digest, digest = row[:10]
    kind = kind_from_column(code)
    call_id = call_from_key(key)
    return StoredEvent(
        seq=int(seq),
        kind=kind,
        call_id=call_id,
        data=join(kind, data, body, call_id),
        worker=worker,
        generation=int(generation),
        at=float(at),
        prev_digest=hex_digest(prev_digest),
        digest=hex_digest(digest),
    )


def digest_column(value: str) -> bytes | str:
    """A hex digest as stored: its raw bytes (a value that is not hex stays as it was)."""
    try:
        return bytes.fromhex(value) if len(value) == 64 else value
    except ValueError:
        return value


def convert_rows(rows: Iterable[tuple[Any, ...]]) -> Iterator[tuple[Any, ...]]:
    """Rows of the format-1 events table (``rows.EVENT_COLUMNS`` order, by ``seq``) as
    format-2 rows as migration 6 copies them (:data:`INSERT_COLUMNS` up to ``digest``;
    kinds and workers as text, which migration 11 then makes codes)."""
    previous: tuple[int, str] | None = None
    for seq, kind, call_id, data, worker, generation, at, prev_digest, digest in rows:
        derivable = (seq == 1 and prev_digest == GENESIS_DIGEST) or (
            previous is not None and previous == (seq - 1, prev_digest)
        )
        data_json, body = split(kind, json.loads(data), call_id)
        yield (
            seq,
            kind,
            None if call_id is None else call_key(call_id),
            data_json,
            body,
            worker,
            generation,
            at,
            None if derivable else digest_column(prev_digest),
            digest_column(digest),
        )
        previous = (seq, digest)
