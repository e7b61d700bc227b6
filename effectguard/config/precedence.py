"""Which budget limit holds when the config file and the ledger disagree.

The rule: **a limit an operator set in the ledger wins.** ``effectguard budget set``
is a deliberate act on the running system, recorded in the hash chain; a restart
must not undo it silently. The config file's ``[budgets]`` seeds (and keeps in step)
every path no operator has set: such a path follows the file, as it always did, so
editing the file and restarting still changes it. For a path an operator has set,
``serve`` keeps the ledger's limit and warns at start when the file says otherwise;
running ``budget set`` with the file's value (or removing the path from the file)
ends the warning.

"Set by an operator" means the ledger holds a ``budget.limit_set`` for the path written
by an operator tool (generation 0, never a worker); the limits ``serve`` seeds from the
file are written by its worker. An archive moves those events out of the live ledger;
its checkpoint carries what they said (``operator_limits`` in its state, which
``verify`` re-derives), so the rule holds across archives.

Whoever sets a limit, one below what the node has already spent in its current period
is set all the same, with a warning (:func:`overspent`): ``budget set`` prints it,
``serve`` logs it for each limit it writes from the file.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from effectguard.rules.budget import BudgetNode
from effectguard.rules.events import StoredEvent
from effectguard.rules.money import nanos_to_usd
from effectguard.rules.periods import TOTAL


@dataclass(frozen=True, slots=True)
class LimitPlan:
    """What ``serve`` does with ``[budgets]`` at start: limits to write, warnings to give."""

    apply: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def operator_limits(
    events: Iterable[StoredEvent],
    carried: Mapping[str, int] | None = None,
    limits: Mapping[str, int | None] | None = None,
) -> dict[str, int]:
    """Each path's last ``budget.limit_set`` by an operator (generation 0) that changed its
    limit, by sequence number.

    ``budget set PATH --rpm N`` writes the node's whole policy with its limit unchanged;
    that sets a rate, not the limit, so it does not take the limit away from the file.
    After an archive, ``events`` are the live ones and the checkpoint says what came
    before: ``carried`` (the paths an operator had set, with that event's number) and
    ``limits`` (each path's limit at the cut).
    """
    found: dict[str, int] = dict(carried or {})
    last: dict[str, object] = dict(limits or {})
    for stored in events:
        if stored.kind != "budget.limit_set":
            continue
        path, limit = str(stored.data["path"]), stored.data.get("limit")
        if stored.generation == 0 and (path not in last or last[path] != limit):
            found[path] = stored.seq
        last[path] = limit
    return found


def carried_limits(state: Mapping[str, Any]) -> tuple[dict[str, int], dict[str, int | None]]:
    """What an archive checkpoint's ``state`` says of limits, for :func:`operator_limits`:
    the paths an operator had set, by event number, and each path's limit at the cut.

    A checkpoint written before 2026-12-04 does not say who set a limit: each path with a
    policy then counts as set by an operator (event number 0, "not recorded"), so the
    config file never loosens a limit it cannot tell was its own. ``verify`` folds the
    same rule (ops/audit/checkpoint.seed), so later checkpoints carry it on.
    """
    limits = {str(row[0]): row[1] for row in state.get("policies", [])}
    if "operator_limits" in state:
        return {str(path): int(seq) for path, seq in state["operator_limits"]}, limits
    return dict.fromkeys(limits, 0), limits


def _usd(limit: int | None) -> str:
    return "no limit" if limit is None else f"{nanos_to_usd(limit)} USD"


def plan_limits(
    configured: Mapping[str, int],
    current: Mapping[str, int | None],
    by_operator: Mapping[str, int],
) -> LimitPlan:
    """Apply ``configured`` limits to paths no operator set; warn where one did and differs.

    ``current`` is each existing node's limit in the ledger.
    """
    plan = LimitPlan()
    for path, limit in sorted(configured.items()):
        have = current.get(path)
        if path not in by_operator:
            if path not in current or have != limit:
                plan.apply[path] = limit
            continue
        if have != limit:
            seq = by_operator[path]
            who = (
                f"an operator set {_usd(have)} with `effectguard budget set` (ledger event {seq})"
                if seq
                else f"the ledger's limit, {_usd(have)}, was set before an archive made by a "
                "release that did not record who set it, so it is kept as an operator's"
            )
            plan.warnings.append(
                f"budget {path!r}: the config's [budgets] says {_usd(limit)}, but {who}; "
                f"the ledger's limit stays. To use the config's, run `effectguard budget set "
                f"{path} --limit {nanos_to_usd(limit)}`; or remove {path!r} from [budgets]."
            )
    return plan


def overspent(node: BudgetNode) -> str | None:
    """The warning for a node (in its current period) whose limit is below what that
    period has already spent; ``None`` when it has room or no limit."""
    if node.limit is None or node.spent <= node.limit:
        return None
    # A total period never ends: telling the operator to wait would be wrong.
    until = "its limit is raised" if node.period == TOTAL else "the period ends"
    return (
        f"budget {node.path!r} has already spent {nanos_to_usd(node.spent)} USD in period "
        f"{node.period}, more than its new limit of {nanos_to_usd(node.limit)} USD; it "
        f"admits no call until {until}"
    )
