"""The events that move a call's money on its budgets, and an operator's budget policy.

Import them from :mod:`effectguard.rules.events`, which registers every kind.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from effectguard.rules.eventbase import CallEvent, Event


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetReserved(CallEvent):
    """``amount`` reserved on ``budget`` and all its ancestors."""

    kind: ClassVar[str] = "budget.reserved"
    budget: str
    amount: int
    #: The attempt's token estimate (prompt bytes + output bound), for ``tpm`` limits.
    tokens: int = 0
    #: The period of each ancestor budget that is not ``total``, fixed at admission.
    periods: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetSettled(CallEvent):
    """The reservation ``reserved`` is released and ``actual`` is spent."""

    kind: ClassVar[str] = "budget.settled"
    budget: str
    reserved: int
    actual: int
    flagged: str | None = None
    #: Input + output tokens the provider reported (None: not believed), for ``tpm``.
    tokens: int | None = None
    #: The period of each ancestor budget that is not ``total``, fixed at admission.
    periods: dict[str, str] = field(default_factory=dict)

    @property
    def overshoot(self) -> int:
        """How far the actual cost went past the reservation (0 if it did not)."""
        return max(0, self.actual - self.reserved)


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetReleased(CallEvent):
    """The reservation is released with nothing spent (not sent, not processed)."""

    kind: ClassVar[str] = "budget.released"
    budget: str
    amount: int
    #: The period of each ancestor budget that is not ``total``, fixed at admission.
    periods: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetHeld(CallEvent):
    """The effect is unknown: the reservation moves to ``held``."""

    kind: ClassVar[str] = "budget.held"
    budget: str
    amount: int
    #: The period of each ancestor budget that is not ``total``, fixed at admission.
    periods: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetUnheld(CallEvent):
    """A reconcile resolves a hold: ``held -= amount``, ``spent += spent``."""

    kind: ClassVar[str] = "budget.unheld"
    budget: str
    amount: int
    spent: int
    #: The period of each ancestor budget that is not ``total``, fixed at admission.
    periods: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetCorrected(CallEvent):
    """A reconcile corrects a settled charge: ``spent -= settled``, ``spent += actual``.

    A ``failed`` call was settled at ``settled`` (its reservation); reconciled not applied,
    ``actual`` is 0 and the money comes back; applied with cost C, ``actual`` is C.
    """

    kind: ClassVar[str] = "budget.corrected"
    budget: str
    settled: int
    actual: int
    #: The period of each ancestor budget that is not ``total``, fixed at admission.
    periods: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetLimitSet(Event):
    """An operator set a budget node's policy: its limit (``None``: none), period and rates."""

    kind: ClassVar[str] = "budget.limit_set"
    path: str
    limit: int | None
    #: The rest of the node's policy (events written before periods existed lack them).
    period: str = "total"
    tz: str = "UTC"
    rpm: int | None = None
    tpm: int | None = None
    concurrency: int | None = None
