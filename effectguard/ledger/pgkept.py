"""What the PostgreSQL writer keeps between batches, and how each batch brings it up to date.

Round trips are the PostgreSQL writer's cost: at 64 callers a batch spent 32 of its 36
round trips reading back the call states its own previous batch had written, and at one
caller three of five went to the worker, budget and policy rows it had read the batch
before. So the writer keeps those rows from batch to batch (the SQLite writer does the
same while ``PRAGMA data_version`` says nobody else committed). Other replicas commit
between our batches, though, so what is kept is brought up to date in the round trip
that takes the batch lock (:meth:`Kept.send_refresh`), after the lock is held, where no
other writer can change it until our ``COMMIT``:

* **worker, budget-period and rate-window rows are read again**, every batch. They
  decide fencing, leases, budgets and rate limits, and a lease renewal changes a worker
  row without an event, so they are never trusted across batches: re-reading them in
  the lock's round trip costs no round trip of its own.
* **call states and policies are kept until an event names them.** A call's row only
  changes together with an event carrying its call id (the row is the fold of its
  events, :func:`effectguard.ledger.operations.append`), and a policy only with a
  ``budget.limit_set`` event, which names no call. So the call ids of the events other
  replicas appended since our last commit say which kept calls are stale; an event
  naming no call (a limit set, a worker registered or taken over, an archive cut, a
  key change) drops every kept call and policy. A chain that moved by more than
  :data:`EVENTS_SCANNED` events, or went backwards, drops everything.

Whatever the outcome of a batch other than a ``COMMIT`` that succeeded, everything
kept is dropped (:meth:`Kept.forget`). Inside a batch, each operation's writes to the
kept rows are journaled so a failed operation's are undone alone (:meth:`Kept.undo`).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from effectguard.ledger.base import WorkerRow
from effectguard.ledger.pgschema import CLOCK_FUNCTION
from effectguard.ledger.queries import POSTGRES
from effectguard.ledger.rows import (
    NODE_COLUMNS,
    WINDOW_COLUMNS,
    WORKER_COLUMNS,
    node_from_row,
    window_from_row,
    worker_from_row,
)
from effectguard.rules.budget import BudgetNode, BudgetPolicy, Key
from effectguard.rules.ratelimit import RateWindow
from effectguard.rules.workstate import WorkState

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

#: Foreign events a batch looks through for the calls they name; beyond it, start over.
EVENTS_SCANNED = 4096
#: Call states kept (far more than are ever in flight on one replica).
CALLS_KEPT = 4096
#: Worker, node, policy and window rows kept (each read again per batch, so keep few).
ROWS_KEPT = 1024

#: Reads that come with the clock and the chain head, as columns of one statement (a
#: statement of its own each would cost the server and psycopg about 30 µs apiece).
CALLS_SINCE = (
    "(SELECT array_agg(DISTINCT call_id) FROM "
    f"(SELECT call_id FROM events WHERE seq > %s ORDER BY seq LIMIT {EVENTS_SCANNED}) e)"
)
WORKERS_JSON = (
    f"(SELECT json_agg(json_build_array({WORKER_COLUMNS})) FROM workers WHERE worker = ANY(%s))"
)
NODES_JSON = (
    f"(SELECT json_agg(json_build_array({NODE_COLUMNS})) FROM budget_periods "
    "WHERE (path, period) IN (SELECT * FROM unnest(%s::text[], %s::text[])))"
)
WINDOWS_JSON = (
    f"(SELECT json_agg(json_build_array({WINDOW_COLUMNS})) FROM rate_windows WHERE path = ANY(%s))"
)
#: The batch's first read: the clock, the chain head, then the refresh columns.
_BEGIN_READ = (
    f"SELECT {CLOCK_FUNCTION}(), e.seq, e.digest{{}} FROM (SELECT 1) one LEFT JOIN LATERAL "
    "(SELECT seq, digest FROM events ORDER BY seq DESC LIMIT 1) e ON true"
)
#: One statement text for any number of keys (a prepared statement, unlike ``IN (VALUES …)``).
NODES = f"{POSTGRES.nodes} WHERE (path, period) IN (SELECT * FROM unnest(%s::text[], %s::text[]))"
WINDOWS = f"{POSTGRES.windows} WHERE path = ANY(%s)"
POLICIES = f"{POSTGRES.policies} WHERE path = ANY(%s)"

_ABSENT = object()


def node_keys(keys: list[Key]) -> tuple[list[str], list[str]]:
    """Parameters of :data:`NODES` for ``keys``."""
    return [k[0] for k in keys], [k[1] for k in keys]


@dataclass
class Refresh:
    """What the batch's first read asks about the kept rows (None: not asked)."""

    calls: bool = False
    workers: list[str] | None = None
    nodes: list[Key] | None = None
    windows: list[str] | None = None

    def statement(self, since: int | None) -> tuple[str, list[Any]]:
        """The first read's SQL and parameters: clock, head, then what is asked."""
        columns: list[str] = [""]
        params: list[Any] = []
        if self.calls:
            columns.append(CALLS_SINCE)
            params.append(since)
        if self.workers is not None:
            columns.append(WORKERS_JSON)
            params.append(self.workers)
        if self.nodes is not None:
            columns.append(NODES_JSON)
            params += node_keys(self.nodes)
        if self.windows is not None:
            columns.append(WINDOWS_JSON)
            params.append(self.windows)
        return _BEGIN_READ.format(", ".join(columns)), params


