"""Budget-tree arithmetic (SPEC §5), pure.

Budgets are paths (``team-a``, ``team-a/run-42``). A charge to a path is a
charge to it and every ancestor. Each node carries a limit (or none) and three
counters in nano-dollars: ``reserved``, ``spent`` and ``held``. Counters are a
fold of budget events (:func:`deltas`), saturating at zero and at
:data:`~effectguard.rules.money.MAX_NANOS` (what a stored 64-bit counter holds), so
replaying the ledger reproduces them exactly and no counter can overflow its column.
Admission refuses a charge that would take any node on its path past that bound, so in
practice the upper saturation is never reached.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Final

from effectguard.rules.events import (
    BudgetHeld,
    BudgetLimitSet,
    BudgetReleased,
    BudgetReserved,
    BudgetSettled,
    BudgetUnheld,
    Event,
)
from effectguard.rules.money import MAX_CALL_NANOS, MAX_NANOS

DEFAULT_BUDGET: Final = "default"
_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MAX_DEPTH: Final = 8


def validate_path(path: str) -> str:
    """Return ``path`` if it is a valid budget path, else raise ``ValueError``.

    A path is 1–8 ``/``-separated segments of letters, digits, ``.``, ``_`` and
    ``-`` (each starting with a letter or digit, at most 64 characters).
    """
    segments = path.split("/")
    if not path or len(segments) > MAX_DEPTH or not all(_SEGMENT.match(s) for s in segments):
        raise ValueError(
            f"invalid budget path {path!r}: use 1-{MAX_DEPTH} '/'-separated segments of "
            "letters, digits, '.', '_' and '-'"
        )
    return path


def ancestors(path: str) -> list[str]:
    """``"a/b/c"`` → ``["a", "a/b", "a/b/c"]`` (root first, the path itself last)."""
    parts = path.split("/")
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def root_of(path: str) -> str:
    """The root segment of a budget path."""
    return path.split("/", 1)[0]


def is_under(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or lies below it."""
    return path == root or path.startswith(root + "/")


@dataclass(frozen=True, slots=True)
class BudgetNode:
    """One node of the budget tree."""

    path: str
    limit: int | None = None
    reserved: int = 0
    spent: int = 0
    held: int = 0

    @property
    def committed(self) -> int:
        """Money that admission counts against the limit."""
        return self.spent + self.reserved + self.held

    @property
    def room(self) -> int | None:
        """What can still be reserved (None: unlimited)."""
        if self.limit is None:
            return None
        return max(0, self.limit - self.committed)


@dataclass(frozen=True, slots=True)
class Exceeded:
    """Admission refused: ``path`` has only ``room`` left for a charge of ``amount``."""

    path: str
    limit: int
    room: int
    amount: int


def check_admission(nodes: Mapping[str, BudgetNode], path: str, amount: int) -> Exceeded | None:
    """Whether ``amount`` fits under every limited node on ``path`` (SPEC §5).

    Nodes missing from ``nodes`` are unlimited. Every node, limited or not, also
    has the bound :data:`MAX_NANOS` (its stored counters must not overflow), and one
    call may reserve at most :data:`MAX_CALL_NANOS`. Returns the first (root-most)
    node that would overflow, or ``None`` when the charge fits everywhere.
    """
    for p in ancestors(path):
        node = nodes.get(p) or BudgetNode(p)
        bound = MAX_NANOS if node.limit is None else min(node.limit, MAX_NANOS)
        if node.committed + amount > bound or amount > MAX_CALL_NANOS:
            room = max(0, min(bound - node.committed, MAX_CALL_NANOS))
            return Exceeded(path=p, limit=bound, room=room, amount=amount)
    return None


@dataclass(frozen=True, slots=True)
class Delta:
    """A change to the counters of one path and all its ancestors."""

    path: str
    reserved: int = 0
    spent: int = 0
    held: int = 0


def deltas(event: Event) -> Delta | None:
    """The counter change a budget event makes (``None`` for other events)."""
    if isinstance(event, BudgetReserved):
        return Delta(event.budget, reserved=event.amount)
    if isinstance(event, BudgetSettled):
        return Delta(event.budget, reserved=-event.reserved, spent=event.actual)
    if isinstance(event, BudgetReleased):
        return Delta(event.budget, reserved=-event.amount)
    if isinstance(event, BudgetHeld):
        return Delta(event.budget, reserved=-event.amount, held=event.amount)
    if isinstance(event, BudgetUnheld):
        return Delta(event.budget, held=-event.amount, spent=event.spent)
    return None


def apply_delta(node: BudgetNode, delta: Delta) -> BudgetNode:
    """Apply ``delta`` to one node, saturating every counter at zero and at ``MAX_NANOS``."""
    return replace(
        node,
        reserved=_saturated(node.reserved + delta.reserved),
        spent=_saturated(node.spent + delta.spent),
        held=_saturated(node.held + delta.held),
    )


def _saturated(value: int) -> int:
    return min(MAX_NANOS, max(0, value))


def validate_limit(limit: int | None) -> int | None:
    """Return ``limit`` if a counter can hold it (``0..MAX_NANOS``), else raise ``ValueError``."""
    if limit is not None and not 0 <= limit <= MAX_NANOS:
        raise ValueError(f"a budget limit must be between 0 and {MAX_NANOS} nano-dollars")
    return limit


def apply(nodes: dict[str, BudgetNode], event: Event) -> list[BudgetNode]:
    """Fold ``event`` into ``nodes`` in place; return the nodes it changed."""
    if isinstance(event, BudgetLimitSet):
        limit = None if event.limit is None else _saturated(event.limit)
        node = replace(nodes.get(event.path) or BudgetNode(event.path), limit=limit)
        nodes[event.path] = node
        return [node]
    delta = deltas(event)
    if delta is None:
        return []
    changed = []
    for p in ancestors(delta.path):
        node = apply_delta(nodes.get(p) or BudgetNode(p), delta)
        nodes[p] = node
        changed.append(node)
    return changed


def fold(events: Iterable[Event]) -> dict[str, BudgetNode]:
    """The budget tree that a sequence of events produces."""
    nodes: dict[str, BudgetNode] = {}
    for event in events:
        apply(nodes, event)
    return nodes
