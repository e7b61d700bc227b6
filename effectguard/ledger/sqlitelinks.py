"""What a SQLite event row refers to outside itself, and the checks of it.

A call's events are reached by links, not by an index: the call's row holds its
last event's seq (``calls.last_seq``), each event the seq of the previous event
of its call (``events.call_prev``). The links are not part of any event, so the
hash chain does not cover them; a wrong link would make ``show``, a resend or a
late answer read the wrong events. ``verify`` therefore re-derives every link
from the events' own call ids (:func:`problems`). A row's worker is the id of its
name in ``worker_names`` (migration 11); a wrong name there changes the event read,
which its digest check names.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Any

from effectguard.ledger import sqliteevents, sqliterecords
from effectguard.ledger.sqlparts import UNRESOLVED_SQL
from effectguard.rules.events import StoredEvent

_LAST_SEQ = "SELECT last_seq FROM calls WHERE call_id = ?"
_WORKER_ID = "SELECT id FROM worker_names WHERE name = ?"
_NEW_WORKER_ID = "INSERT INTO worker_names(name) VALUES (?) RETURNING id"


class RowLinks:
    """The writer's view of what an event row refers to: each call's last event (its
    ``call_prev``) and each worker's id in ``worker_names``; and the events of the
    operation under way, grouped into the rows they will be (``sqliterecords``).

    Cached across batches like the writer's other caches; :meth:`forget` whenever the
    tables may hold something else (another connection wrote, a rollback).
    """

    def __init__(self, conn: sqlite3.Connection, size: int) -> None:
        self.conn = conn
        self.size = size
        self.tails: dict[str, int | None] = {}
        self.workers: dict[str, int] = {}
        #: Each queued row's events, and the seq of its call's row before it.
        self.queued: list[tuple[list[StoredEvent], int | None]] = []

    def forget(self) -> None:
        self.tails = {}
        self.workers = {}
        self.queued = []

    def trim(self) -> None:
        """Bound the cache, between transactions only: inside one, a call's tail may be
        ahead of its row until the row is written, so no entry may be dropped there."""
        if len(self.tails) >= self.size:
            self.tails = {}

    def tail(self, call_id: str) -> int | None:
        """The seq of the call's last event (None: it has none yet)."""
        if call_id not in self.tails:
            row = self.conn.execute(_LAST_SEQ, (sqliteevents.call_key(call_id),)).fetchone()
            self.tails[call_id] = None if row is None else row[0]
        return self.tails[call_id]

    def worker_id(self, name: str) -> int:
        """The worker's id, given one the first time the name is written."""
        found = self.known_worker(name)
        if found is None:
            row = self.conn.execute(_NEW_WORKER_ID, (name,)).fetchone()
            found = self.workers[name] = int(row[0])
        return found

    def known_worker(self, name: str) -> int | None:
        """The worker's id (None: its name was never written)."""
        found = self.workers.get(name)
        if found is None:
            row = self.conn.execute(_WORKER_ID, (name,)).fetchone()
            if row is None:
                return None
            found = self.workers[name] = int(row[0])
        return found

    def add(self, event: StoredEvent) -> None:
        """Queue ``event`` (in the row before it, where it joins that row's run); its
        call's last event is now this one."""
        if self.queued and sqliterecords.joins(self.queued[-1][0], event):
            self.queued[-1][0].append(event)
        else:
            call_prev = None
            # A manifest opens its call (admission writes one only for a call id it has
            # just made): there is no earlier event to look up, and no row to read.
            if event.call_id is not None and event.kind != "call.manifest":
                call_prev = self.tail(event.call_id)
            self.queued.append(([event], call_prev))
        if event.call_id is not None:
            self.tails[event.call_id] = event.seq

    def take(self) -> list[tuple[Any, ...]]:
        """The queued rows' parameters (``sqliteevents.INSERT_COLUMNS``); none queued after."""
        rows = [
            sqliterecords.record_params(run, call_prev, self.worker_id(run[0].worker))
            for run, call_prev in self.queued
        ]
        self.queued = []
        return rows


#: Events whose link is not the previous event of their call. Where an archive deleted
#: that event, the first live event of the call links below the first live seq.
BROKEN_LINKS = """
    SELECT seq, call_prev, want FROM (
        SELECT seq, call_id, call_prev, CASE WHEN call_id IS NOT NULL
            THEN lag(seq) OVER (PARTITION BY call_id ORDER BY seq) END AS want
        FROM events)
    WHERE call_prev IS NOT want AND NOT (
        call_id IS NOT NULL AND want IS NULL
        AND call_prev < (SELECT min(seq) FROM events))
    ORDER BY seq
"""
#: Calls whose row does not name their last event (both tables key a call alike: the
#: 16 bytes of a ``call_`` id, see sqliteevents.call_key). One grouped scan of the events,
#: then a lookup of each call's row by its key (a join the other way round took 72 s
#: on 300,000 events). A row of a call with no events is named by the verifier.
BROKEN_TAILS = """
    WITH m AS MATERIALIZED (
        SELECT call_id AS key, max(seq) AS last
        FROM events WHERE call_id IS NOT NULL GROUP BY call_id)
    SELECT m.key, c.last_seq, m.last FROM m LEFT JOIN calls c ON c.call_id = m.key
    WHERE c.last_seq IS NOT m.last
    ORDER BY m.key
"""
#: Unresolved calls whose row keeps no state (sqlitecalls.keeps_state): the sweeper, the
#: retry lookup and the metrics read it from the row.
UNRESOLVED_WITHOUT_STATE = (
    f"SELECT call_id, stage, last_seq FROM calls WHERE {UNRESOLVED_SQL} AND state IS NULL"
)


def problems(
    links: Sequence[Any], tails: Sequence[Any], stateless: Sequence[Any], head: int
) -> list[tuple[int, str]]:
    """``(seq, problem)`` for each row of :data:`BROKEN_LINKS`, :data:`BROKEN_TAILS` and
    :data:`UNRESOLVED_WITHOUT_STATE` (``head``: the last event's seq, named where a call
    row points nowhere)."""
    found = [
        (
            int(seq),
            f"event {seq}: links to {prev} as its call's previous event "
            f"(the events say {want}); its call's events would be read wrongly",
        )
        for seq, prev, want in links
    ]
    found += [
        (
            head if want is None else int(want),
            f"call {sqliteevents.call_from_key(key)}: its row names event {got} as its last "
            f"(the events say {want}); its events would be read wrongly",
        )
        for key, got, want in tails
    ]
    found += [
        (
            head if last is None else int(last),
            f"call {sqliteevents.call_from_key(key)}: {stage}, yet its row keeps no state "
            "(the sweeper, the retry lookup and the metrics read it from the row)",
        )
        for key, stage, last in stateless
    ]
    return found
