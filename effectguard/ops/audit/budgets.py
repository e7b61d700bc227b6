"""The budget tree, re-derived by the verifier's own arithmetic (SPEC §5).

A call's budget event changes its path and every ancestor: ``budget.reserved``
adds to ``reserved``; ``budget.settled`` moves the reservation to ``spent`` (at the
actual cost); ``budget.released`` drops it; ``budget.held`` moves it to ``held``;
``budget.unheld`` drops a hold and spends the decided cost; ``budget.corrected``
replaces a settled charge. A counter never goes below zero in a sound ledger, and a
reservation never takes a limited node past its limit: both are checked here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

Counters = tuple[int, int, int]  # reserved, spent, held

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


@dataclass
class Node:
    """One budget node's limit and counters (nano-dollars)."""

    limit: int | None = None
    reserved: int = 0
    spent: int = 0
    held: int = 0

    def row(self) -> tuple[int | None, int, int, int]:
        """``(limit, reserved, spent, held)``."""
        return (self.limit, self.reserved, self.spent, self.held)


def lineage(path: str) -> list[str]:
    """``"a/b"`` → ``["a", "a/b"]``: the node itself and every ancestor."""
    parts = path.split("/")
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


class Budgets:
    """Every budget node, folded from the events."""

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}

    def feed(self, seq: int, kind: str, data: dict[str, Any]) -> list[str]:
        """Apply one event; returns what is wrong with the money it moves."""
        if kind == "budget.limit_set":
            self.nodes.setdefault(str(data["path"]), Node()).limit = data["limit"]
            return []
        delta = DELTAS.get(kind)
        if delta is None:
            return []
        change = delta(data)
        problems = []
        for path in lineage(str(data["budget"])):
            node = self.nodes.setdefault(path, Node())
            if kind == "budget.reserved" and node.limit is not None:
                committed = node.reserved + node.spent + node.held
                if committed + change[0] > node.limit:
                    problems.append(
                        f"event {seq}: budget {path!r}: a reservation of {change[0]} takes it "
                        f"past its limit {node.limit} (already committed {committed})"
                    )
            for name, amount in zip(_NAMES, change, strict=True):
                value = getattr(node, name) + amount
                if value < 0:
                    problems.append(f"event {seq}: budget {path!r}: {name} falls below zero")
                    value = 0
                setattr(node, name, value)
        return problems
