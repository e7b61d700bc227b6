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

from effectguard.config.precedence import LimitPlan, operator_limits, overspent, plan_limits
from effectguard.ledger import Ledger, Writer
from effectguard.rules.money import nanos_to_usd

log = logging.getLogger("effectguard.ingress.limitseed")

#: Plans made before giving up on a node that keeps changing under them (its ledger
#: limit then stays, and a warning says so): one more than operators racing a start need.
PLANS = 3


async def seed_limits(ledger: Ledger, configured: Mapping[str, int], writer: Writer) -> list[str]:
    """Write the config's limits the ledger should follow; returns the warnings given."""
    written: list[str] = []
    plan = LimitPlan()
    unknown: dict[str, int | None] = {}
    for _ in range(PLANS):
        policies = await ledger.policies()
        by_operator, unknown = await _operator_limits(ledger)
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
        if path in unknown and unknown[path] != configured[path]:
            warnings.append(_unknown_setter(path, unknown[path], configured[path]))
        # The node alone, in its current period: a ledger with a node per run has
        # millions, and a start must not read them.
        (node,) = await ledger.budgets(under=path, depth=path.count("/") + 1)
        if (warning := overspent(node)) is not None:
            warnings.append(f"{warning} (set from the config's [budgets])")
    for warning in warnings:
        log.warning("%s", warning)
    return warnings


async def _operator_limits(ledger: Ledger) -> tuple[dict[str, int], dict[str, int | None]]:
    """The paths whose limit an operator set, by the event that set it: from the live
    events and, for those an archive moved out, what its checkpoint says they held. And,
    where that checkpoint was made by a release that did not carry it (before
    2026-12-04), the limits of paths no live event set since: who set them is unknown."""
    cuts = await ledger.store.checkpoint_events()
    state = cuts[-1].data.get("state", {}) if cuts else {}
    carried = {str(path): int(seq) for path, seq in state.get("operator_limits", [])}
    limits = {str(row[0]): row[1] for row in state.get("policies", [])}
    events = await ledger.store.limit_events()
    unknown: dict[str, int | None] = {}
    if cuts and "operator_limits" not in state:
        since = {str(e.data["path"]) for e in events}
        unknown = {path: limit for path, limit in limits.items() if path not in since}
    return operator_limits(events, carried, limits), unknown


def _unknown_setter(path: str, had: int | None, limit: int) -> str:
    """The warning for a limit the config replaced whose setter an old archive hid."""
    before = "no limit" if had is None else f"{nanos_to_usd(had)} USD"
    return (
        f"budget {path!r}: the config's [budgets] replaced its limit of {before} with "
        f"{nanos_to_usd(limit)} USD; the ledger's last archive was made by an earlier "
        "release, which did not record who set that limit. If an operator did, restore it "
        f"with `effectguard budget set {path} "
        f"{'--no-limit' if had is None else '--limit ' + nanos_to_usd(had)}`."
    )
