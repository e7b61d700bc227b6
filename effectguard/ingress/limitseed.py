"""``serve``'s start: apply the config's ``[budgets]`` under the precedence rule.

See :mod:`effectguard.config.precedence` for the rule; this module reads the ledger,
writes the limits the plan says, and warns (on stderr, through logging) where an
operator's limit and the config file disagree, and where a limit it wrote is below
what the node has already spent in its current period (as ``budget set`` warns).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from effectguard.config.precedence import operator_limits, overspent, plan_limits
from effectguard.ledger import Ledger, Writer

log = logging.getLogger("effectguard.ingress.limitseed")


async def seed_limits(ledger: Ledger, configured: Mapping[str, int], writer: Writer) -> list[str]:
    """Write the config's limits the ledger should follow; returns the warnings given."""
    current = {n.path: n.limit for n in await ledger.budgets()}
    by_operator = operator_limits(await ledger.store.limit_events())
    plan = plan_limits(configured, current, by_operator)
    for path, limit in plan.apply.items():
        await ledger.set_limit(path, limit, writer=writer)
    warnings = list(plan.warnings)
    if plan.apply:
        now = {n.path: n for n in await ledger.budgets()}  # each node's current period
        for path in plan.apply:
            if (warning := overspent(now[path])) is not None:
                warnings.append(f"{warning} (set from the config's [budgets])")
    for warning in warnings:
        log.warning("%s", warning)
    return warnings
