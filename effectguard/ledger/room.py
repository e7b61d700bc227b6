"""Whether a call has room: each budget on its path, in its own period, read and checked
inside the admission transaction (so a boundary or a concurrent admission cannot slip
between the check and the reservation).
"""

from __future__ import annotations

from effectguard.errors import Refusal
from effectguard.ledger.base import Tx
from effectguard.rules import budget as budgets
from effectguard.rules.admission import AdmitRequest
from effectguard.rules.budget import BudgetNode, BudgetPolicy
from effectguard.rules.guidance import ended_period_way_out
from effectguard.rules.money import nanos_to_usd
from effectguard.rules.periods import TOTAL, bounds
from effectguard.rules.workstate import WorkState


def admission_periods(
    tx: Tx,
    policies: dict[str, BudgetPolicy],
    budget: str,
    now: float,
    existing: WorkState | None = None,
) -> dict[str, str]:
    """The period of each ancestor of ``budget`` that an attempt admitted at ``now`` is
    charged to. A later attempt of ``existing`` goes where the call was admitted. A new
    call goes to the period containing ``now``, unless the next one starts within a
    minute and has already charged the node: the clock was then stepped back across the
    boundary, and charging the earlier period would open its room a second time
    (docs/contract.md §5.5). Only in a period's last minute does this read anything."""
    if existing is not None:
        return existing.periods
    labels = budgets.labels_at(policies, budget, now)
    ahead = budgets.labels_ahead(policies, budget, now)
    if ahead:
        started = tx.get_nodes(list(ahead.items()))
        labels.update({p: label for p, label in ahead.items() if (p, label) in started})
    return labels


def period_nodes(
    tx: Tx, budget: str, periods: dict[str, str], policies: dict[str, BudgetPolicy] | None = None
) -> dict[str, BudgetNode]:
    """Each ancestor of ``budget`` in its period (``periods``), with its limit."""
    paths = budgets.ancestors(budget)
    if policies is None:
        policies = tx.get_policies(paths)
    counters = tx.get_nodes([(p, periods.get(p, TOTAL)) for p in paths])
    return budgets.period_nodes(policies, counters, budget, periods)


def budget_refusal(
    tx: Tx,
    req: AdmitRequest,
    policies: dict[str, BudgetPolicy],
    budget: str,
    periods: dict[str, str],
    call_id: str,
    amount: int,
    now: float,
) -> Refusal | None:
    """Why ``budget`` cannot take ``amount`` more in its periods (docs/contract.md §5), or
    None. A later attempt refused in a period that has ended at ``now`` is told so."""
    nodes = period_nodes(tx, budget, periods, policies)
    if not req.create_budgets and budget not in policies and nodes[budget].committed == 0:
        return Refusal(
            403, "unknown_budget", f"budget {budget!r} is not configured", call_id=call_id
        )
    exceeded = budgets.check_admission(nodes, budget, amount)
    if exceeded is None:
        return None
    label, policy = periods.get(exceeded.path), policies.get(exceeded.path)
    span = None if label is None or policy is None else bounds(label, policy.tz)
    ended = span is not None and now >= span[1]
    tail = ended_period_way_out(exceeded.path, label) if ended and label else ""
    return _exceeded(exceeded, periods, "; this call reserves", call_id, tail=tail)


def _exceeded(
    exceeded: budgets.Exceeded,
    periods: dict[str, str],
    what: str,
    call_id: str,
    state: WorkState | None = None,
    tail: str = "",
) -> Refusal:
    """402 ``budget_exceeded``, naming the node, its room (in its period) and the amount
    (then ``tail``, what else the client should know)."""
    label = periods.get(exceeded.path)
    return Refusal(
        402,
        "budget_exceeded",
        f"budget {exceeded.path!r} has {nanos_to_usd(exceeded.room)} USD of room"
        f"{'' if label is None else f' in period {label}'}{what} "
        f"{nanos_to_usd(exceeded.amount)} USD{tail}",
        call_id=call_id,
        stage=None if state is None else state.stage,
        next_operation=None if state is None else state.next_operation,
    )


def retry_refusal(tx: Tx, state: WorkState, reserve: int) -> Refusal | None:
    """Why an automatic retry of ``state`` cannot reserve ``reserve`` in its admission's
    periods, or None when it can."""
    nodes = period_nodes(tx, state.budget, state.periods)
    exceeded = budgets.check_admission(nodes, state.budget, reserve)
    if exceeded is None:
        return None
    return _exceeded(exceeded, state.periods, " for a retry that reserves", state.call_id, state)
