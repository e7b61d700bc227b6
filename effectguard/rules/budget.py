"""Budget-tree arithmetic (SPEC §5), pure.

Budgets are paths (``team-a``, ``team-a/run-42``). A charge to a path is a
charge to it and every ancestor. Each node carries a limit (or none) and three
counters in nano-dollars: ``reserved``, ``spent`` and ``held``. Counters are a
fold of budget events (:func:`deltas`), saturating at zero, so replaying the
ledger reproduces them exactly.
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

    Nodes missing from ``nodes`` are unlimited. Returns the first (root-most)
    node that would overflow, or ``None`` when the charge fits everywhere.
    """
    for p in ancestors(path):
        node = nodes.get(p)
        if node is None or node.limit is None:
            continue
        if node.committed + amount > node.limit:
            return Exceeded(path=p, limit=node.limit, room=node.room or 0, amount=amount)
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
    """Apply ``delta`` to one node, saturating every counter at zero."""
    return replace(
        node,
        reserved=max(0, node.reserved + delta.reserved),
        spent=max(0, node.spent + delta.spent),
        held=max(0, node.held + delta.held),
    )


def apply(nodes: dict[str, BudgetNode], event: Event) -> list[BudgetNode]:
    """Fold ``event`` into ``nodes`` in place; return the nodes it changed."""
    if isinstance(event, BudgetLimitSet):
        node = replace(nodes.get(event.path) or BudgetNode(event.path), limit=event.limit)
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
