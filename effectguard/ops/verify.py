"""Ledger verification (``effectguard verify``), pure.

Walks the hash chain, re-derives every budget counter and every call's work
state from the events alone, and compares them with what the store keeps for
speed. The first broken event is named.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from effectguard.ledger import Ledger
from effectguard.ledger.rows import INDEX_COLUMNS, state_params
from effectguard.rules import budget as budgets
from effectguard.rules import workstate
from effectguard.rules.budget import BudgetNode
from effectguard.rules.events import GENESIS_DIGEST, StoredEvent, canonical_json, event_digest
from effectguard.rules.workstate import WorkState

INDEX_NAMES = tuple(name.strip() for name in INDEX_COLUMNS.split(","))


@dataclass
class VerifyReport:
    """What verification found. ``ok`` when ``problems`` is empty."""

    events: int = 0
    calls: int = 0
    budgets: int = 0
    problems: list[str] = field(default_factory=list)
    first_broken_seq: int | None = None

    @property
    def ok(self) -> bool:
        """Whether the ledger passed every check."""
        return not self.problems


class Verifier:
    """Incremental verifier: feed events in order, then :meth:`finish`."""

    def __init__(self) -> None:
        self.report = VerifyReport()
        self._expected_seq = 1
        self._prev = GENESIS_DIGEST
        self._nodes: dict[str, BudgetNode] = {}
        self._calls: dict[str, WorkState] = {}

    def _broken(self, seq: int, problem: str) -> None:
        if self.report.first_broken_seq is None:
            self.report.first_broken_seq = seq
        self.report.problems.append(problem)

    def feed(self, stored: StoredEvent) -> None:
        """Check one event's place in the chain and fold it."""
        self.report.events += 1
        if stored.seq != self._expected_seq:
            self._broken(
                stored.seq,
                f"event {stored.seq}: expected sequence number {self._expected_seq} "
                "(an event is missing)",
            )
        if stored.prev_digest != self._prev:
            self._broken(stored.seq, f"event {stored.seq}: predecessor digest does not match")
        digest = event_digest(
            seq=stored.seq,
            kind=stored.kind,
            call_id=stored.call_id,
            data_json=canonical_json(stored.data),
            worker=stored.worker,
            generation=stored.generation,
            at=stored.at,
            prev_digest=stored.prev_digest,
        )
        if digest != stored.digest:
            self._broken(stored.seq, f"event {stored.seq}: digest does not match its content")
        self._expected_seq = stored.seq + 1
        self._prev = stored.digest
        try:
            event = stored.event
        except (TypeError, ValueError) as exc:
            self._broken(stored.seq, f"event {stored.seq}: unreadable: {exc}")
            return
        budgets.apply(self._nodes, event)
        if event.call_id is not None:
            state = self._calls.get(event.call_id) or WorkState()
            self._calls[event.call_id] = workstate.apply(state, event)

    def finish(
        self,
        stored_nodes: Iterable[BudgetNode],
        stored_calls: Iterable[WorkState],
        stored_columns: Iterable[tuple[Any, ...]] = (),
    ) -> VerifyReport:
        """Compare the folds with the stored counters, call states and indexed columns.

        The indexed columns (stage, key, budget, worker …) are what listings, the
        sweeper and metrics query, so they must agree with the events too.
        """
        for row in stored_columns:
            call_id = row[0]
            want_state = self._calls.get(call_id)
            if want_state is None:
                continue  # reported below as a call without events
            expected = state_params(want_state)[:-1]
            if tuple(row) != tuple(expected):
                diff = [
                    f"{name}={got!r} (events: {exp!r})"
                    for name, got, exp in zip(INDEX_NAMES, row, expected, strict=True)
                    if got != exp
                ]
                self._broken(
                    self.report.events, f"call {call_id}: indexed columns differ: {', '.join(diff)}"
                )
        nodes = {n.path: n for n in stored_nodes}
        self.report.budgets = len(nodes)
        for path in sorted(set(nodes) | set(self._nodes)):
            want = self._nodes.get(path, BudgetNode(path))
            have = nodes.get(path, BudgetNode(path))
            if want != have:
                self._broken(
                    self.report.events,
                    f"budget {path!r}: stored {have} but the events give {want}",
                )
        calls = {c.call_id: c for c in stored_calls}
        self.report.calls = len(calls)
        for call_id in sorted(set(calls) | set(self._calls)):
            want_state = self._calls.get(call_id)
            have_state = calls.get(call_id)
            if want_state != have_state:
                self._broken(
                    self.report.events,
                    f"call {call_id}: stored state {have_state and have_state.stage} "
                    f"differs from the projection of its events "
                    f"({want_state and want_state.stage})",
                )
        return self.report


async def verify_ledger(ledger: Ledger, page: int = 5000) -> VerifyReport:
    """Check the hash chain and re-derive every counter and projection.

    Every read happens inside one snapshot, so a live ledger being written
    while it is verified shows no false corruption.
    """
    verifier = Verifier()
    async with ledger.store.snapshot():
        seq = 0
        while True:
            batch = await ledger.store.events_after(seq, page)
            if not batch:
                break
            for stored in batch:
                verifier.feed(stored)
            seq = batch[-1].seq
        nodes = await ledger.store.budget_nodes()
        calls = await ledger.store.list_calls(limit=1 << 62)
        columns = await ledger.store.call_columns()
    return verifier.finish(nodes, calls, columns)
