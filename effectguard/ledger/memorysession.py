"""The in-memory ledger's tables and the transaction over them (an undo journal).

:class:`MemoryTables` are what a :class:`~effectguard.ledger.memory.MemoryStore`
holds; its writer runs each batch as a :class:`MemorySession` under the tables' lock.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Collection, Sequence
from typing import Any

from effectguard.ledger import bodystore
from effectguard.ledger.base import WorkerRow
from effectguard.ledger.groupcommit import Fate
from effectguard.rules import budget as budgets
from effectguard.rules.bodyref import SpooledBody
from effectguard.rules.budget import BudgetNode, BudgetPolicy, Key
from effectguard.rules.events import GENESIS_DIGEST, StoredEvent
from effectguard.rules.keys import LedgerKey
from effectguard.rules.ratelimit import RateWindow
from effectguard.rules.workstate import UNRESOLVED, WorkState


class MemoryTables:
    """The tables of an in-memory ledger."""

    def __init__(self) -> None:
        self.events: list[StoredEvent] = []
        self.calls: dict[str, WorkState] = {}
        self.nodes: dict[Key, BudgetNode] = {}
        self.policies: dict[str, BudgetPolicy] = {}
        self.windows: dict[str, RateWindow] = {}
        self.workers: dict[str, WorkerRow] = {}
        self.keys: dict[str, LedgerKey] = {}
        #: By-reference request bodies: call id -> its chunks, in order (ledger/bodystore).
        self.bodies: dict[str, list[bytes]] = {}
        #: Ended operator-page sessions: their token's SHA-256 -> its expiry.
        self.ended_sessions: dict[str, float] = {}
        self.generation = 0
        self.lock = threading.RLock()


class MemorySession:
    """A transaction over :class:`MemoryTables` with an undo journal per savepoint."""

    def __init__(self, tables: MemoryTables, clock: Callable[[], float]) -> None:
        self.t = tables
        self._clock = clock
        self._undo: list[Callable[[], None]] = []
        self._batch_undo: list[Callable[[], None]] = []
        self._now: float | None = None

    def begin(self) -> None:
        self.t.lock.acquire()
        self._batch_undo = []
        self._now = None  # one instant per batch, as on the SQL stores

    def commit(self) -> None:
        # A faithful fake: refuse at commit what a 64-bit column of SQLite or
        # PostgreSQL would refuse there, so batch isolation is tested on every store.
        # The committer rolls the batch back when this raises.
        values = [(n.path, v) for n in self.t.nodes.values() for v in (n.reserved, n.spent, n.held)]
        values += [(p.path, p.limit or 0) for p in self.t.policies.values()]
        for path, value in values:
            if not -(2**63) <= value < 2**63:
                raise OverflowError(f"budget {path!r}: {value} does not fit 64 bits")
        self._batch_undo = []
        self.t.lock.release()

    def fate(self) -> Fate:
        return "refused"  # a failed batch was undone in full

    def rollback(self) -> None:
        for undo in reversed(self._batch_undo):
            undo()
        self._batch_undo = []
        self.t.lock.release()

    def savepoint(self) -> None:
        self._undo = []

    def release(self) -> None:
        self._batch_undo.extend(self._undo)
        self._undo = []

    def rollback_to(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo = []

    def close(self) -> None:
        pass

    def _set(self, table: dict[Any, Any], key: Any, value: Any) -> None:
        missing = object()
        old = table.get(key, missing)

        def undo() -> None:
            if old is missing:
                table.pop(key, None)
            else:
                table[key] = old

        self._undo.append(undo)
        table[key] = value

    # -- Tx
    def now(self) -> float:
        if self._now is None:
            self._now = self._clock()
        return self._now

    def head(self) -> tuple[int, str]:
        if not self.t.events:
            return 0, GENESIS_DIGEST
        last = self.t.events[-1]
        return last.seq, last.digest

    def insert_event(self, event: StoredEvent, data_json: str) -> None:
        events = self.t.events
        events.append(event)
        self._undo.append(lambda: events.remove(event))

    def events_of(self, call_id: str) -> list[StoredEvent]:
        return [e for e in self.t.events if e.call_id == call_id]

    def get_call(self, call_id: str) -> WorkState | None:
        return self.t.calls.get(call_id)

    def put_call(self, state: WorkState) -> None:
        self._set(self.t.calls, state.call_id, state)

    def find_keyed(self, root: str, key: str) -> WorkState | None:
        for s in self.t.calls.values():
            if s.budget_root == root and s.idempotency_key == key and s.stage != "refused":
                return s
        return None

    def find_archived(self, root: str, key: str) -> tuple[str, str] | None:
        return None  # nothing is archived from memory

    def find_unresolved(self, root: str, request_hash: str, since: float) -> WorkState | None:
        return next(iter(self._newest(root, request_hash, since, UNRESOLVED)), None)

    def find_decided(
        self, root: str, request_hash: str, since: float, applied: bool, limit: int
    ) -> list[WorkState]:
        stage = "reconciled_applied" if applied else "reconciled_not_applied"
        return self._newest(root, request_hash, since, {stage})[:limit]

    def _newest(
        self, root: str, request_hash: str, since: float, stages: Collection[str]
    ) -> list[WorkState]:
        """The calls with this hash in ``stages`` created since ``since``, newest first."""
        found = [
            s
            for s in self.t.calls.values()
            if s.budget_root == root
            and s.request_hash == request_hash
            and s.stage in stages
            and s.created_at >= since
        ]
        found.sort(key=lambda s: s.created_at, reverse=True)  # stable: ties keep one order
        return found

    def in_flight_of(self, workers: Sequence[str]) -> list[WorkState]:
        return [s for s in self.t.calls.values() if s.stage == "in_flight" and s.worker in workers]

    def get_policies(self, paths: Sequence[str]) -> dict[str, BudgetPolicy]:
        return {p: self.t.policies[p] for p in paths if p in self.t.policies}

    def put_policy(self, policy: BudgetPolicy) -> None:
        self._set(self.t.policies, policy.path, policy)

    def get_nodes(self, keys: Sequence[Key]) -> dict[Key, BudgetNode]:
        return {k: self.t.nodes[k] for k in keys if k in self.t.nodes}

    def put_node(self, node: BudgetNode) -> None:
        self._set(self.t.nodes, node.key, dataclasses.replace(node, limit=None))

    def get_key(self, name: str) -> LedgerKey | None:
        return self.t.keys.get(name)

    def put_key(self, row: LedgerKey) -> None:
        self._set(self.t.keys, row.name, row)

    def get_windows(self, paths: Sequence[str]) -> dict[str, RateWindow]:
        return {p: self.t.windows[p] for p in paths if p in self.t.windows}

    def put_window(self, window: RateWindow) -> None:
        self._set(self.t.windows, window.path, window)

    def flying_under(self, path: str) -> list[WorkState]:
        return [
            s
            for s in self.t.calls.values()
            if s.stage == "in_flight" and budgets.is_under(s.budget, path)
        ]

    def count_in_flight(self, path: str) -> int:
        return sum(
            1
            for s in self.t.calls.values()
            if s.stage == "in_flight" and budgets.is_under(s.budget, path)
        )

    def get_worker(self, worker: str) -> WorkerRow | None:
        return self.t.workers.get(worker)

    def put_worker(self, row: WorkerRow) -> None:
        self._set(self.t.workers, row.worker, row)

    def live_workers(self) -> list[WorkerRow]:
        return [w for w in self.t.workers.values() if not w.fenced]

    def put_body(self, call_id: str, body: SpooledBody) -> None:
        # Kept aside until the file has proved to be the declared bytes, so a mismatch
        # leaves nothing behind (the SQL stores roll their savepoint back instead).
        stored = [chunk for _, chunk in bodystore.chunks(call_id, body)]
        self._set(self.t.bodies, call_id, stored)

    def put_ended_session(self, token_sha256: str, expires_at: float, purge_before: float) -> None:
        ended = self.t.ended_sessions
        gone = {t: e for t, e in ended.items() if e < purge_before and t != token_sha256}
        for token in gone:
            del ended[token]
        self._undo.append(lambda: ended.update(gone))
        if token_sha256 not in ended:
            self._set(ended, token_sha256, expires_at)

    def next_generation(self) -> int:
        old = self.t.generation

        def undo() -> None:
            self.t.generation = old

        self._undo.append(undo)
        self.t.generation = old + 1
        return self.t.generation
