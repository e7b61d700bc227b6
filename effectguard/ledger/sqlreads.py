"""The read half of a SQL store: the same queries and row codecs on every engine.

:class:`SqlReads` answers the :class:`~effectguard.ledger.base.LedgerStore`
reads from :mod:`effectguard.ledger.queries`; a store supplies its dialect's
:class:`~effectguard.ledger.queries.Queries` and one ``_fetch`` that runs a
query on its read connection (translating driver errors at that boundary).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence
from typing import Any, BinaryIO

from effectguard.errors import BodyMismatch, LedgerCorrupt
from effectguard.ledger import bodystore
from effectguard.ledger.base import CallSpend, DaySpend, SpendSums, WorkerRow
from effectguard.ledger.queries import Queries
from effectguard.ledger.rows import (
    event_from_row,
    key_from_row,
    limit_param,
    node_from_row,
    policy_from_row,
    spend_from_row,
    state_from_first,
    window_from_row,
    worker_from_row,
)
from effectguard.rules.budget import BudgetNode, BudgetPolicy
from effectguard.rules.budgetview import Policyless
from effectguard.rules.events import StoredEvent
from effectguard.rules.keys import KINDS as KEY_KINDS
from effectguard.rules.keys import LedgerKey
from effectguard.rules.ratelimit import RateWindow
from effectguard.rules.workstate import Stage, WorkState


def _one_event(row: Any) -> list[StoredEvent]:
    """A row of format 1 (PostgreSQL's events): one event."""
    return [event_from_row(row)]


#: Paths named in one statement: well under SQLite's and PostgreSQL's parameter limits.
_PATHS_A_READ = 500


class SqlReads(ABC):
    """Operator, metrics and verify reads over a SQL read connection."""

    queries: Queries
    #: Reads one event row in the store's layout (``queries``' event columns): its events
    #: (SQLite: a row may hold an operation's run of events, ``sqliterecords``).
    decode_events: Callable[[Any], list[StoredEvent]] = staticmethod(_one_event)
    #: Reads one call state from a row of ``queries.state``; None where the row keeps
    #: none (SQLite: a resolved call's, folded from its events by :meth:`_fold`; such a
    #: store's ``queries.state`` selects the call's key first).
    decode_state: Callable[[Any], WorkState | None] = staticmethod(state_from_first)
    #: Reads a row of ``queries.call_columns`` (its values as rows.INDEX_COLUMNS has them).
    decode_index: Callable[[Any], tuple[Any, ...]] = staticmethod(tuple)
    #: A call id as the store's events hold it (SQLite: 16 bytes; PostgreSQL: the text).
    call_key: Callable[[str], Any] = staticmethod(str)
    #: Invert ``call_key``.
    call_from_key: Callable[[Any], str | None] = staticmethod(str)

    @abstractmethod
    async def _fetch(self, sql: str, params: Sequence[Any] = ()) -> Sequence[Sequence[Any]]:
        """Every row ``sql`` answers (``LedgerUnavailable`` if the read fails)."""

    async def get_call(self, call_id: str) -> WorkState | None:
        """A call's projected state, or None."""
        rows = await self._fetch(self.queries.call, (self.call_key(call_id),))
        return (await self._states(rows))[0] if rows else None

    async def _states(self, rows: Sequence[Any]) -> list[WorkState]:
        """The states of rows of ``queries.state``: kept, or folded from the events."""
        states = [self.decode_state(r) for r in rows]
        missing = [r[0] for r, s in zip(rows, states, strict=True) if s is None]
        if not missing:
            return [s for s in states if s is not None]
        folded = await self._fold(missing)
        return [folded[r[0]] if s is None else s for r, s in zip(rows, states, strict=True)]

    async def _fold(self, keys: Sequence[Any]) -> dict[Any, WorkState]:
        """The states of the calls with these keys (their rows keep none), from their
        events. A store whose rows always keep their state never needs this."""
        raise LedgerCorrupt(f"calls {list(keys)[:3]}: their rows keep no state")

    async def kept_states(self, after: str | None, limit: int) -> list[WorkState]:
        """A page of the states the store keeps in its calls' rows (``verify`` compares
        each with the events; here, every call's)."""
        rows = await self._fetch(self.queries.states_after, (self._key_after(after), limit))
        return await self._states(rows)

    def _key_after(self, after: str | None) -> Any:
        """``after`` as the calls' key column compares it; None: below every key (the
        empty text: every stored key is a non-empty text, or SQLite's bytes, above all text)."""
        return "" if after is None else self.call_key(after)

    async def call_events(self, call_id: str) -> list[StoredEvent]:
        """A call's events in ledger order."""
        rows = await self._fetch(self.queries.call_events, (self.call_key(call_id),))
        return [e for r in rows for e in self.decode_events(r)]

    async def lookup_problems(self) -> list[tuple[int, str]]:
        """``(seq, problem)`` for each way the store's own lookup structures disagree
        with its events (none here: the calls are found by their call id column)."""
        return []

    async def list_calls(
        self,
        stage: Stage | None = None,
        budget: str | None = None,
        limit: int = 1000,
        *,
        provider: str | None = None,
        since: float | None = None,
        oldest_first: bool = False,
    ) -> list[WorkState]:
        """Calls (newest first; ``oldest_first``: oldest first), optionally by stage,
        budget subtree, provider and creation time."""
        sql, params = self.queries.list_calls(
            stage, budget, limit, provider=provider, since=since, oldest_first=oldest_first
        )
        return await self._states(await self._fetch(sql, params))

    async def unknown_after(self, after: tuple[float, str] | None, limit: int) -> list[WorkState]:
        """Up to ``limit`` effect-unknown calls after the cursor, oldest first."""
        at, call_id = after if after is not None else (-1.0, "")
        key = self.call_key(call_id) if call_id else ""
        params = (at, at, key, limit_param(limit))
        return await self._states(await self._fetch(self.queries.unknown_after, params))

    async def in_flight_except(self, workers: Sequence[str], limit: int) -> list[WorkState]:
        """Up to ``limit`` calls in flight of workers not in ``workers``, in one query."""
        sql = self.queries.in_flight_except(len(workers))
        return await self._states(await self._fetch(sql, (*workers, limit_param(limit))))

    async def call_spend(self, since: float, limit: int) -> list[CallSpend]:
        """The spend of up to ``limit`` calls created at or after ``since``, newest first,
        read from the calls' rows (no state decoded, no events folded)."""
        rows = await self._fetch(self.queries.call_spend, (since, limit_param(limit)))
        return [spend_from_row(r) for r in rows]

    async def spend_sums(self, since: float, limit: int) -> SpendSums:
        """The window's money summed by the database: one row per day, provider and model."""
        rows = await self._fetch(self.queries.spend_sums, (since, limit_param(limit)))
        days = sorted(
            (DaySpend(int(d), p, m, int(s), int(h), int(c)) for d, p, m, s, h, c, _, _ in rows),
            key=lambda g: (g.day, g.provider, g.model or ""),
        )
        count = sum(int(r[6]) for r in rows)
        oldest = min((float(r[7]) for r in rows), default=None)
        return SpendSums(tuple(days), count, oldest)

    async def budget_nodes(
        self,
        depth: int | None = None,
        periods: Collection[str] | None = None,
        under: str | None = None,
        *,
        policied: bool = False,
    ) -> list[BudgetNode]:
        """Stored ``(path, period)`` counter rows (``limit`` left None), as
        ``LedgerStore.budget_nodes`` says."""
        labels = None if periods is None else sorted(periods)
        sql = self.queries.budget_nodes(
            depth is not None, None if labels is None else len(labels), under is not None, policied
        )
        params: list[Any] = [] if depth is None else [depth]
        params += labels or []
        params += [] if under is None else self.queries.subtree(under)
        return [node_from_row(r) for r in await self._fetch(sql, params)]

    async def policyless(self, depth: int, limit: int) -> Policyless:
        """The first nodes without a policy, and all of them summed
        (``LedgerStore.policyless``)."""
        top = await self._fetch(self.queries.policyless_top, (depth, limit))
        ((count, reserved, spent, held),) = await self._fetch(self.queries.policyless_sum, (depth,))
        total = BudgetNode("", reserved=int(reserved), spent=int(spent), held=int(held))
        return Policyless(tuple(node_from_row(r) for r in top), int(count), total)

    async def policyless_page(
        self, depth: int, under: str | None, limit: int
    ) -> tuple[list[BudgetNode], int]:
        """The first nodes without a policy in the tree's order, and how many there are
        (``LedgerStore.policyless_page``)."""
        page, count = self.queries.policyless_page(under is not None)
        params = [depth, *([] if under is None else self.queries.subtree(under))]
        rows = await self._fetch(page, [*params, limit])
        ((total,),) = await self._fetch(count, params)
        return [node_from_row(r) for r in rows], int(total)

    async def budget_rows(self, paths: Collection[str]) -> list[BudgetNode]:
        """Every stored counter row of ``paths`` (``LedgerStore.budget_rows``)."""
        wanted = sorted(set(paths))
        out: list[BudgetNode] = []
        for i in range(0, len(wanted), _PATHS_A_READ):
            chunk = wanted[i : i + _PATHS_A_READ]
            rows = await self._fetch(self.queries.budget_rows(len(chunk)), chunk)
            out += [node_from_row(r) for r in rows]
        return out

    async def budget_policies(self) -> list[BudgetPolicy]:
        """Every declared budget policy."""
        return [policy_from_row(r) for r in await self._fetch(self.queries.all_policies)]

    async def events_after(self, seq: int, limit: int) -> list[StoredEvent]:
        """Up to ``limit`` events with sequence number greater than ``seq``."""
        # ``limit`` rows hold at least ``limit`` events; the first may begin at or before
        # ``seq`` (a record that ends after it).
        rows = await self._fetch(self.queries.events_after, (seq, limit))
        found: list[StoredEvent] = []
        for row in rows:
            # Decoded only as far as the page goes: the rows past it are read again by
            # the next page (decoding all of them read every event about three times).
            found += [e for e in self.decode_events(row) if e.seq > seq]
            if len(found) >= limit:
                break
        return found[:limit]

    async def workers(self) -> list[WorkerRow]:
        """Every registered worker."""
        return [worker_from_row(r) for r in await self._fetch(self.queries.all_workers)]

    async def live_workers(self) -> list[WorkerRow]:
        """The workers not fenced (the index ``workers_live``)."""
        return [worker_from_row(r) for r in await self._fetch(self.queries.live_workers)]

    async def stage_counts(self) -> list[tuple[str, str, int, int, float]]:
        """``(provider, stage, count, held, oldest)`` for unresolved stages, for metrics
        and the operator page."""
        rows = await self._fetch(self.queries.stage_counts)
        return [(r[0], r[1], int(r[2]), int(r[3]), float(r[4])) for r in rows]

    async def call_columns(self, after: str | None, limit: int) -> list[tuple[Any, ...]]:
        """A page of calls' indexed columns (rows.INDEX_COLUMNS), then their spend
        (rows.SPEND_COLUMNS)."""
        rows = await self._fetch(self.queries.call_columns, (self._key_after(after), limit))
        return [self.decode_index(r) for r in rows]

    async def keys(self) -> list[LedgerKey]:
        """Every proxy key row (revoked and expired ones too), by name."""
        return [key_from_row(r) for r in await self._fetch(self.queries.all_keys)]

    async def key_events_since(self, seq: int) -> list[StoredEvent]:
        """The key events after ``seq``, in ledger order."""
        rows = await self._fetch(self.queries.key_events, (seq,))
        return [e for r in rows for e in self.decode_events(r) if e.kind in KEY_KINDS]

    async def key_events_high(self) -> int:
        """The seq of the last key event (0: none)."""
        ((high,),) = await self._fetch(self.queries.key_events_high)
        return int(high)

    async def archived_through(self) -> int:
        """The last event an archive moved out of the live ledger (0: none)."""
        ((through,),) = await self._fetch(self.queries.archived_through)
        return int(through)

    async def session_ended(self, token_sha256: str) -> bool:
        """Whether the operator-page session with this token digest was ended by a logout."""
        return bool(await self._fetch(self.queries.session_ended, (token_sha256,)))

    async def limit_events(self) -> list[StoredEvent]:
        """Every ``budget.limit_set`` event, in ledger order (who set which limit)."""
        rows = await self._fetch(self.queries.limit_events)
        return [e for r in rows for e in self.decode_events(r)]

    async def checkpoint_events(self) -> list[StoredEvent]:
        """Every ``ledger.archived`` event (an archive's checkpoint), in ledger order."""
        rows = await self._fetch(self.queries.checkpoint_events)
        return [e for r in rows for e in self.decode_events(r)]

    async def copy_body(self, call_id: str, out: BinaryIO) -> int:
        """Write ``call_id``'s by-reference body to ``out``, one chunk (one read) at a time."""
        key = self.call_key(call_id)
        seqs = [int(r[0]) for r in await self._fetch(self.queries.body.seqs, (key,))]
        bodystore.contiguous(call_id, seqs)
        written = 0
        for seq in seqs:
            rows = await self._fetch(self.queries.body.chunk, (key, seq))
            if not rows:  # deleted since its seqs were read: an archive took the call
                raise BodyMismatch(f"call {call_id}: its body was archived", call_id=call_id)
            chunk = bytes(rows[0][0])
            out.write(chunk)
            written += len(chunk)
        return written

    async def body_size(self, call_id: str) -> int | None:
        """The bytes of ``call_id``'s stored body (None: none is stored)."""
        rows = await self._fetch(self.queries.body.size, (self.call_key(call_id),))
        return None if not rows or rows[0][0] is None else int(rows[0][0])

    async def body_chunks(self) -> list[tuple[str, int, int]]:
        """``(call_id, seq, bytes)`` of every stored body chunk, by call and seq."""
        rows = await self._fetch(self.queries.body.index)
        return [(str(self.call_from_key(r[0])), int(r[1]), int(r[2])) for r in rows]

    async def rate_windows(self) -> list[RateWindow]:
        """Every stored rate window (one per node that has counted a minute)."""
        return [window_from_row(r) for r in await self._fetch(self.queries.windows)]
