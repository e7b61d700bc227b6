"""The verifier: feed stored events in order, then compare the stored projections.

:class:`Verifier` runs each event through the chain check, the writer rules, the call's
legal sequence and the budget arithmetic; :meth:`Verifier.finish` then checks that every
call ended in a stage (nothing required is missing) and that what the store keeps for
speed (call states, their columns, budget rows, worker rows, keys, rate
windows) equals the fold.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from effectguard.ops.audit import checkpoint, table
from effectguard.ops.audit.bodies import Bodies, BodyRow
from effectguard.ops.audit.budgets import NO_POLICY, Budgets, Counters, Node
from effectguard.ops.audit.calls import COLUMN_NAMES, CallFold
from effectguard.ops.audit.chain import Chain
from effectguard.ops.audit.keys import KINDS as KEY_KINDS
from effectguard.ops.audit.keys import KeyRow, Keys
from effectguard.ops.audit.rates import RateRow, Rates
from effectguard.ops.audit.report import VerifyReport
from effectguard.ops.audit.writers import Writers
from effectguard.rules.events import StoredEvent


class BudgetRow(NamedTuple):
    """A stored budget counter row: one node in one period."""

    path: str
    period: str
    reserved: int
    spent: int
    held: int


class PolicyRow(NamedTuple):
    """A stored budget policy row."""

    path: str
    limit: int | None
    period: str
    tz: str
    rpm: int | None
    tpm: int | None
    concurrency: int | None


class WorkerRow(NamedTuple):
    """A stored worker row (the parts the events decide)."""

    worker: str
    generation: int
    fenced: bool


#: A call's columns, in the order the store gives them (calls.COLUMN_NAMES).
CallColumns = tuple[Any, ...]


class Verifier:
    """Incremental verifier: :meth:`feed` events in ledger order, then :meth:`finish`."""

    def __init__(self) -> None:
        self.report = VerifyReport()
        self.chain = Chain(self.report)
        self.writers = Writers()
        self.budgets = Budgets()
        self.keys = Keys()
        self.rates = Rates()
        self.calls: dict[str, CallFold] = {}
        self.bodies = Bodies()
        #: Calls with a stored row or state and events (their folds' own id strings).
        self._stored: set[str] = set()
        #: Calls with a stored row or state but no event (each named once).
        self._eventless: set[str] = set()
        self._ended = False

    def feed(self, stored: StoredEvent) -> None:
        """Check one event: its place in the chain, its writer, its meaning, its money."""
        self.report.events += 1
        self.chain.feed(stored)
        problems = self.writers.feed(stored)
        problems += self._meaning(stored)
        for problem in problems:
            self.report.broken(stored.seq, problem)

    def _meaning(self, stored: StoredEvent) -> list[str]:
        kind, data, seq = stored.kind, stored.data, stored.seq
        if not isinstance(data, dict):
            return [f"event {seq}: unreadable data"]
        try:
            if kind == checkpoint.KIND:
                if stored.call_id is not None:
                    return [f"event {seq}: {kind} belongs to no call, yet names {stored.call_id}"]
                return checkpoint.check(seq, data)
            if kind in table.LEDGER_KINDS:
                if stored.call_id is not None:
                    return [f"event {seq}: {kind} belongs to no call, yet names {stored.call_id}"]
                if kind in KEY_KINDS:
                    return self.keys.feed(seq, kind, data, stored.at)
                if kind == "budget.limit_set":  # before the policy changes: was it rated?
                    self.rates.declare(seq, data, stored.at, self.budgets.policies)
                return self.budgets.feed(seq, kind, data, generation=stored.generation)
            if kind not in table.CALL_KINDS:
                return [f"event {seq}: unknown event kind {kind!r}"]
            if stored.call_id is None or data.get("call") != stored.call_id:
                return [f"event {seq}: {kind} does not name its call consistently"]
            fold = self.calls.get(stored.call_id)
            if fold is None:
                fold = self.calls[stored.call_id] = CallFold(stored.call_id)
            money = self.budgets.feed(seq, kind, data, stored.at, stored.call_id)
            self.bodies.feed(seq, kind, stored.call_id, data)
            problems = fold.feed(stored) + money
            self.rates.feed(
                seq,
                kind,
                data,
                stored.at,
                stored.call_id,
                fold.last_attempt_at,
                self.budgets.policies,
            )
            return problems
        except (KeyError, TypeError, ValueError) as exc:
            return [f"event {seq}: unreadable {kind}: {exc!r}"]

    def finish(
        self,
        budget_rows: Iterable[BudgetRow],
        call_states: Iterable[Mapping[str, Any]],
        call_columns: Iterable[CallColumns] = (),
        worker_rows: Iterable[WorkerRow] | None = None,
        key_rows: Iterable[KeyRow] | None = None,
        policy_rows: Iterable[PolicyRow] | None = None,
        rate_rows: Iterable[RateRow] | None = None,
        body_rows: Iterable[BodyRow] | None = None,
    ) -> VerifyReport:
        """Check every call ended in a stage, then compare the stored projections (and,
        given ``body_rows``, the bodies stored by reference)."""
        last = self.chain.expected_seq - 1
        self.end_of_events()
        self.check_columns(call_columns)
        self.check_states(call_states)
        self._stateless()
        self._budgets(budget_rows, last)
        if policy_rows is not None:
            self._policies(policy_rows, last)
        if worker_rows is not None:
            self._workers(worker_rows, last)
        if key_rows is not None:
            self._keys(key_rows, last)
        if rate_rows is not None:
            for problem in self.rates.compare(list(rate_rows)):
                self.report.broken(last, problem)
        if body_rows is not None:
            self.check_bodies(body_rows)
        return self.report

    def check_bodies(self, rows: Iterable[BodyRow]) -> None:
        """Compare the bodies stored by reference with the manifests fed so far."""
        refused = {c for c, fold in self.calls.items() if fold.projection()["stage"] == "refused"}
        for seq, problem in self.bodies.check(rows, refused, self.chain.expected_seq - 1):
            self.report.broken(seq, problem)

    def end_of_events(self) -> None:
        """Every event is fed: name each call that ends without an event it needs. (Once;
        :meth:`finish` calls it if the caller did not, before any page of rows.)"""
        if self._ended:
            return
        self._ended = True
        for call_id in sorted(self.calls):
            fold = self.calls[call_id]
            if fold.unfinished is not None:
                self.report.broken(
                    fold.last_seq,
                    f"call {call_id}: ends after {fold.last_kind} (event {fold.last_seq}) "
                    f"without the {fold.unfinished} that must follow (an event is missing)",
                )

    def check_columns(self, rows: Iterable[CallColumns]) -> None:
        """Compare stored call rows' columns with the folds: a page at a time, after
        :meth:`end_of_events` and before :meth:`finish` (which checks what no page held)."""
        for row in rows:
            fold = self.calls.get(row[0])
            if fold is None:
                self._no_events(str(row[0]))
                continue
            self._stored.add(fold.call_id)
            want = fold.columns()
            diff = [
                f"{name}={got!r} (events: {want[name]!r})"
                for name, got in zip(COLUMN_NAMES, row, strict=True)
                if got != want[name]
            ]
            if diff:
                self.report.broken(
                    fold.last_seq, f"call {row[0]}: columns differ: {', '.join(diff)}"
                )

    def check_states(self, states: Iterable[Mapping[str, Any]]) -> None:
        """Compare kept call states with the folds, a page at a time (as :meth:`check_columns`).
        A store may keep a call's state only while it is unresolved, and fold it on read."""
        for have in states:
            call_id = str(have.get("call_id"))
            fold = self.calls.get(call_id)
            if fold is None:
                self._no_events(call_id)
                continue
            self._stored.add(fold.call_id)
            self._state(call_id, have, fold.projection(), fold.last_seq)

    def _no_events(self, call_id: str) -> None:
        if call_id not in self._eventless:
            self._eventless.add(call_id)
            self.report.broken(
                self.chain.expected_seq - 1, f"call {call_id}: stored, but no event belongs to it"
            )

    def _stateless(self) -> None:
        """Every call with events has a row or a kept state."""
        self.report.calls = len(self._stored) + len(self._eventless)
        for call_id in sorted(set(self.calls) - self._stored):
            fold = self.calls[call_id]
            self.report.broken(
                fold.last_seq,
                f"call {call_id}: stored state None differs "
                f"from the projection of its events ({fold.projection()['stage']})",
            )

    def _state(self, call_id: str, have: Mapping[str, Any], want: dict[str, Any], seq: int) -> None:
        if have.get("stage") != want["stage"]:
            self.report.broken(
                seq,
                f"call {call_id}: stored state {have.get('stage')} differs from the "
                f"projection of its events ({want['stage']})",
            )
        # Fields the verifier does not derive are not its to judge (a newer store may
        # keep more); every field it derives must be there and equal.
        diff = [
            f"{name}={have.get(name, '<missing>')!r} (events: {value!r})"
            for name, value in want.items()
            if name != "stage" and have.get(name, "<missing>") != value
        ]
        if diff:
            self.report.broken(seq, f"call {call_id}: stored state differs: {', '.join(diff)}")

    def _budgets(self, rows: Iterable[BudgetRow], last: int) -> None:
        stored = {(row.path, row.period): row for row in rows}
        self.report.budgets = len({path for path, _ in stored} | set(self.budgets.policies))
        for key in sorted(set(stored) | set(self.budgets.nodes)):
            row = stored.get(key)
            have = None if row is None else (row.reserved, row.spent, row.held)
            want = self.budgets.nodes.get(key, Node()).row()
            if have != want:
                self.report.broken(
                    last,
                    f"budget {key[0]!r} period {key[1]}: stored {_money(have)} "
                    f"but the events give {_money(want)}",
                )

    def _policies(self, rows: Iterable[PolicyRow], last: int) -> None:
        # A node whose policy is all defaults (a limit cleared, or a row a store kept from
        # before policies existed) is the same as a node without one.
        stored = {row.path: tuple(row[1:]) for row in rows}
        for path in sorted(set(stored) | set(self.budgets.policies)):
            have = stored.get(path, NO_POLICY)
            want = self.budgets.policies.get(path, NO_POLICY)
            if have != want:
                self.report.broken(
                    last, f"budget {path!r}: stored policy {have} but the events give {want}"
                )

    def _workers(self, rows: Iterable[WorkerRow], last: int) -> None:
        stored = {row.worker: (row.generation, row.fenced) for row in rows}
        want = self.writers.rows()
        for worker in sorted(set(stored) | set(want)):
            if stored.get(worker) != want.get(worker):
                self.report.broken(
                    last,
                    f"worker {worker!r}: stored (generation, fenced) {stored.get(worker)} "
                    f"but the events give {want.get(worker)}",
                )

    def _keys(self, rows: Iterable[KeyRow], last: int) -> None:
        stored = {row.name: row for row in rows}
        want = self.keys.rows
        for name in sorted(set(stored) | set(want)):
            have, expected = stored.get(name), want.get(name)
            if have != expected:
                # Name the fields that differ, never the digests themselves.
                fields = KeyRow._fields
                diff = (
                    "no row"
                    if have is None or expected is None
                    else ", ".join(
                        f for f, a, b in zip(fields, have, expected, strict=True) if a != b
                    )
                )
                self.report.broken(
                    last, f"key {name!r}: stored row differs from the events ({diff})"
                )


def _money(row: Counters | None) -> str:
    if row is None:
        return "no row"
    reserved, spent, held = row
    return f"reserved={reserved} spent={spent} held={held}"
