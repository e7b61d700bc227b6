"""Budget-tree arithmetic (docs/contract.md §5), pure.

Budgets are paths (``team-a``, ``team-a/run-42``). A charge to a path is a
charge to it and every ancestor. Each node carries a limit (or none) and three
counters in nano-dollars: ``reserved``, ``spent`` and ``held``. Counters are a
fold of budget events (:func:`deltas`), saturating at zero and at
:data:`~effectguard.rules.money.MAX_NANOS` (what a stored 64-bit counter holds), so
replaying the ledger reproduces them exactly and no counter can overflow its column.
Admission refuses a charge that would take any node on its path past that bound, so in
practice the upper saturation is never reached.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Final

from effectguard.rules import periods
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
from effectguard.rules.money import MAX_CALL_NANOS, MAX_NANOS
from effectguard.rules.periods import DEFAULT_TZ, TOTAL, PeriodKind
from effectguard.rules.quickinit import quick_init

#: Where one node's counters for one period are kept: ``(path, period label)``.
Key = tuple[str, str]

DEFAULT_BUDGET: Final = "default"
_SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MAX_DEPTH: Final = 8
#: Characters of an invalid path an error message repeats.
_SHOWN: Final = 80


def validate_path(path: str) -> str:
    """Return ``path`` if it is a valid budget path, else raise ``ValueError``.

    A path is 1–8 ``/``-separated segments of letters, digits, ``.``, ``_`` and
    ``-`` (each starting with a letter or digit, at most 64 characters).
    """
    segments = path.split("/")
    if not path or len(segments) > MAX_DEPTH or not all(_SEGMENT.fullmatch(s) for s in segments):
        # Shown cut short: a client's 30 KB header came back whole in its 400.
        shown = path if len(path) <= _SHOWN else path[:_SHOWN] + "…"
        raise ValueError(
            f"invalid budget path {shown!r}: use 1-{MAX_DEPTH} '/'-separated segments of "
            "letters, digits, '.', '_' and '-'"
        )
    return path


def ancestors(path: str) -> list[str]:
    """``"a/b/c"`` → ``["a", "a/b", "a/b/c"]`` (root first, the path itself last)."""
    return list(_ancestors(path))


@functools.lru_cache(maxsize=4096)
def _ancestors(path: str) -> tuple[str, ...]:
    # A request asks for its budget's ancestors about thirteen times (admission,
    # settlement, the folds); there are few budgets.
    parts = path.split("/")
    return tuple("/".join(parts[: i + 1]) for i in range(len(parts)))


def root_of(path: str) -> str:
    """The root segment of a budget path."""
    return path.split("/", 1)[0]


def is_under(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or lies below it."""
    return path == root or path.startswith(root + "/")


@dataclass(frozen=True, slots=True)
class BudgetPolicy:
    """What an operator declared for one node: its limit, its period and its rate limits.

    ``limit`` applies to each period on its own; ``rpm`` (requests per minute), ``tpm``
    (tokens per minute) and ``concurrency`` (calls in flight) are checked at admission.
    """

    path: str
    limit: int | None = None
    period: PeriodKind = "total"
    tz: str = DEFAULT_TZ
    rpm: int | None = None
    tpm: int | None = None
    concurrency: int | None = None

    def label(self, at: float) -> str:
        """The label of this node's period containing instant ``at``."""
        return periods.label(self.period, self.tz, at)

    @property
    def rate_limited(self) -> bool:
        """Whether any rate limit is declared."""
        return self.rpm is not None or self.tpm is not None or self.concurrency is not None


@quick_init
@dataclass(frozen=True, slots=True)
class BudgetNode:
    """One node of the budget tree in one period: its limit and that period's counters."""

    path: str
    limit: int | None = None
    reserved: int = 0
    spent: int = 0
    held: int = 0
    period: str = TOTAL

    @property
    def key(self) -> Key:
        """Where the node's counters are kept: ``(path, period label)``."""
        return (self.path, self.period)

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
    """Whether ``amount`` fits under every limited node on ``path`` (docs/contract.md §5).

    Nodes missing from ``nodes`` are unlimited. Every node, limited or not, also
    has the bound :data:`MAX_NANOS` (its stored counters must not overflow), and one
    call may reserve at most :data:`MAX_CALL_NANOS`. Returns the first (root-most)
    node that would overflow, or ``None`` when the charge fits everywhere.
    """
    for p in ancestors(path):
        node = nodes.get(p) or BudgetNode(p)
        bound = MAX_NANOS if node.limit is None else min(node.limit, MAX_NANOS)
        if node.committed + amount > bound or amount > MAX_CALL_NANOS:
            room = max(0, min(bound - node.committed, MAX_CALL_NANOS))
            return Exceeded(path=p, limit=bound, room=room, amount=amount)
    return None


@quick_init
@dataclass(frozen=True, slots=True)
class Delta:
    """A change to the counters of one path and all its ancestors, each in its own period.

    ``periods`` names the period of each ancestor that is not ``total`` (as admission
    recorded it); an ancestor it does not name is charged to ``total``.
    """

    path: str
    reserved: int = 0
    spent: int = 0
    held: int = 0
    periods: Mapping[str, str] = field(default_factory=dict)

    def targets(self) -> list[Key]:
        """Every ``(path, period)`` the change lands on, root first."""
        return [(p, self.periods.get(p, TOTAL)) for p in ancestors(self.path)]


