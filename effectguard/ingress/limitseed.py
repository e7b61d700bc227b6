"""``serve``'s start: apply the config's ``[budgets]`` under the precedence rule.

See :mod:`effectguard.config.precedence` for the rule; this module reads the ledger,
writes the limits the plan says, and warns (on stderr, through logging) where an
operator's limit and the config file disagree, and where a limit it wrote is below
what the node has already spent in its current period (as ``budget set`` warns).

The plan is made from reads that come before the writes, and an operator may run
``budget set`` in between (replicas start while operators work). So each limit is
written only while the node's policy is still the one the plan read, in the write's
transaction; a node changed meanwhile makes the plan be made again from a fresh read,
where an operator's new limit wins as it would have had it come first.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from effectguard.config.precedence import (
    LimitPlan,
    carried_limits,
    operator_limits,
    overspent,
    plan_limits,
)
from effectguard.ledger import Ledger, Writer

log = logging.getLogger("effectguard.ingress.limitseed")

#: Plans made before giving up on a node that keeps changing under them (its ledger
#: limit then stays, and a warning says so): one more than operators racing a start need.
PLANS = 3


async def seed_limits(ledger: Ledger, configured: Mapping[str, int], writer: Writer) -> list[str]:
    """Write the config's limits the ledger should follow; returns the warnings given."""
    written: list[str] = []
    plan = LimitPlan()
    for _ in range(PLANS):
        policies = await ledger.policies()
        by_operator = await _operator_limits(ledger)
        current = {path: policy.limit for path, policy in policies.items()}
        plan = plan_limits(configured, current, by_operator)
        changed = [
            path
            for path, limit in plan.apply.items()
            if not await ledger.set_limit_if(path, limit, policies.get(path), writer)
        ]
        written += [path for path in plan.apply if path not in changed]
        if not changed:
            break
    else:
        plan.warnings.append(
            f"budgets {', '.join(map(repr, changed))} changed while serve applied the "
            f"config's [budgets] {PLANS} times; their ledger limits stay"
        )
    warnings = list(plan.warnings)
    for path in dict.fromkeys(written):
        # The node alone, in its current period: a ledger with a node per run has
        # millions, and a start must not read them.
        (node,) = await ledger.budgets(under=path, depth=path.count("/") + 1)
        if (warning := overspent(node)) is not None:
            warnings.append(f"{warning} (set from the config's [budgets])")
    for warning in warnings:
        log.warning("%s", warning)
    return warnings


async def _operator_limits(ledger: Ledger) -> dict[str, int]:
    """The paths whose limit an operator set, by the event that set it: from the live
    events and, for those an archive moved out, what its checkpoint says of them."""
    cuts = await ledger.store.checkpoint_events()
    carried, limits = carried_limits(cuts[-1].data.get("state", {}) if cuts else {})
    return operator_limits(await ledger.store.limit_events(), carried, limits)
