"""Spend over time by provider and model: a pure fold over calls' projected money.

A call's money is charged to the day (UTC) it was admitted, as budget periods do
(docs/contract.md §12): its settled cost (or the cost its reconciliation recorded) as ``spent``,
and what an unknown effect still holds as ``held``. A call is anything with those
fields: the ledger's :class:`~effectguard.ledger.CallSpend` (what the page reads) or a
whole :class:`~effectguard.rules.workstate.WorkState`.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

DAY_S = 86400


@dataclass(frozen=True, slots=True)
class SpendTable:
    """Money per day and per ``provider/model`` series, in nano-dollars."""

    days: tuple[dt.date, ...]
    #: series name -> one amount per day in ``days``
    spent: dict[str, list[int]] = field(default_factory=dict)
    held: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def total(self, series: str) -> int:
        """All spent money of one series in the window."""
        return sum(self.spent.get(series, ()))

    def series(self) -> list[str]:
        """Series names, the largest spender first."""
        names = set(self.spent) | set(self.held)
        return sorted(names, key=lambda s: (-self.total(s), -self.held.get(s, 0), s))


class Spending(Protocol):
    """What the chart reads of a call."""

    @property
    def created_at(self) -> float: ...
    @property
    def provider(self) -> str: ...
    @property
    def model(self) -> str | None: ...
    @property
    def cost(self) -> int | None: ...
    @property
    def held(self) -> int: ...


def series_name(state: Spending) -> str:
    """A call's series: ``provider/model`` (``provider/-`` without a model)."""
    return f"{state.provider}/{state.model or '-'}"


def day_of(at: float) -> dt.date:
    """The UTC day of a ledger time."""
    return dt.datetime.fromtimestamp(at, dt.UTC).date()


def spend_by_day(calls: Iterable[Spending], *, now: float, days: int) -> SpendTable:
    """The last ``days`` days (ending today, UTC) of spend per provider and model."""
    last = day_of(now)
    window = tuple(last - dt.timedelta(days=days - 1 - i) for i in range(days))
    index = {day: i for i, day in enumerate(window)}
    table = SpendTable(window)
    for state in calls:
        slot = index.get(day_of(state.created_at))
        if slot is None or not (state.cost or state.held):
            continue
        name = series_name(state)
        row = table.spent.setdefault(name, [0] * days)
        row[slot] += state.cost or 0
        table.held[name] = table.held.get(name, 0) + state.held
        table.calls[name] = table.calls.get(name, 0) + 1
    return table
