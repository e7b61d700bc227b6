"""The in-memory ledger: the same rules and group commit, held in dicts.

For tests and for users' own tests (``effectguard.testing``). Savepoints are an
undo journal; a lock makes each batch atomic with respect to readers.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from typing import Any, BinaryIO, TypeVar

from effectguard.errors import LedgerUnavailable
from effectguard.ledger import operations
from effectguard.ledger.base import (
    CallSpend,
    Operation,
    Orphaned,
    SpendSums,
    WorkerRow,
    Writer,
    sum_spend,
)
from effectguard.ledger.groupcommit import GroupCommitter
from effectguard.ledger.memorysession import MemorySession, MemoryTables
from effectguard.ledger.rows import state_params
from effectguard.rules import budget as budgets
from effectguard.rules.budget import BudgetNode, BudgetPolicy, is_under
from effectguard.rules.budgetview import Policyless, tree_order
from effectguard.rules.events import BudgetLimitSet, StoredEvent
from effectguard.rules.keys import KINDS as KEY_KINDS
from effectguard.rules.keys import LedgerKey
from effectguard.rules.periods import TOTAL
from effectguard.rules.ratelimit import RateWindow
from effectguard.rules.workstate import UNRESOLVED, Stage, WorkState

T = TypeVar("T")


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

    async def renew_lease(self, writer: Writer, lease_s: float) -> float:
        return await self.write(writer, lambda tx: operations.heartbeat(tx, writer, lease_s))

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
