"""The SQLite store's reads: :class:`~.sqlreads.SqlReads` over its own row layouts.

Its event rows may hold an operation's run of events (:mod:`.sqliterecords`), a call's
events are found by walking links from its row (:mod:`.sqlitelinks`), and a resolved
call's row keeps no state: it is folded from the call's events when read
(:mod:`.sqlitecalls`), a page of calls with one walk of their events.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from effectguard.ledger import sqlitecalls, sqliteevents, sqlitelinks
from effectguard.ledger.queries import SQLITE
from effectguard.ledger.sqliterecords import events_from_row, kinds_and_data
from effectguard.ledger.sqlparts import HEAD
from effectguard.ledger.sqlreads import SqlReads
from effectguard.rules.events import StoredEvent
from effectguard.rules.workstate import WorkState

#: Calls folded per statement (SQLite binds at most 32,766 parameters).
_FOLD_PAGE = 500


class SqliteReads(SqlReads):
    """The reads of a SQLite ledger (its store supplies ``_fetch``)."""

    queries = SQLITE
    decode_events = staticmethod(events_from_row)
    call_key = staticmethod(sqliteevents.call_key)
    call_from_key = staticmethod(sqliteevents.call_from_key)
    decode_state = staticmethod(sqlitecalls.state_from_row)
    decode_index = staticmethod(sqlitecalls.index_columns)

    async def call_events(self, call_id: str) -> list[StoredEvent]:
        """A call's events in ledger order, walked from its row (no index by call)."""
        params = (sqliteevents.call_key(call_id),) * 2
        rows = await self._fetch(sqliteevents.CALL_EVENTS, params)
        return [e for r in rows for e in events_from_row(r)]

    async def _fold(self, keys: Sequence[Any]) -> dict[Any, WorkState]:
        events: dict[Any, list[tuple[str, dict[str, Any]]]] = {key: [] for key in keys}
        for at in range(0, len(keys), _FOLD_PAGE):
            page = keys[at : at + _FOLD_PAGE]
            for row in await self._fetch(sqliteevents.calls_events(len(page)), page):
                events[row[2]] += kinds_and_data(row)  # no digest: a fold needs none
        return {key: sqlitecalls.fold_data(found) for key, found in events.items()}

    async def kept_states(self, after: str | None, limit: int) -> list[WorkState]:
        """The states rows keep: unresolved calls', and any stored before migration 14."""
        rows = await self._fetch(sqlitecalls.KEPT_READ, (self._key_after(after), limit))
        return [s for s in map(sqlitecalls.state_from_row, rows) if s is not None]

    async def lookup_problems(self) -> list[tuple[int, str]]:
        links = await self._fetch(sqlitelinks.BROKEN_LINKS)
        tails = await self._fetch(sqlitelinks.BROKEN_TAILS)
        stateless = await self._fetch(sqlitelinks.UNRESOLVED_WITHOUT_STATE)
        head = await self._fetch(HEAD)
        return sqlitelinks.problems(links, tails, stateless, int(head[0][0]) if head else 0)
