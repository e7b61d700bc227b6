"""The budget tree, re-derived by the verifier's own arithmetic (docs/contract.md §5, periods).

A call's budget event changes its path and every ancestor: ``budget.reserved``
adds to ``reserved``; ``budget.settled`` moves the reservation to ``spent`` (at the
actual cost); ``budget.released`` drops it; ``budget.held`` moves it to ``held``;
``budget.unheld`` drops a hold and spends the decided cost; ``budget.corrected``
replaces a settled charge. A counter never goes below zero in a sound ledger, and a
reservation never takes a limited node past its limit: both are checked here.

Counters are kept per ``(path, period)``. A call's first reservation records the period
of each ancestor whose policy is not ``total``; the verifier recomputes those labels from
the policies in force and the event's time (:mod:`.calendar`), and every later budget
event of the call must name the same periods.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from effectguard.ops.audit.calendar import period_of

#: A clock stepped back this many seconds across a period's start still charges that period.
_KEPT_BACK_S = 60

Counters = tuple[int, int, int]  # reserved, spent, held
#: ``(limit, period kind, timezone, rpm, tpm, concurrency)`` as ``budget.limit_set`` says.
Policy = tuple[int | None, str, str, int | None, int | None, int | None]
NO_POLICY: Final[Policy] = (None, "total", "UTC", None, None, None)

#: Each budget kind's change to (reserved, spent, held).
DELTAS: Final[dict[str, Callable[[dict[str, Any]], Counters]]] = {
    "budget.reserved": lambda d: (d["amount"], 0, 0),
    "budget.settled": lambda d: (-d["reserved"], d["actual"], 0),
    "budget.released": lambda d: (-d["amount"], 0, 0),
    "budget.held": lambda d: (-d["amount"], 0, d["amount"]),
    "budget.unheld": lambda d: (0, d["spent"], -d["amount"]),
    "budget.corrected": lambda d: (0, d["actual"] - d["settled"], 0),
}
_NAMES: Final = ("reserved", "spent", "held")
#: The periods of a call admitted in none (never written to: only compared).
_NO_PERIODS: Final[Mapping[str, str]] = {}


@dataclass
class Node:
    """One budget node's counters in one period (nano-dollars)."""

    reserved: int = 0
    spent: int = 0
    held: int = 0

    def row(self) -> Counters:
        """``(reserved, spent, held)``."""
        return (self.reserved, self.spent, self.held)


def lineage(path: str) -> list[str]:
    """``"a/b"`` → ``["a", "a/b"]``: the node itself and every ancestor."""
    parts = path.split("/")
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def policy_from(data: dict[str, Any]) -> Policy:
    """The policy a ``budget.limit_set`` declares (fields it lacks take their old defaults)."""
    return (
        data["limit"],
        str(data.get("period", "total")),
        str(data.get("tz", "UTC")),
        data.get("rpm"),
        data.get("tpm"),
        data.get("concurrency"),
    )


class Budgets:
    """Every budget node, folded from the events."""

    def __init__(self) -> None:
        self.nodes: dict[tuple[str, str], Node] = {}
        self.policies: dict[str, Policy] = {}
        #: Each path whose limit an operator tool (generation 0) changed last, with that
        #: event's number: what ``serve``'s config may not override (config/precedence.py).
        self.operator_set: dict[str, int] = {}
        self._call_periods: dict[str, Mapping[str, str]] = {}

    def feed(
        self,
        seq: int,
        kind: str,
        data: dict[str, Any],
        at: float = 0.0,
        call: str | None = None,
        generation: int | None = None,
    ) -> list[str]:
        """Apply one event; returns what is wrong with the money it moves. ``generation``:
        its writer's, for a ``budget.limit_set`` (0: an operator tool)."""
        if kind == "budget.limit_set":
            path, policy = str(data["path"]), policy_from(data)
            before = self.policies.get(path)
            if generation == 0 and (before is None or before[0] != policy[0]):
                self.operator_set[path] = seq
            self.policies[path] = policy
            return []
        delta = DELTAS.get(kind)
        if delta is None:
            return []
        budget = str(data["budget"])
        recorded = {str(k): str(v) for k, v in dict(data.get("periods", {})).items()}
        problems = self._check_periods(seq, kind, budget, recorded, at, call)
        change = delta(data)
        for path in lineage(budget):
            period = recorded.get(path, "total")
            node = self.nodes.setdefault((path, period), Node())
            limit = self.policies.get(path, NO_POLICY)[0]
            if kind == "budget.reserved" and limit is not None:
                committed = node.reserved + node.spent + node.held
                if committed + change[0] > limit:
                    problems.append(
                        f"event {seq}: budget {path!r}{_in(period)}: a reservation of "
                        f"{change[0]} takes it past its limit {limit} (already committed "
                        f"{committed})"
                    )
            for name, amount in zip(_NAMES, change, strict=True):
                value = getattr(node, name) + amount
                if value < 0:
                    problems.append(f"event {seq}: budget {path!r}: {name} falls below zero")
                    value = 0
                setattr(node, name, value)
        return problems

    def _check_periods(
        self,
        seq: int,
        kind: str,
        budget: str,
        recorded: dict[str, str],
        at: float,
        call: str | None,
    ) -> list[str]:
        """A call's first reservation names the periods it was admitted in; later budget
        events of the call name the same ones."""
        key = call or ""
        admitted = self._call_periods.get(key)
        if admitted is None and kind == "budget.reserved":
            expected = {}
            for path in lineage(budget):
                _, period_kind, tz, *_ = self.policies.get(path, NO_POLICY)
                if period_kind != "total":
                    expected[path] = self._admitted_in(path, period_kind, tz, at, recorded)
            # Most calls are admitted in no period: they share one empty mapping (a
            # verify keeps every call's until its last event).
            self._call_periods[key] = admitted = expected or _NO_PERIODS
        if admitted is not None and recorded != admitted:
            return [
                f"event {seq}: {kind} names periods {recorded} but the call was admitted in "
                f"{admitted}"
            ]
        return []

    def _admitted_in(
        self, path: str, kind: str, tz: str, at: float, recorded: Mapping[str, str]
    ) -> str:
        """The period a reservation at ``at`` belongs to: the one containing ``at``, or the
        next one if it starts within a minute and already holds money events of ``path``
        (a clock stepped back across its start). In that case the one containing ``at``
        is accepted too, when the reservation names it: releases before writer format 1
        charged it (docs/operations.md, "Mixed versions"), and their ledgers are honest."""
        here, ahead = period_of(kind, tz, at), period_of(kind, tz, at + _KEPT_BACK_S)
        if ahead == here or (path, ahead) not in self.nodes:
            return here
        return here if recorded.get(path) == here else ahead


def _in(period: str) -> str:
    return "" if period == "total" else f" in period {period}"
