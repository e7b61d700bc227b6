"""Which period of each budget node an operator asked to see. Pure.

The stores keep counters per ``(path, period)``. A view picks one period per node:
the one containing an instant (each node in its own timezone), the one containing a
local date, or a label named outright (the nodes whose period has labels of that form,
and those charged in that period under an earlier policy).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import date

from effectguard.rules import periods
from effectguard.rules.budget import BudgetNode, BudgetPolicy, is_under


def view_periods(
    policies: Mapping[str, BudgetPolicy],
    at: float,
    label: str | None = None,
    on: date | None = None,
) -> frozenset[str]:
    """The period labels :func:`budget_view` can read of a node that has a policy, given
    the same arguments: of such a node, a store need return no other counter row.

    A node with no policy has only the default policy's counters (admission charges a
    node in its policy's period), and the view reads every row it has: stores return
    those whatever their label (see ``LedgerStore.budget_nodes``).
    """
    if label is not None:
        return frozenset((label,))
    calendars = {(p.period, p.tz) for p in policies.values()}  # few, however many nodes
    if on is not None:
        return frozenset(periods.label_of_date(kind, on) for kind, _ in calendars)
    return frozenset(periods.label(kind, tz, at) for kind, tz in calendars)


def budget_view(
    policies: Mapping[str, BudgetPolicy],
    counters: Iterable[BudgetNode],
    at: float,
    label: str | None = None,
    on: date | None = None,
) -> list[BudgetNode]:
    """Every node (by path) in the period ``label`` names, else containing ``on``, else ``at``."""
    by_key = {n.key: n for n in counters}
    kind_wanted = None if label is None else periods.kind_of_label(label)
    out = []
    for path in sorted(set(policies) | {path for path, _ in by_key}):
        policy = policies.get(path) or BudgetPolicy(path)
        # A node shows a named period when it resets on that kind of period now, or when it
        # was charged in that period under an earlier policy: a node moved from day to
        # month keeps its past days' charges, and they must stay visible.
        if kind_wanted is not None and policy.period != kind_wanted and (path, label) not in by_key:
            continue
        if label is not None:
            chosen = label
        elif on is not None:
            chosen = periods.label_of_date(policy.period, on)
        else:
            chosen = policy.label(at)
        node = by_key.get((path, chosen)) or BudgetNode(path, period=chosen)
        out.append(replace(node, limit=policy.limit))
    return out


@dataclass(frozen=True, slots=True)
class Policyless:
    """Of the budget nodes that have no policy (one counter row each, period ``total``),
    the few with the most money committed, and how many there are with what they hold.

    Such nodes are what a client makes by naming a new budget (without proxy keys, one
    per header it invents), so a reader that ranks them reads ``top`` and two aggregates,
    never every node."""

    top: tuple[BudgetNode, ...]
    count: int
    total: BudgetNode


def ranking_key(node: BudgetNode) -> tuple[bool, int, str]:
    """Budgets with a limit first (an operator set them: they are the ones watched), then
    by money committed, most first, then by path."""
    return (node.limit is None, -node.committed, node.path)


def top_nodes(
    shown: list[BudgetNode], limit: int, policyless: Policyless | None, other: str
) -> list[BudgetNode]:
    """The ``limit`` nodes ranked first (:func:`ranking_key`) of ``shown`` and the nodes
    ``policyless`` counts, then the rest summed as a node named ``other``; every node, by
    path, if there are no more than ``limit``. ``policyless.top`` must be that set's first
    ``limit`` (or all of it): no node outside it can rank among the first ``limit``."""
    candidates = shown + list(policyless.top if policyless else ())
    count = len(shown) + (policyless.count if policyless else 0)
    if count <= limit:
        return sorted(candidates, key=lambda n: n.path)
    kept = sorted(candidates, key=ranking_key)[:limit]
    everything = [*shown, policyless.total] if policyless else shown
    rest = BudgetNode(
        other,
        reserved=sum(n.reserved for n in everything) - sum(n.reserved for n in kept),
        spent=sum(n.spent for n in everything) - sum(n.spent for n in kept),
        held=sum(n.held for n in everything) - sum(n.held for n in kept),
    )
    return [*kept, rest]


def tree_order(node: BudgetNode) -> list[str]:
    """The budget tree's order: segment by segment, a parent before its children."""
    return node.path.split("/")


def ways_to(declared: Iterable[str], under: str | None, depth: int) -> set[str]:
    """The paths of a tree's shown levels (fewer than ``depth`` ``/``, at ``under`` or below
    it) on the way to a node that has a policy, that node included. A charge reaches every
    ancestor and a policy does not: without them, a node declared but never charged could
    not be reached from the top of the tree."""
    out = set()
    for path in declared:
        if under is not None and not is_under(path, under):
            continue
        parts = path.split("/")
        for i in range(min(len(parts), depth)):
            ancestor = "/".join(parts[: i + 1])
            if under is None or is_under(ancestor, under):
                out.add(ancestor)
    return out