def deltas(event: Event) -> Delta | None:
    """The counter change a budget event makes (``None`` for other events)."""
    if isinstance(event, BudgetReserved):
        return Delta(event.budget, reserved=event.amount, periods=event.periods)
    if isinstance(event, BudgetSettled):
        return Delta(
            event.budget, reserved=-event.reserved, spent=event.actual, periods=event.periods
        )
    if isinstance(event, BudgetReleased):
        return Delta(event.budget, reserved=-event.amount, periods=event.periods)
    if isinstance(event, BudgetHeld):
        return Delta(event.budget, reserved=-event.amount, held=event.amount, periods=event.periods)
    if isinstance(event, BudgetUnheld):
        return Delta(event.budget, held=-event.amount, spent=event.spent, periods=event.periods)
    if isinstance(event, BudgetCorrected):
        return Delta(event.budget, spent=event.actual - event.settled, periods=event.periods)
    return None


def _saturated(value: int) -> int:
    return min(MAX_NANOS, max(0, value))


def validate_limit(limit: int | None) -> int | None:
    """Return ``limit`` if a counter can hold it (``0..MAX_NANOS``), else raise ``ValueError``."""
    if limit is not None and not 0 <= limit <= MAX_NANOS:
        raise ValueError(f"a budget limit must be between 0 and {MAX_NANOS} nano-dollars")
    return limit


def validate_policy(policy: BudgetPolicy) -> BudgetPolicy:
    """Return ``policy`` if every part of it is valid, else raise ``ValueError``."""
    validate_path(policy.path)
    validate_limit(policy.limit)
    periods.validate_kind(policy.period)
    periods.validate_zone(policy.tz)
    for name in ("rpm", "tpm", "concurrency"):
        value = getattr(policy, name)
        if value is not None and not 0 <= value <= MAX_NANOS:
            raise ValueError(f"{name} must be between 0 and {MAX_NANOS}")
    return policy


def policy_of(event: BudgetLimitSet) -> BudgetPolicy:
    """The policy a ``budget.limit_set`` event declares (it always carries all of it)."""
    limit = None if event.limit is None else _saturated(event.limit)
    return BudgetPolicy(
        event.path,
        limit,
        periods.validate_kind(event.period),
        event.tz,
        event.rpm,
        event.tpm,
        event.concurrency,
    )


@dataclass
class Tree:
    """The budget tree as a fold of events: each node's policy and its per-period counters.

    A counter node's ``limit`` is its policy's at the time it was last changed (the
    stores keep limits with the policy, not with the counters).
    """

    policies: dict[str, BudgetPolicy] = field(default_factory=dict)
    nodes: dict[Key, BudgetNode] = field(default_factory=dict)

    def apply(self, event: Event) -> list[BudgetNode]:
        """Fold ``event`` in; return the counter nodes it changed."""
        if isinstance(event, BudgetLimitSet):
            self.policies[event.path] = policy_of(event)
            return []
        delta = deltas(event)
        return [] if delta is None else self.apply_delta(delta)

    def apply_delta(self, delta: Delta) -> list[BudgetNode]:
        """Fold one event's counter change in; return the counter nodes it changed."""
        changed = []
        for key in delta.targets():
            policy = self.policies.get(key[0])
            old = self.nodes.get(key) or BudgetNode(key[0], period=key[1])
            # Every counter saturates at zero and at MAX_NANOS; the limit is the policy's
            # now. One construction: two replace() calls cost more than the arithmetic.
            node = BudgetNode(
                old.path,
                policy.limit if policy else None,
                _saturated(old.reserved + delta.reserved),
                _saturated(old.spent + delta.spent),
                _saturated(old.held + delta.held),
                old.period,
            )
            self.nodes[key] = node
            changed.append(node)
        return changed

    def node(self, path: str, period: str = TOTAL) -> BudgetNode:
        """``path``'s counters in ``period`` (zero if it has none), with its current limit."""
        policy = self.policies.get(path)
        node = self.nodes.get((path, period)) or BudgetNode(path, period=period)
        return replace(node, limit=policy.limit if policy else None)


def fold(events: Iterable[Event]) -> Tree:
    """The budget tree that a sequence of events produces."""
    tree = Tree()
    for event in events:
        tree.apply(event)
    return tree


def labels_at(policies: Mapping[str, BudgetPolicy], path: str, at: float) -> dict[str, str]:
    """The period each ancestor of ``path`` is in at instant ``at``, for those not ``total``.

    This is what admission records: later budget events of the call land in the same
    periods, whenever they happen.
    """
    out = {}
    for p in ancestors(path):
        policy = policies.get(p)
        if policy is not None and policy.period != "total":
            out[p] = policy.label(at)
    return out


def labels_ahead(policies: Mapping[str, BudgetPolicy], path: str, at: float) -> dict[str, str]:
    """The ancestors of ``path`` whose next period starts within ``KEPT_BACK_S`` after ``at``,
    with that period's label: where an admission at ``at`` goes if the next period has
    already charged the node (the clock was stepped back across its start)."""
    now = labels_at(policies, path, at)
    ahead = labels_at(policies, path, at + periods.KEPT_BACK_S)
    return {p: label for p, label in ahead.items() if now[p] != label}


def period_nodes(
    policies: Mapping[str, BudgetPolicy],
    counters: Mapping[Key, BudgetNode],
    path: str,
    labels: Mapping[str, str],
) -> dict[str, BudgetNode]:
    """Each ancestor of ``path`` in its period (``labels``), with its limit: what
    :func:`check_admission` takes."""
    out = {}
    for p in ancestors(path):
        key = (p, labels.get(p, TOTAL))
        policy = policies.get(p)
        node = counters.get(key) or BudgetNode(p, period=key[1])
        out[p] = replace(node, limit=policy.limit if policy else None)
    return out
