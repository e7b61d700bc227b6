"""The PostgreSQL writer's session: table access and transaction control on its connection.

One :class:`PostgresSession` lives on each replica's writer thread
(:mod:`effectguard.ledger.postgres`); every batch it runs holds the batch lock, so it
buffers writes (:mod:`effectguard.ledger.pgwrites`) and answers point reads from the
rows it keeps between batches (:mod:`effectguard.ledger.pgkept`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

from effectguard.errors import ConfigError, LedgerCorrupt, LedgerUnavailable
from effectguard.ledger import bodystore, endedsessions, pgfate
from effectguard.ledger.base import WorkerRow
from effectguard.ledger.groupcommit import Fate
from effectguard.ledger.pgdeadline import WriteDeadline
from effectguard.ledger.pgdriver import TransactionStatus, psycopg
from effectguard.ledger.pgkept import NODES, POLICIES, WINDOWS, Kept, node_keys
from effectguard.ledger.pgschema import (
    CLOCK_FUNCTION,
    IDLE_IN_TRANSACTION_MS,
    LOCK_TIMEOUT_MS,
    Target,
    clock_offset,
    lock_key,
    migrate_on,
)
from effectguard.ledger.pgwrites import Writes
from effectguard.ledger.queries import POSTGRES
from effectguard.ledger.rows import (
    event_from_row,
    event_params,
    key_from_row,
    key_params,
    node_from_row,
    policy_from_row,
    state_from_json,
    window_from_row,
    worker_from_row,
)
from effectguard.ledger.sqlparts import HEAD, NEXT_GENERATION
from effectguard.rules.bodyref import SpooledBody
from effectguard.rules.budget import BudgetNode, BudgetPolicy, Key
from effectguard.rules.events import GENESIS_DIGEST, StoredEvent
from effectguard.rules.keys import LedgerKey
from effectguard.rules.ratelimit import RateWindow
from effectguard.rules.workstate import WorkState

log = logging.getLogger("effectguard.ledger")

#: Reads the ledger's clock (the writer's ``now`` and the store's ``clock_now``).
CLOCK = f"SELECT {CLOCK_FUNCTION}()"


class PostgresSession:
    """Table access and transaction control on the writer thread's connection.

    Round trips are the cost on PostgreSQL, so a batch sends as few as it can:

    * ``BEGIN``, the batch lock, the chain head + clock read and the reads that bring
      the rows kept from earlier batches up to date (:mod:`effectguard.ledger.pgkept`)
      go in one pipeline;
    * writes are buffered and sent as one multi-row statement per table, together
      with ``COMMIT`` (or before a query that scans a table they touch);
    * point reads (a call, budget nodes, a policy, a window, a worker, the head) are
      answered from what this or an earlier batch read or wrote. That is sound because
      the batch lock keeps every other writer out until ``COMMIT``, and what other
      replicas changed since our last commit was re-read or dropped under the lock.

    An operation's writes sit in their own buffer until :meth:`release` merges them
    into the batch's; :meth:`rollback_to` drops them and undoes them in the kept rows
    (and rolls back to the savepoint, which is only opened if the operation's writes
    had to be sent early). Any error while sending writes abandons the whole batch.
    """

    def __init__(
        self, target: Target, on_newer: Callable[[str | None], None] | None = None
    ) -> None:
        self._target = target
        self._refused_newer = False  # a reconnect found a newer release's ledger: logged
        #: Told (on the writer thread) why, once a reconnect refuses the ledger; None if a
        #: later reconnect takes it again.
        self._on_newer = on_newer
        self._deadline = WriteDeadline()  # unarmed here: migrations may take minutes
        try:
            self.conn = self._open(first=True)
        except BaseException:
            self._deadline.close()
            raise
        self._batch_key = lock_key(self.conn, "batch")
        self._now: float | None = None
        self._head: tuple[int, str] | None = None
        self._head_mark: tuple[int, str] | None = None
        self._kept = Kept()
        self._batch = Writes()
        self._op = Writes()
        self._savepoint_open = False
        self._broken = False
        #: The head a failed transaction would have left (its last event), so that after a
        #: lost connection :meth:`fate` can tell whether its ``COMMIT`` took effect.
        self._lost_head: tuple[int, str] | None = None
        self._begun_at: tuple[int, str] | None = None  # the head this transaction began on

    def _open(self, first: bool = False) -> psycopg.Connection[Any]:
        conn = self._target.connect(
            self._deadline.watch,
            idle_in_transaction_session_timeout=str(IDLE_IN_TRANSACTION_MS),
            lock_timeout=str(LOCK_TIMEOUT_MS),
            synchronous_commit="on",
        )
        try:
            # A reconnect (a failover, a restarted server) checks as the start does: a
            # newer release may have migrated the ledger meanwhile, and this one would
            # write beside its rules whether or not it raised the writer format.
            migrate_on(conn, self._target)
            clock_offset(conn)
        except ConfigError as exc:
            conn.close()
            if first:
                raise  # serve's start refuses the ledger (exit 2)
            # Every batch reconnects and is refused so (503 ledger_unavailable, nothing
            # sent) until this process is replaced; the writer thread carries on.
            if not self._refused_newer:
                log.error(
                    "%s; this process writes nothing more to it",
                    exc,
                    extra={"event": "ledger_newer"},
                )
                self._refused_newer = True
                if self._on_newer is not None:
                    self._on_newer(str(exc))
            raise LedgerUnavailable(str(exc)) from exc
        except BaseException:
            conn.close()
            raise
        if self._refused_newer:  # the newer migration was undone: writing again
            self._refused_newer = False
            if self._on_newer is not None:
                self._on_newer(None)
        return conn

    def _reset(self) -> None:
        self._now = self._head = self._head_mark = self._begun_at = None
        self._batch, self._op = Writes(), Writes()
        self._savepoint_open = self._broken = False

    # -- transaction control
    def begin(self) -> None:
        try:
            self._begin()
        except psycopg.OperationalError as exc:
            if not self.conn.closed:
                raise
            # The server ended the session while it sat idle (a restart, a failover, an
            # idle timeout): nothing of this batch was sent, so begin it once more.
            self._begin(f"the server had closed its connection while idle ({_first_line(exc)})")

    def _reconnect(self, why: str) -> None:
        self._kept.forget()
        self.conn = self._open()
        # psycopg's own warning about the lost connection (``error ignored terminating
        # <psycopg.Pipeline [BAD]>``) says nothing of what came after: this line does.
        log.warning("ledger writer reconnected: %s", why, extra={"event": "ledger_reconnected"})

    def _begin(self, why: str = "its connection had been lost") -> None:
        self._deadline.arm()  # disarmed by commit or rollback (below, if this fails)
        try:
            if self.conn.closed:  # the server ended the session: reconnect for this batch
                self._reconnect(why)
            self._reset()
            with self.conn.pipeline():
                self.conn.execute("BEGIN")
                self.conn.execute("SELECT pg_advisory_xact_lock(%s)", (self._batch_key,))
                # Its snapshot is taken after the lock: it sees every earlier batch.
                sql, params, refresh = self._kept.first_read()
                cursor = self.conn.execute(sql, params)
            row = cursor.fetchone()
            assert row is not None
            self._now = float(row[0])
            self._head = (0, GENESIS_DIGEST) if row[1] is None else (int(row[1]), str(row[2]))
            self._begun_at = self._head
            self._kept.refreshed(self._head, refresh, list(row[3:]))
        except BaseException:
            # Whatever the first round trip did is undone (an aborted transaction left
            # open would refuse every later batch), and nothing half-refreshed is kept.
            with contextlib.suppress(psycopg.Error):
                self.rollback()
            raise

    def commit(self) -> None:
        self._send("COMMIT")  # the buffered writes and COMMIT: one round trip
        self._deadline.disarm()
        self._kept.head = self._head  # what is kept is now what is committed
        self._reset()

    def rollback(self) -> None:
        wrote = self._head is not None and self._head != self._begun_at
        self._lost_head = self._head if wrote else None
        self._kept.forget()  # it may hold what this transaction wrote
        self._reset()
        try:
            if not self.conn.closed and self.conn.info.transaction_status != TransactionStatus.IDLE:
                self.conn.execute("ROLLBACK")
        finally:
            self._deadline.disarm()

    def fate(self) -> Fate:
        # A server that refused a statement aborted the transaction: it did not commit.
        if not self.conn.closed:
            return "refused"
        # A lost connection leaves the COMMIT's fate to be found out: never guess.
        lost, self._lost_head = self._lost_head, None
        if lost is None:
            return "unknown"  # it wrote no event to recognise it by
        self._deadline.arm()  # a path that went silent may be silent still
        try:
            self._reconnect("to find out whether the batch its lost connection ran committed")
            return "committed" if pgfate.committed(self.conn, self._batch_key, lost) else "lost"
        except (psycopg.Error, LedgerUnavailable):
            return "unknown"
        finally:
            self._deadline.disarm()

    def savepoint(self) -> None:
        self._op = Writes()
        self._savepoint_open = False
        self._head_mark = self._head
        self._kept.mark()

    def release(self) -> None:
        self._batch.absorb(self._op)
        self._op = Writes()
        self._kept.keep_marked()
        if self._savepoint_open:
            self._savepoint_open = False
            self.conn.execute("RELEASE SAVEPOINT op")

    def rollback_to(self) -> None:
        if self._broken:
            raise LedgerUnavailable("sending buffered ledger writes failed; batch abandoned")
        self._op = Writes()
        if self._savepoint_open:
            self.conn.execute("ROLLBACK TO SAVEPOINT op")
        elif self.conn.info.transaction_status == TransactionStatus.INERROR:
            raise LedgerUnavailable("a ledger read failed outside a savepoint; batch abandoned")
        # Forget what the operation wrote; keep what earlier operations buffered.
        self._kept.undo()
        self._head = self._head_mark

    def close(self) -> None:
        self.conn.close()
        self._deadline.close()

    # -- statements
    def _send(
        self, query: str, params: Sequence[Any] = (), *, savepoint: bool = False
    ) -> list[tuple[Any, ...]]:
        """Send buffered writes, then run ``query``, in one pipeline (one round trip).

        With ``savepoint`` (``query`` writes), the operation's savepoint is opened
        first even when it has no buffered writes.
        """
        self._deadline.arm()
        try:
            with self.conn.pipeline():
                self._batch.send(self.conn)
                if (self._op or savepoint) and not self._savepoint_open:
                    self.conn.execute("SAVEPOINT op")
                    self._savepoint_open = True
                self._op.send(self.conn)
                cursor = self.conn.execute(query, params)
            return cursor.fetchall() if cursor.description else []
        except psycopg.Error as exc:
            self._broken = True
            if isinstance(exc, psycopg.errors.IntegrityError):
                raise LedgerCorrupt(f"ledger write violates a ledger constraint: {exc}") from exc
            raise LedgerUnavailable(f"ledger statement failed: {exc}") from exc

    def _get(self, query: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        """A point read: nothing buffered can change its answer (the caches hold it)."""
        self._deadline.arm()
        try:
            return self.conn.execute(query, params).fetchall()
        except psycopg.Error as exc:
            raise LedgerUnavailable(f"ledger read failed: {exc}") from exc

    def _scan(self, query: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        """A read that may match buffered rows: send them first."""
        if self._batch or self._op:
            return self._send(query, params)
        return self._get(query, params)

    # -- Tx
    def now(self) -> float:
        if self._now is None:
            self._now = float(self._get(CLOCK, ())[0][0])
        return self._now

    def head(self) -> tuple[int, str]:
        if self._head is None:
            rows = self._scan(HEAD, ())
            self._head = (0, GENESIS_DIGEST) if not rows else (int(rows[0][0]), str(rows[0][1]))
        return self._head

    def insert_event(self, event: StoredEvent, data_json: str) -> None:
        self._op.events.append(event_params(event, data_json))
        self._head = (event.seq, event.digest)

    def events_of(self, call_id: str) -> list[StoredEvent]:
        return [event_from_row(r) for r in self._scan(POSTGRES.call_events, (call_id,))]

    def get_call(self, call_id: str) -> WorkState | None:
        calls = self._kept.calls
        if call_id not in calls:
            rows = self._get(POSTGRES.call, (call_id,))
            calls[call_id] = state_from_json(rows[0][0]) if rows else None
        return calls[call_id]

    def put_call(self, state: WorkState) -> None:
        self._op.calls[state.call_id] = state
        self._kept.put(self._kept.calls, state.call_id, state)

    def _scan_call(self, query: str, params: Sequence[Any]) -> WorkState | None:
        rows = self._scan(query, params)
        return state_from_json(rows[0][0]) if rows else None

    def find_keyed(self, root: str, key: str) -> WorkState | None:
        return self._scan_call(POSTGRES.keyed_call, (root, key))

    def find_archived(self, root: str, key: str) -> tuple[str, str] | None:
        rows = self._get(POSTGRES.archived_key, (root, key))  # written only under the batch lock
        return (str(rows[0][0]), str(rows[0][1])) if rows else None

    def find_unresolved(self, root: str, request_hash: str, since: float) -> WorkState | None:
        return self._scan_call(POSTGRES.unresolved_call, (root, request_hash, since))

    def find_decided(
        self, root: str, request_hash: str, since: float, applied: bool, limit: int
    ) -> list[WorkState]:
        rows = self._scan(POSTGRES.decided_by[applied], (root, request_hash, since, limit))
        return [state_from_json(r[0]) for r in rows]

    def in_flight_of(self, workers: Sequence[str]) -> list[WorkState]:
        rows = self._scan(POSTGRES.in_flight_of(len(workers)), workers)
        return [state_from_json(r[0]) for r in rows]

    def get_policies(self, paths: Sequence[str]) -> dict[str, BudgetPolicy]:
        kept = self._kept.policies
        missing = [p for p in paths if p not in kept]
        if missing:
            rows = self._get(POLICIES, (missing,))
            kept.update(dict.fromkeys(missing))
            kept.update((r[0], policy_from_row(r)) for r in rows)
        return {p: policy for p in paths if (policy := kept[p]) is not None}

    def put_policy(self, policy: BudgetPolicy) -> None:
        self._op.policies[policy.path] = policy
        self._kept.put(self._kept.policies, policy.path, policy)

    def get_nodes(self, keys: Sequence[Key]) -> dict[Key, BudgetNode]:
        kept = self._kept.nodes
        missing = [k for k in keys if k not in kept]
        if missing:
            rows = self._get(NODES, node_keys(missing))
            kept.update(dict.fromkeys(missing))
            kept.update(((r[0], r[1]), node_from_row(r)) for r in rows)
        return {k: node for k in keys if (node := kept[k]) is not None}

    def put_node(self, node: BudgetNode) -> None:
        self._op.nodes[node.key] = node
        self._kept.put(self._kept.nodes, node.key, node)

    def get_key(self, name: str) -> LedgerKey | None:
        rows = self._scan(POSTGRES.key, (name,))
        return key_from_row(rows[0]) if rows else None

    def put_key(self, row: LedgerKey) -> None:
        # Key changes are rare operator writes: sent at once (inside the operation's
        # savepoint) rather than buffered, so a later read in the batch sees them.
        self._send(POSTGRES.upsert_keys.rows(1), key_params(row), savepoint=True)

    def get_windows(self, paths: Sequence[str]) -> dict[str, RateWindow]:
        kept = self._kept.windows
        missing = [p for p in paths if p not in kept]
        if missing:
            rows = self._get(WINDOWS, (missing,))
            kept.update(dict.fromkeys(missing))
            kept.update((r[0], window_from_row(r)) for r in rows)
        return {p: window for p in paths if (window := kept[p]) is not None}

    def put_window(self, window: RateWindow) -> None:
        self._op.windows[window.path] = window
        self._kept.put(self._kept.windows, window.path, window)

    def flying_under(self, path: str) -> list[WorkState]:
        return [
            state_from_json(r[0]) for r in self._scan(POSTGRES.flying_under, POSTGRES.subtree(path))
        ]

    def count_in_flight(self, path: str) -> int:
        return int(self._scan(POSTGRES.in_flight_under, POSTGRES.subtree(path))[0][0])

    def get_worker(self, worker: str) -> WorkerRow | None:
        kept = self._kept.workers
        if worker not in kept:
            rows = self._get(POSTGRES.worker, (worker,))
            kept[worker] = worker_from_row(rows[0]) if rows else None
        return kept[worker]

    def put_worker(self, row: WorkerRow) -> None:
        self._op.workers[row.worker] = row
        self._kept.put(self._kept.workers, row.worker, row)

    def live_workers(self) -> list[WorkerRow]:
        return [worker_from_row(r) for r in self._scan(POSTGRES.live_workers, ())]

    def next_generation(self) -> int:
        return int(self._send(NEXT_GENERATION, savepoint=True)[0][0])

    def put_body(self, call_id: str, body: SpooledBody) -> None:
        # Sent chunk by chunk inside the operation's savepoint (opened by the first),
        # never buffered with the batch's rows: a buffer would hold the body whole. A
        # failed operation's rollback_to rolls the savepoint back, chunks included.
        for seq, chunk in bodystore.chunks(call_id, body):
            self._send(POSTGRES.body.insert, (call_id, seq, chunk), savepoint=True)

    def put_ended_session(self, token_sha256: str, expires_at: float, purge_before: float) -> None:
        params = (purge_before, token_sha256, token_sha256, expires_at)
        self._send(endedsessions.POSTGRES_END, params, savepoint=True)


def _first_line(exc: BaseException) -> str:
    """An error's first line (psycopg's messages may go on with hints and details)."""
    return str(exc).strip().split("\n", 1)[0]
