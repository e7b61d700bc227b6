"""The SQLite writer's session: table access and transaction control on its connection.

One :class:`SqliteSession` lives on the writer (:mod:`effectguard.ledger.sqlite`), runs
each batch as one ``BEGIN IMMEDIATE`` transaction, keeps the chain head, budget, policy,
worker and call rows it read for as long as no other connection commits, and folds the
WAL into the database between batches.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Sequence
from typing import Any

from effectguard.errors import LedgerUnavailable
from effectguard.ledger import bodystore, sqlitecalls, sqliteevents, sqlitelinks
from effectguard.ledger.base import WorkerRow
from effectguard.ledger.endedsessions import SQLITE_INSERT, SQLITE_PURGE
from effectguard.ledger.groupcommit import Fate
from effectguard.ledger.queries import SQLITE
from effectguard.ledger.rows import (
    key_from_row,
    key_params,
    node_from_row,
    node_params,
    policy_from_row,
    policy_params,
    window_from_row,
    window_params,
    worker_from_row,
    worker_params,
)
from effectguard.ledger.sqliteconnect import BUSY_TIMEOUT_MS, connect
from effectguard.ledger.sqlitefile import file_identity
from effectguard.ledger.sqlitefrozen import connect_frozen
from effectguard.ledger.sqliterecords import events_from_row
from effectguard.ledger.sqliteschema import migrate
from effectguard.ledger.sqlparts import HEAD, NEXT_GENERATION, upsert
from effectguard.rules.bodyref import SpooledBody
from effectguard.rules.budget import BudgetNode, BudgetPolicy, Key
from effectguard.rules.events import GENESIS_DIGEST, StoredEvent
from effectguard.rules.keys import LedgerKey
from effectguard.rules.ratelimit import RateWindow
from effectguard.rules.workstate import WorkState

#: How often the writer folds the WAL into the database (see SqliteSession.maintain).
CHECKPOINT_EVERY_S = 1.0
#: What the WAL file shrinks back to when a write starts it over after a checkpoint. A
#: long reader (``verify``, an archive, a backup) holds checkpoints back, so the WAL grows
#: meanwhile; without a limit SQLite kept the file at its largest (50 MB after a 40 s
#: verify) until the process stopped. A second of traffic between checkpoints left at
#: most 1.4 MiB at 520 pairs/s (about 11 MiB at 4,000): 32 MiB is well above that, so
#: the file is not cut and regrown every second, and below what a long read leaves
#: (64 MiB would have kept the 50 MB WAL as it was).
JOURNAL_SIZE_LIMIT = 32 << 20
#: Call states the writer keeps between batches (far more than are ever in flight).
_CALL_CACHE_SIZE = 4096
#: Statements that go one row at a time (SQLite: executemany of a one-row statement).
_INSERT_EVENT = SQLITE.insert_events.rows(1)
#: A call's row with the seq of its last event (sqliteevents: how a call's events are found).
_UPSERT_CALL = upsert("calls", sqlitecalls.ROW_COLUMNS, "?", sqlitecalls.MUTABLE_COLUMNS).rows(1)
_UPSERT_NODE = SQLITE.upsert_nodes.rows(1)
_UPSERT_POLICY = SQLITE.upsert_policies.rows(1)
_UPSERT_WINDOW = SQLITE.upsert_windows.rows(1)
_UPSERT_WORKER = SQLITE.upsert_workers.rows(1)
_UPSERT_KEY = SQLITE.upsert_keys.rows(1)


class SqliteSession:
    """Table access and transaction control on the writer thread's connection.

    Inside a batch this connection holds SQLite's write lock (``BEGIN IMMEDIATE``),
    so nobody else can change the chain head, budget rows or worker rows: those are
    cached for the batch, and budget rows are written once per batch, at commit.
    Each operation's savepoint snapshots the (small) caches so a rollback restores
    them with the tables.

    ``clock`` is the ledger's clock (leases, event times): the wall clock unless a
    test injects one.
    """

    def __init__(
        self, path: str, clock: Callable[[], float] = time.time, frozen: str | None = None
    ) -> None:
        self.path = path
        # ``frozen``: the URI reading a ledger on read-only storage as it lies (sqlitefrozen).
        self.conn = connect(path) if frozen is None else connect_frozen(frozen)
        self._clock = clock
        try:
            migrate(self.conn)
        except BaseException:
            self.conn.close()
            raise
        # The file this connection writes. If it is deleted or replaced while we run,
        # our commits would go to a file nobody will ever read again.
        self._identity = file_identity(path)
        # Waiting for another process's write lock happens in begin(), off the event loop.
        self.conn.execute("PRAGMA busy_timeout = 0")
        # Checkpoints run between batches, off the loop (maintain), not inside a COMMIT.
        self.conn.execute("PRAGMA wal_autocheckpoint = 0")
        self.conn.execute(f"PRAGMA journal_size_limit = {JOURNAL_SIZE_LIMIT}")
        self._checkpointed = time.monotonic()
        self._head: tuple[int, str] | None = None
        # One instant per batch, as on PostgreSQL: an admission's period labels and its
        # events' times are read from the same clock reading.
        self._now: float | None = None
        self._nodes: dict[Key, BudgetNode] = {}
        self._dirty: set[Key] = set()
        self._policies: dict[str, BudgetPolicy | None] = {}
        self._workers: dict[str, WorkerRow | None] = {}
        self._snapshot: tuple[Any, ...] = ()
        self._version: int | None = None
        # Call states as last written or read: observing a call reads the state its
        # admission wrote. Undone through a journal, since copying it per savepoint
        # would cost more than the reads it saves.
        self._calls: dict[str, WorkState] = {}
        self._undo: list[tuple[str, WorkState | None]] | None = None
        # Each call's last event and each worker's id, for the rows events are stored as,
        # and the operation's events, inserted together (one statement) when it ends.
        self._links = sqlitelinks.RowLinks(self.conn, _CALL_CACHE_SIZE)

    def _forget(self) -> None:
        self._head = None
        self._nodes = {}
        self._dirty = set()
        self._policies = {}
        self._workers = {}
        self._version = None
        self._calls = {}
        self._undo = None
        self._links.forget()

    def _revalidate(self) -> None:
        # Caches outlive a batch while no other connection commits: data_version changes
        # exactly when one does, and once we hold the write lock none can until we end.
        # This saves re-reading the chain head, worker and budget rows in every batch.
        version = int(self.conn.execute("PRAGMA data_version").fetchone()[0])
        if version != self._version:
            self._forget()
            self._version = version
        self._links.trim()

    def intact(self) -> bool:
        """Whether the ledger file at our path is still the one this connection opened."""
        try:
            return file_identity(self.path) == self._identity
        except OSError:
            return False

    def _check_intact(self) -> None:
        # One stat per batch (a couple of microseconds) before any work is accepted.
        if not self.intact():
            raise LedgerUnavailable(
                f"ledger file {self.path} was deleted or replaced while in use; "
                "restart effectguard on the right file"
            )

    # -- transaction control
    def begin_nowait(self) -> bool:
        self._check_intact()
        try:
            self.conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                return False
            raise
        self._revalidate()
        self._now = None
        return True

    def begin(self) -> None:
        self._check_intact()
        self.conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        try:
            self.conn.execute("BEGIN IMMEDIATE")
        finally:
            self.conn.execute("PRAGMA busy_timeout = 0")
        self._revalidate()
        self._now = None

    def _flush_events(self) -> None:
        rows = self._links.take()
        if rows:
            self.conn.executemany(_INSERT_EVENT, rows)

    def commit(self) -> None:
        self._flush_events()
        if self._dirty:
            self.conn.executemany(_UPSERT_NODE, [node_params(self._nodes[p]) for p in self._dirty])
        self.conn.execute("COMMIT")
        self._dirty = set()  # the caches now hold what is committed

    def rollback(self) -> None:
        self._forget()
        if self.conn.in_transaction:
            self.conn.execute("ROLLBACK")

    def fate(self) -> Fate:
        return "refused"  # SQLite's commit is atomic: a COMMIT that failed changed nothing

    def savepoint(self) -> None:
        self._snapshot = (
            self._head,
            dict(self._nodes),
            set(self._dirty),
            dict(self._workers),
            dict(self._policies),
        )
        self._undo = []
        self.conn.execute("SAVEPOINT op")

    def release(self) -> None:
        self._flush_events()
        self._undo = None
        self.conn.execute("RELEASE op")

    def rollback_to(self) -> None:
        self._links.forget()  # read again from the rows the rollback restored
        self.conn.execute("ROLLBACK TO op")
        self._head, self._nodes, self._dirty, self._workers, self._policies = self._snapshot
        for call_id, previous in reversed(self._undo or []):
            if previous is None:
                self._calls.pop(call_id, None)
            else:
                self._calls[call_id] = previous
        self._undo = None

    def maintenance_due(self) -> bool:
        return time.monotonic() - self._checkpointed >= CHECKPOINT_EVERY_S

    def maintain(self) -> None:
        """Fold the WAL into the database file.

        Run by the writer between its own transactions, the checkpoint reaches the
        end of the WAL, so the next transaction starts the WAL over from its first
        frame. Checkpointing from another connection while this one commits
        continuously never caught up: the WAL grew without bound (222 MB after two
        minutes of load) and every commit paid for extending the file.
        """
        self._checkpointed = time.monotonic()
        self.conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()

    def close(self) -> None:
        self.conn.close()

    # -- Tx
    def now(self) -> float:
        if self._now is None:
            self._now = self._clock()
        return self._now

    def head(self) -> tuple[int, str]:
        if self._head is None:
            row = self.conn.execute(HEAD).fetchone()
            self._head = (
                (0, GENESIS_DIGEST)
                if row is None
                else (int(row[0]), sqliteevents.hex_digest(row[1]))
            )
        return self._head

    def insert_event(self, event: StoredEvent, data_json: str) -> None:
        self._links.add(event)
        self._head = (event.seq, event.digest)

    def events_of(self, call_id: str) -> list[StoredEvent]:
        self._flush_events()
        last = self._links.tail(call_id)
        if last is None:
            return []
        rows = self.conn.execute(
            sqliteevents.CALL_EVENTS_FROM, (last, sqliteevents.call_key(call_id))
        )
        return [e for r in rows for e in events_from_row(r)]

    def _state(self, row: Any) -> WorkState:
        # A resolved call's row keeps no state: fold its events (sqlitecalls).
        state = sqlitecalls.state_from_row(row)
        if state is None:
            call_id = sqliteevents.call_from_key(row[0])
            state = sqlitecalls.fold(self.events_of(str(call_id)))
        return state

    def _one_call(self, sql: str, params: Sequence[Any]) -> WorkState | None:
        row = self.conn.execute(sql, params).fetchone()
        return None if row is None else self._state(row)

    def get_call(self, call_id: str) -> WorkState | None:
        state = self._calls.get(call_id)
        if state is None:
            state = self._one_call(SQLITE.call, (sqliteevents.call_key(call_id),))
            if state is not None:
                self._remember(state)
        return state

    def put_call(self, state: WorkState) -> None:
        params = sqlitecalls.call_params(state, self._links.worker_id(state.worker))
        self.conn.execute(_UPSERT_CALL, (*params, self._links.tail(state.call_id)))
        self._remember(state)

    def _remember(self, state: WorkState) -> None:
        if len(self._calls) >= _CALL_CACHE_SIZE:
            self._calls.clear()  # undo entries still restore what the tables hold
        if self._undo is not None:
            self._undo.append((state.call_id, self._calls.get(state.call_id)))
        self._calls[state.call_id] = state

    def find_keyed(self, root: str, key: str) -> WorkState | None:
        return self._one_call(SQLITE.keyed_call, (root, key))

    def find_archived(self, root: str, key: str) -> tuple[str, str] | None:
        row = self.conn.execute(SQLITE.archived_key, (root, key)).fetchone()
        return None if row is None else (str(row[0]), str(row[1]))

    def find_unresolved(self, root: str, request_hash: str, since: float) -> WorkState | None:
        params = (root, sqlitecalls.hash_key(request_hash), since)
        return self._one_call(SQLITE.unresolved_call, params)

    def find_decided(
        self, root: str, request_hash: str, since: float, applied: bool, limit: int
    ) -> list[WorkState]:
        params = (root, sqlitecalls.hash_key(request_hash), since, limit)
        # Every row first: folding a row's state reads (and flushes) events on this connection.
        rows = self.conn.execute(SQLITE.decided_by[applied], params).fetchall()
        return [self._state(r) for r in rows]

    def in_flight_of(self, workers: Sequence[str]) -> list[WorkState]:
        known = [k for w in workers if (k := self._links.known_worker(w)) is not None]
        if not known:
            return []
        rows = self.conn.execute(SQLITE.in_flight_of(len(known)), known).fetchall()
        return [self._state(r) for r in rows]

    def get_policies(self, paths: Sequence[str]) -> dict[str, BudgetPolicy]:
        missing = [p for p in paths if p not in self._policies]
        if missing:
            marks = ",".join("?" * len(missing))
            rows = self.conn.execute(f"{SQLITE.policies} WHERE path IN ({marks})", missing)
            self._policies.update(dict.fromkeys(missing))
            self._policies.update((r[0], policy_from_row(r)) for r in rows)
        return {p: policy for p in paths if (policy := self._policies[p]) is not None}

    def put_policy(self, policy: BudgetPolicy) -> None:
        self.conn.execute(_UPSERT_POLICY, policy_params(policy))
        self._policies[policy.path] = policy

    def get_nodes(self, keys: Sequence[Key]) -> dict[Key, BudgetNode]:
        missing = [k for k in keys if k not in self._nodes]
        if missing:
            params = [v for k in missing for v in k]
            rows = self.conn.execute(SQLITE.node_keys(len(missing)), params)
            self._nodes.update(((r[0], r[1]), node_from_row(r)) for r in rows)
        return {k: self._nodes[k] for k in keys if k in self._nodes}

    def put_node(self, node: BudgetNode) -> None:
        self._nodes[node.key] = node
        self._dirty.add(node.key)

    def get_key(self, name: str) -> LedgerKey | None:
        # Key changes are rare operator writes: read and write them straight through.
        row = self.conn.execute(SQLITE.key, (name,)).fetchone()
        return None if row is None else key_from_row(row)

    def put_key(self, row: LedgerKey) -> None:
        self.conn.execute(_UPSERT_KEY, key_params(row))

    def get_windows(self, paths: Sequence[str]) -> dict[str, RateWindow]:
        marks = ",".join("?" * len(paths))
        rows = self.conn.execute(f"{SQLITE.windows} WHERE path IN ({marks})", list(paths))
        return {r[0]: window_from_row(r) for r in rows}

    def put_window(self, window: RateWindow) -> None:
        self.conn.execute(_UPSERT_WINDOW, window_params(window))

    def flying_under(self, path: str) -> list[WorkState]:
        rows = self.conn.execute(SQLITE.flying_under, SQLITE.subtree(path)).fetchall()
        return [self._state(r) for r in rows]

    def count_in_flight(self, path: str) -> int:
        row = self.conn.execute(SQLITE.in_flight_under, SQLITE.subtree(path)).fetchone()
        return int(row[0])

    def get_worker(self, worker: str) -> WorkerRow | None:
        if worker not in self._workers:
            row = self.conn.execute(SQLITE.worker, (worker,)).fetchone()
            self._workers[worker] = None if row is None else worker_from_row(row)
        return self._workers[worker]

    def put_worker(self, row: WorkerRow) -> None:
        self.conn.execute(_UPSERT_WORKER, worker_params(row))
        self._workers[row.worker] = row

    def live_workers(self) -> list[WorkerRow]:
        return [worker_from_row(r) for r in self.conn.execute(SQLITE.live_workers)]

    def next_generation(self) -> int:
        row = self.conn.execute(NEXT_GENERATION).fetchone()
        return int(row[0])

    def put_body(self, call_id: str, body: SpooledBody) -> None:
        # Inserted as read, inside the operation's savepoint: a file that turns out not
        # to be the declared bytes fails the operation, and its rollback takes them back.
        key = sqliteevents.call_key(call_id)
        for seq, chunk in bodystore.chunks(call_id, body):
            self.conn.execute(SQLITE.body.insert, (key, seq, chunk))

    def put_ended_session(self, token_sha256: str, expires_at: float, purge_before: float) -> None:
        self.conn.execute(SQLITE_PURGE, (purge_before, token_sha256))
        self.conn.execute(SQLITE_INSERT, (token_sha256, expires_at))
