"""The in-memory ledger: the same rules and group commit, held in dicts.

For tests and for users' own tests (``effectguard.testing``). Savepoints are an
undo journal; a lock makes each batch atomic with respect to readers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from typing import Any, BinaryIO, TypeVar

from effectguard.errors import LedgerUnavailable
from effectguard.ledger import bodystore, operations
from effectguard.ledger.base import (
    CallSpend,
    Operation,
    Orphaned,
    SpendSums,
    WorkerRow,
    Writer,
    sum_spend,
)
from effectguard.ledger.groupcommit import Fate, GroupCommitter
from effectguard.ledger.rows import state_params
from effectguard.rules import budget as budgets
from effectguard.rules.bodyref import SpooledBody
from effectguard.rules.budget import BudgetNode, BudgetPolicy, Key, is_under
from effectguard.rules.budgetview import Policyless, tree_order
from effectguard.rules.events import GENESIS_DIGEST, BudgetLimitSet, StoredEvent
from effectguard.rules.keys import KINDS as KEY_KINDS
from effectguard.rules.keys import LedgerKey
from effectguard.rules.periods import TOTAL
from effectguard.rules.ratelimit import RateWindow
from effectguard.rules.workstate import UNRESOLVED, Stage, WorkState

T = TypeVar("T")


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


class MemoryStore:
    """A ledger that lives in this process only."""

    def __init__(self, url: str = "memory://", clock: Callable[[], float] = time.time) -> None:
        self.url = url
        self.tables = MemoryTables()
        self._clock = clock
        self._writer: GroupCommitter[MemorySession] | None = None

    async def clock_now(self) -> float:
        return self._clock()

    async def open(self) -> None:
        writer = GroupCommitter(
            lambda: MemorySession(self.tables, self._clock), operations.check_writer
        )
        writer.start()
        self._writer = writer

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.stop()
            self._writer = None

    @property
    def committer(self) -> GroupCommitter[MemorySession]:
        """The group committer (for commit statistics)."""
        if self._writer is None:
            raise LedgerUnavailable(f"ledger {self.url} is not open")
        return self._writer

    async def write(self, writer: Writer, op: Operation[T], orphaned: Orphaned | None = None) -> T:
        return await self.committer.submit(writer, op, orphaned)

    async def get_call(self, call_id: str) -> WorkState | None:
        with self.tables.lock:
            return self.tables.calls.get(call_id)

    async def call_events(self, call_id: str) -> list[StoredEvent]:
        with self.tables.lock:
            return [e for e in self.tables.events if e.call_id == call_id]

    async def kept_states(self, after: str | None, limit: int) -> list[WorkState]:
        with self.tables.lock:
            return [self.tables.calls[c] for c in self._ids_after(after, limit)]

    def _ids_after(self, after: str | None, limit: int) -> list[str]:
        """Up to ``limit`` call ids after ``after``, in order (the caller holds the lock)."""
        return sorted(c for c in self.tables.calls if after is None or c > after)[:limit]

    async def lookup_problems(self) -> list[tuple[int, str]]:
        return []  # a call's events are found by scanning them: nothing to disagree

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
        with self.tables.lock:
            calls = [
                s
                for s in self.tables.calls.values()
                if (stage is None or s.stage == stage)
                and (budget is None or budgets.is_under(s.budget, budget))
                and (provider is None or s.provider == provider)
                and (since is None or s.created_at >= since)
            ]
        calls.sort(key=lambda s: s.created_at, reverse=not oldest_first)
        return calls[:limit]

    async def unknown_after(self, after: tuple[float, str] | None, limit: int) -> list[WorkState]:
        with self.tables.lock:
            calls = [
                s
                for s in self.tables.calls.values()
                if s.stage == "effect_unknown"
                and (after is None or (s.created_at, s.call_id) > after)
            ]
        calls.sort(key=lambda s: (s.created_at, s.call_id))
        return calls[:limit]

    async def in_flight_except(self, workers: Sequence[str], limit: int) -> list[WorkState]:
        with self.tables.lock:
            calls = [
                s
                for s in self.tables.calls.values()
                if s.stage == "in_flight" and s.worker not in workers
            ]
        return calls[:limit]

    async def call_spend(self, since: float, limit: int) -> list[CallSpend]:
        return [CallSpend.of(s) for s in await self.list_calls(limit=limit, since=since)]

    async def spend_sums(self, since: float, limit: int) -> SpendSums:
        return sum_spend(await self.call_spend(since, limit))

    async def budget_nodes(
        self,
        depth: int | None = None,
        periods: Collection[str] | None = None,
        under: str | None = None,
        *,
        policied: bool = False,
    ) -> list[BudgetNode]:
        with self.tables.lock:
            policies = self.tables.policies
            nodes = [
                n
                for n in self.tables.nodes.values()
                if (depth is None or n.path.count("/") < depth)
                and (periods is None or n.period in periods or n.path not in policies)
                and (under is None or is_under(n.path, under))
                and (not policied or n.path in policies)
            ]
        return sorted(nodes, key=lambda n: n.key)

    def _policyless(self, depth: int, under: str | None = None) -> list[BudgetNode]:
        """The counter rows of paths with no policy (period ``total``), as ``policyless``
        and ``policyless_page`` read them."""
        with self.tables.lock:
            policies = self.tables.policies
            return [
                n
                for n in self.tables.nodes.values()
                if n.period == TOTAL
                and n.path not in policies
                and n.path.count("/") < depth
                and (under is None or is_under(n.path, under))
            ]

    async def policyless(self, depth: int, limit: int) -> Policyless:
        nodes = self._policyless(depth)
        total = BudgetNode(
            "",
            reserved=sum(n.reserved for n in nodes),
            spent=sum(n.spent for n in nodes),
            held=sum(n.held for n in nodes),
        )
        top = sorted(nodes, key=lambda n: (-n.committed, n.path))[:limit]
        return Policyless(tuple(top), len(nodes), total)

    async def policyless_page(
        self, depth: int, under: str | None, limit: int
    ) -> tuple[list[BudgetNode], int]:
        nodes = sorted(self._policyless(depth, under), key=tree_order)
        return nodes[:limit], len(nodes)

    async def budget_rows(self, paths: Collection[str]) -> list[BudgetNode]:
        wanted = set(paths)
        with self.tables.lock:
            return [n for n in self.tables.nodes.values() if n.path in wanted]

    async def budget_policies(self) -> list[BudgetPolicy]:
        with self.tables.lock:
            return sorted(self.tables.policies.values(), key=lambda p: p.path)

    async def events_after(self, seq: int, limit: int) -> list[StoredEvent]:
        with self.tables.lock:
            return self.tables.events[seq : seq + limit]

    async def session_ended(self, token_sha256: str) -> bool:
        with self.tables.lock:
            return token_sha256 in self.tables.ended_sessions

    async def workers(self) -> list[WorkerRow]:
        with self.tables.lock:
            return list(self.tables.workers.values())

    async def live_workers(self) -> list[WorkerRow]:
        with self.tables.lock:
            return [w for w in self.tables.workers.values() if not w.fenced]

    async def keys(self) -> list[LedgerKey]:
        with self.tables.lock:
            return sorted(self.tables.keys.values(), key=lambda k: k.name)

    async def key_events_since(self, seq: int) -> list[StoredEvent]:
        with self.tables.lock:
            return [e for e in self.tables.events if e.seq > seq and e.kind in KEY_KINDS]

    async def key_events_high(self) -> int:
        with self.tables.lock:
            return max((e.seq for e in self.tables.events if e.kind in KEY_KINDS), default=0)

    async def archived_through(self) -> int:
        return 0  # nothing archives a memory ledger

    async def limit_events(self) -> list[StoredEvent]:
        with self.tables.lock:
            return [e for e in self.tables.events if e.kind == BudgetLimitSet.kind]

    async def checkpoint_events(self) -> list[StoredEvent]:
        with self.tables.lock:
            return [e for e in self.tables.events if e.kind == "ledger.archived"]

    async def rate_windows(self) -> list[RateWindow]:
        with self.tables.lock:
            return sorted(self.tables.windows.values(), key=lambda w: w.path)

    async def stage_counts(self) -> list[tuple[str, str, int, int, float]]:
        counts: dict[tuple[str, str], tuple[int, int, float]] = {}
        with self.tables.lock:
            for s in self.tables.calls.values():
                if s.stage in UNRESOLVED:
                    n, held, oldest = counts.get((s.provider, s.stage), (0, 0, s.created_at))
                    counts[s.provider, s.stage] = (n + 1, held + s.held, min(oldest, s.created_at))
        return [(p, st, *c) for (p, st), c in sorted(counts.items())]

    async def copy_body(self, call_id: str, out: BinaryIO) -> int:
        with self.tables.lock:
            stored = list(self.tables.bodies.get(call_id, ()))
        written = 0
        for chunk in stored:
            out.write(chunk)
            written += len(chunk)
        return written

    async def body_size(self, call_id: str) -> int | None:
        with self.tables.lock:
            stored = self.tables.bodies.get(call_id)
            return None if stored is None else sum(len(c) for c in stored)

    async def body_chunks(self) -> list[tuple[str, int, int]]:
        with self.tables.lock:
            return [
                (call_id, seq, len(chunk))
                for call_id, chunks in sorted(self.tables.bodies.items())
                for seq, chunk in enumerate(chunks)
            ]

    async def call_columns(self, after: str | None, limit: int) -> list[tuple[Any, ...]]:
        with self.tables.lock:
            states = [self.tables.calls[c] for c in self._ids_after(after, limit)]
        return [(*state_params(s)[:-1], s.model, s.cost, s.held) for s in states]

    @contextlib.asynccontextmanager
    async def snapshot(self) -> AsyncIterator[None]:
        with self.tables.lock:  # the writer thread waits for this block
            yield

    async def writable(self) -> bool:
        return self._writer is not None and self._writer.stats.last_ok
