"""How appended events move the stored budget policies and per-period counters.

Run by :func:`effectguard.ledger.operations.append` for every event it seals, so the
stored rows are a fold of the events by construction.
"""

from __future__ import annotations

import dataclasses

from effectguard.ledger.base import Tx
from effectguard.rules import budget as budgets
from effectguard.rules.events import (
    BudgetCorrected,
    BudgetHeld,
    BudgetLimitSet,
    BudgetReleased,
    BudgetReserved,
    BudgetSettled,
    BudgetUnheld,
    Event,
)
from effectguard.rules.workstate import WorkState

_LATER_BUDGET_EVENTS = (
    BudgetReserved,
    BudgetSettled,
    BudgetReleased,
    BudgetHeld,
    BudgetUnheld,
    BudgetCorrected,
)


def in_admission_periods(event: Event, state: WorkState) -> Event:
    """A call's later budget event, charged to the periods its admission recorded.

    Settlement, release, hold and reconcile are written by parts of the call path that
    do not know periods; the ledger stamps them here, so they land where the call was
    admitted even after a period boundary.
    """
    if isinstance(event, _LATER_BUDGET_EVENTS) and not event.periods and state.periods:
        return dataclasses.replace(event, periods=dict(state.periods))
    return event


def fold_budget(tx: Tx, tree: budgets.Tree, event: Event, changed: set[budgets.Key]) -> None:
    """Fold one event into the batch's budget counters (and policies)."""
    if isinstance(event, BudgetLimitSet):
        tree.apply(event)
        tx.put_policy(tree.policies[event.path])
        return
    delta = budgets.deltas(event)
    if delta is None:
        return
    keys = delta.targets()
    missing = [k for k in keys if k not in tree.nodes]
    if missing:
        tree.nodes.update(tx.get_nodes(missing))
    changed.update(n.key for n in tree.apply_delta(delta))