@dataclass
class Kept:
    """Rows the writer read or wrote, kept while they are known to be current."""

    calls: dict[str, WorkState | None] = field(default_factory=dict)
    nodes: dict[Key, BudgetNode | None] = field(default_factory=dict)
    policies: dict[str, BudgetPolicy | None] = field(default_factory=dict)
    windows: dict[str, RateWindow | None] = field(default_factory=dict)
    workers: dict[str, WorkerRow | None] = field(default_factory=dict)
    #: The chain head the kept rows are current at (with this batch's writes on top);
    #: None: nothing is kept.
    head: tuple[int, str] | None = None
    _journal: list[tuple[dict[Any, Any], Any, Any]] | None = None

    def forget(self) -> None:
        """Drop everything (after a batch that did not commit, or a new connection)."""
        for table in (self.calls, self.nodes, self.policies, self.windows, self.workers):
            table.clear()
        self.head = None
        self._journal = None

    # -- inside a batch
    def put(self, table: dict[K, V], key: K, value: V) -> None:
        """Keep ``value`` under ``key``, undoably while an operation runs."""
        if self._journal is not None:
            self._journal.append((table, key, table.get(key, _ABSENT)))
        table[key] = value

    def mark(self) -> None:
        """An operation starts: journal its writes."""
        self._journal = []

    def keep_marked(self) -> None:
        """The operation's writes stay."""
        self._journal = None

    def undo(self) -> None:
        """Undo the operation's writes to the kept rows (what it read stays: still true)."""
        for table, key, previous in reversed(self._journal or []):
            if previous is _ABSENT:
                table.pop(key, None)
            else:
                table[key] = previous
        self._journal = None

    # -- between batches
    def refresh(self) -> Refresh:
        """What the batch's first read must ask to bring the kept rows up to date."""
        if self.head is None:
            self.forget()
            return Refresh()
        if len(self.calls) > CALLS_KEPT:
            self.calls.clear()
        for rows in (self.nodes, self.policies, self.windows, self.workers):
            if len(rows) > ROWS_KEPT:
                rows.clear()
        return Refresh(
            calls=bool(self.calls or self.policies),
            workers=list(self.workers) or None,
            nodes=list(self.nodes) or None,
            windows=list(self.windows) or None,
        )

    def first_read(self) -> tuple[str, list[Any], Refresh]:
        """The batch's first read (after the lock): its SQL, parameters and what it asks."""
        refresh = self.refresh()
        sql, params = refresh.statement(None if self.head is None else self.head[0])
        return sql, params, refresh

    def refreshed(self, head: tuple[int, str], refresh: Refresh, answers: list[Any]) -> None:
        """Apply the first read's ``answers`` (its columns after the head), the chain head
        being ``head`` now."""
        since, self.head = self.head, head
        if since is None:
            return
        moved = head[0] - since[0]
        if moved < 0 or moved > EVENTS_SCANNED or (moved == 0 and head[1] != since[1]):
            self.forget()  # the chain went back, was rewritten, or moved too far to list
            self.head = head
            return
        found = iter(answers)
        if refresh.calls:
            named = next(found) or []
            if moved and None in named:  # an event about no call: limit, worker, archive cut
                self.calls.clear()
                self.policies.clear()
            for call_id in named if moved else ():
                self.calls.pop(call_id, None)
        if refresh.workers is not None:
            rows = next(found) or []
            _replace(self.workers, refresh.workers, {r[0]: worker_from_row(r) for r in rows})
        if refresh.nodes is not None:
            rows = next(found) or []
            _replace(self.nodes, refresh.nodes, {(r[0], r[1]): node_from_row(r) for r in rows})
        if refresh.windows is not None:
            rows = next(found) or []
            _replace(self.windows, refresh.windows, {r[0]: window_from_row(r) for r in rows})


def _replace(table: dict[K, V | None], keys: list[K], found: dict[K, V]) -> None:
    for key in keys:
        table[key] = found.get(key)
