"""The pieces of SQL the statements and the migrations are built from.

Stage lists in SQL come from :mod:`effectguard.rules.workstate`, never typed
out here: :data:`UNRESOLVED_SQL` is built from ``workstate.UNRESOLVED``. The
migrations keep their own text (a migration is history; a test checks it
matches :data:`UNRESOLVED_SQL`, so the partial index keeps serving the query).
Also here: the chain head, the generation counter, the shape of an insert of many
rows (:class:`Upsert`), the body store's statements and the lists of key kinds the
partial index ``events_keys`` names.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from effectguard.ledger import sqliteevents
from effectguard.ledger.rows import names
from effectguard.rules.workstate import STAGES, UNRESOLVED, Stage


def stage_list(stages: Iterable[Stage]) -> str:
    """``'a', 'b'``: quoted stage names in :data:`~workstate.STAGES` order.

    The order is fixed (not a set's) so the text is the same in every process:
    SQLite uses a partial index only for a query whose terms match its own.
    """
    chosen = set(stages)
    unknown = chosen.difference(STAGES)
    if unknown:
        raise ValueError(f"not stages: {sorted(unknown)}")
    return ", ".join(f"'{stage}'" for stage in STAGES if stage in chosen)


#: Calls that may still have (or be having) an effect: in flight or effect unknown.
UNRESOLVED_SQL = f"stage IN ({stage_list(UNRESOLVED)})"
#: SQLite's migration 21 and PostgreSQL's 14: the calls decided not applied, by request
#: hash, that a key-less declared retry is matched against (ledger/retries). Only such
#: calls enter it: no commit of the hot path writes a page of it.
NOT_APPLIED_INDEX = (
    "CREATE INDEX calls_not_applied ON calls(budget_root, request_hash, created_at) "
    "WHERE stage = 'reconciled_not_applied'"
)
IN_FLIGHT_SQL = f"stage = {stage_list(['in_flight'])}"
#: The chain head: the last event's number and digest.
HEAD = "SELECT seq, digest FROM events ORDER BY seq DESC LIMIT 1"
NEXT_GENERATION = "UPDATE meta SET value = value + 1 WHERE key = 'generation' RETURNING value"


@dataclass(frozen=True, slots=True)
class Upsert:
    """An ``INSERT … VALUES … [ON CONFLICT …]`` statement, for any number of rows."""

    head: str
    width: int
    tail: str
    mark: str

    def rows(self, count: int) -> str:
        """The statement with placeholders for ``count`` rows."""
        one = "(" + ",".join([self.mark] * self.width) + ")"
        return self.head + ",".join([one] * count) + self.tail


def upsert(
    table: str, columns: str, mark: str, mutable: Iterable[str] | None, key: int = 1
) -> Upsert:
    """An insert into ``table`` that, given ``mutable`` columns, updates them on conflict
    with its first ``key`` columns."""
    cols = names(columns)
    tail = ""
    if mutable is not None:
        sets = ", ".join(f"{c} = excluded.{c}" for c in mutable)
        tail = f" ON CONFLICT({', '.join(cols[:key])}) DO UPDATE SET {sets}"
    return Upsert(f"INSERT INTO {table}({columns}) VALUES ", len(cols), tail, mark)


@dataclass(frozen=True, slots=True)
class BodyQueries:
    """The body store's statements (ledger/bodystore): one chunk at a time, never a
    body whole."""

    seqs: str
    chunk: str
    index: str
    size: str
    insert: str

    @classmethod
    def for_mark(cls, m: str) -> BodyQueries:
        """The statements with placeholder ``m``."""
        return cls(
            seqs=f"SELECT seq FROM call_bodies WHERE call_id = {m} ORDER BY seq",
            chunk=f"SELECT chunk FROM call_bodies WHERE call_id = {m} AND seq = {m}",
            index="SELECT call_id, seq, length(chunk) FROM call_bodies ORDER BY call_id, seq",
            size=f"SELECT sum(length(chunk)) FROM call_bodies WHERE call_id = {m}",
            insert=f"INSERT INTO call_bodies(call_id, seq, chunk) VALUES ({m}, {m}, {m})",
        )


#: The kinds of key events as a SQL list, as PostgreSQL stores them (text).
KEY_KINDS_TEXT: Final = "'key.created', 'key.revoked'"
#: As SQLite stores them: their code. Rows a release before storage format 4 wrote hold
#: the kind's text, but all of them come before any row holding a code, and a replica
#: reads key events only after its first read of every key row. Two codes, not four
#: values: a partial index's condition is evaluated at every insert, and SQLite builds a
#: table for a longer IN list each time (0.4 s more per 200,000 inserts, measured).
KEY_KINDS_SQLITE: Final = (
    f"{sqliteevents.KIND_CODES['key.created']}, {sqliteevents.KIND_CODES['key.revoked']}"
)
