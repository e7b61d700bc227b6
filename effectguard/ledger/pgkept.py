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

import psycopg

from effectguard.ledger.base import WorkerRow
from effectguard.ledger.queries import POSTGRES
from effectguard.ledger.rows import node_from_row, window_from_row, worker_from_row
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

CALLS_SINCE = (
    "SELECT DISTINCT call_id FROM "
    f"(SELECT call_id FROM events WHERE seq > %s ORDER BY seq LIMIT {EVENTS_SCANNED}) e"
)
WORKERS = f"{POSTGRES.all_workers} WHERE worker = ANY(%s)"
#: One statement text for any number of keys (a prepared statement, unlike ``IN (VALUES …)``).
NODES = f"{POSTGRES.nodes} WHERE (path, period) IN (SELECT * FROM unnest(%s::text[], %s::text[]))"
WINDOWS = f"{POSTGRES.windows} WHERE path = ANY(%s)"
POLICIES = f"{POSTGRES.policies} WHERE path = ANY(%s)"

_ABSENT = object()


def node_keys(keys: list[Key]) -> tuple[list[str], list[str]]:
    """Parameters of :data:`NODES` for ``keys``."""
    return [k[0] for k in keys], [k[1] for k in keys]


@dataclass
class _Refresh:
    """The statements a batch's first round trip carries for the kept rows."""

    calls: psycopg.Cursor[Any] | None = None
    workers: tuple[list[str], psycopg.Cursor[Any]] | None = None
    nodes: tuple[list[Key], psycopg.Cursor[Any]] | None = None
    windows: tuple[list[str], psycopg.Cursor[Any]] | None = None


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
    def send_refresh(self, conn: psycopg.Connection[Any]) -> _Refresh:
        """Queue (in the caller's pipeline, after the lock) the reads that bring us up to date."""
        if self.head is None:
            self.forget()
            return _Refresh()
        if len(self.calls) > CALLS_KEPT:
            self.calls.clear()
        for rows in (self.nodes, self.policies, self.windows, self.workers):
            if len(rows) > ROWS_KEPT:
                rows.clear()
        refresh = _Refresh()
        if self.calls or self.policies:
            refresh.calls = conn.execute(CALLS_SINCE, (self.head[0],))
        if self.workers:
            names = list(self.workers)
            refresh.workers = (names, conn.execute(WORKERS, (names,)))
        if self.nodes:
            keys = list(self.nodes)
            refresh.nodes = (keys, conn.execute(NODES, node_keys(keys)))
        if self.windows:
            paths = list(self.windows)
            refresh.windows = (paths, conn.execute(WINDOWS, (paths,)))
        return refresh

    def refreshed(self, head: tuple[int, str], refresh: _Refresh) -> None:
        """Apply what :meth:`send_refresh` read, the chain head being ``head`` now."""
        since, self.head = self.head, head
        if since is None:
            return
        moved = head[0] - since[0]
        if moved < 0 or moved > EVENTS_SCANNED or (moved == 0 and head[1] != since[1]):
            self.forget()  # the chain went back, was rewritten, or moved too far to list
            self.head = head
            return
        if moved and refresh.calls is not None:
            named = {row[0] for row in refresh.calls.fetchall()}
            if None in named:  # an event about no call: a limit, a worker, an archive cut
                self.calls.clear()
                self.policies.clear()
            for call_id in named:
                self.calls.pop(call_id, None)
        if refresh.workers is not None:
            names, cursor = refresh.workers
            _replace(self.workers, names, {r[0]: worker_from_row(r) for r in cursor.fetchall()})
        if refresh.nodes is not None:
            keys, cursor = refresh.nodes
            found = {(r[0], r[1]): node_from_row(r) for r in cursor.fetchall()}
            _replace(self.nodes, keys, found)
        if refresh.windows is not None:
            paths, cursor = refresh.windows
            _replace(self.windows, paths, {r[0]: window_from_row(r) for r in cursor.fetchall()})


def _replace(table: dict[K, V | None], keys: list[K], found: dict[K, V]) -> None:
    for key in keys:
        table[key] = found.get(key)
