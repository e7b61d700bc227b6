"""The budget gauges: each budget's limit and counters in its current period (docs/contract.md §10).

The ledger keeps counters per period; :meth:`effectguard.ledger.Ledger.budgets` picks each
node's current one, so these gauges start over when a day, week or month does, and
``effectguard_budget_period_end_timestamp_seconds`` says when that will be.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from prometheus_client.core import GaugeMetricFamily, Metric

from effectguard.rules import periods
from effectguard.rules.budget import BudgetNode, BudgetPolicy
from effectguard.rules.money import nanos_to_decimal


def period_ends(
    nodes: list[BudgetNode], policies: Mapping[str, BudgetPolicy]
) -> Iterator[tuple[str, float]]:
    """``(path, end)`` of each node's current period, for nodes with a calendar period."""
    for node in nodes:
        policy = policies.get(node.path)
        bounds = None if policy is None else periods.bounds(node.period, policy.tz)
        if bounds is not None:
            yield node.path, bounds[1]


def budget_gauges(
    nodes: Iterable[BudgetNode], ends: Iterable[tuple[str, float]]
) -> Iterator[Metric]:
    """Each shown budget's limit and counters in its current period, and when it ends."""

    def gauge(name: str, doc: str) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, doc, labels=["budget"])

    families = {
        field: gauge(f"effectguard_budget_{field}_usd", doc)
        for field, doc in (
            ("limit", "A budget's limit in USD (only budgets with a limit; ledger)."),
            ("reserved", "USD reserved by calls in flight under a budget (ledger)."),
            ("spent", "USD settled under a budget in its current period (ledger)."),
            ("held", "USD held by effect-unknown calls under a budget (ledger)."),
        )
    }
    for node in nodes:
        if node.limit is not None:
            families["limit"].add_metric([node.path], _usd(node.limit))
        families["reserved"].add_metric([node.path], _usd(node.reserved))
        families["spent"].add_metric([node.path], _usd(node.spent))
        families["held"].add_metric([node.path], _usd(node.held))
    yield from families.values()
    end_gauge = gauge(
        "effectguard_budget_period_end_timestamp_seconds",
        "When a budget's current period ends and its counters start over (Unix time; "
        "budgets with a day, week or month period; the budget gauges show this period).",
    )
    for path, end in ends:
        end_gauge.add_metric([path], end)
    yield end_gauge


def _usd(nanos: int) -> float:
    """Nano-dollars as float USD: only here, at the exposition edge."""
    return float(nanos_to_decimal(nanos))
