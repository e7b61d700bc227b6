"""Spend over time by provider and model: a pure fold over calls' projected money.

A call's money is charged to the day (UTC) it was admitted, as budget periods do
(docs/contract.md §12): its settled cost (or the cost its reconciliation recorded) as ``spent``,
and what an unknown effect still holds as ``held``. The page reads the ledger's sums per
day, provider and model (:class:`~effectguard.ledger.SpendSums`, summed by the database)
and lays them out with :func:`spend_table`; :func:`spend_by_day` does the same for any
calls with those fields (a :class:`~effectguard.ledger.CallSpend` or a whole
:class:`~effectguard.rules.workstate.WorkState`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from effectguard.ledger.base import DAY_S, CallSpend, DaySpend, sum_spend

__all__ = [
    "DAY_S",
    "SPEND_SERIES",
    "SpendTable",
    "day_of",
    "series_name",
    "spend_by_day",
    "spend_table",
    "top_series",
]

#: Most series the page shows apart (picked as the largest spenders); the rest are summed
#: into one ``other`` series. A client names the model, and every dated snapshot
#: (``gpt-4o-mini-20240101``) is priced as its base but kept as sent: without a bound each
#: name it invents would add a series, a table row and a bar segment per day.
SPEND_SERIES = 20


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


def series_name(group: DaySpend) -> str:
    """A group's series: ``provider/model`` (``provider/-`` without a model)."""
    return f"{group.provider}/{group.model or '-'}"


def day_of(at: float) -> dt.date:
    """The UTC day of a ledger time."""
    return dt.datetime.fromtimestamp(at, dt.UTC).date()


def spend_by_day(calls: Iterable[Spending], *, now: float, days: int) -> SpendTable:
    """The last ``days`` days (ending today, UTC) of spend per provider and model."""
    spends = (CallSpend(c.created_at, c.provider, c.model, c.cost, c.held) for c in calls)
    return spend_table(sum_spend(spends).days, now=now, days=days)


def spend_table(sums: Iterable[DaySpend], *, now: float, days: int) -> SpendTable:
    """The last ``days`` days (ending today, UTC) of the ledger's sums per day, provider
    and model; series without money in the window are left out."""
    last = day_of(now)
    window = tuple(last - dt.timedelta(days=days - 1 - i) for i in range(days))
    epoch = dt.date(1970, 1, 1)
    index = {(day - epoch).days: i for i, day in enumerate(window)}
    table = SpendTable(window)
    for group in sums:
        slot = index.get(group.day)
        if slot is None or not group.calls:
            continue
        name = series_name(group)
        row = table.spent.setdefault(name, [0] * days)
        row[slot] += group.spent
        table.held[name] = table.held.get(name, 0) + group.held
        table.calls[name] = table.calls.get(name, 0) + group.calls
    return table


def top_series(table: SpendTable, limit: int = SPEND_SERIES) -> SpendTable:
    """``table`` with at most ``limit`` series of its own: the largest spenders, and the
    others summed into one series, ``other (N series)`` (no ``provider/model`` has that
    name: it holds no ``/``)."""
    names = table.series()
    if len(names) <= limit:
        return table
    kept, rest = names[:limit], names[limit:]
    other = f"other ({len(rest)} series)"
    capped = SpendTable(table.days)
    for name in kept:
        capped.spent[name] = table.spent.get(name, [0] * len(table.days))
        capped.held[name] = table.held.get(name, 0)
        capped.calls[name] = table.calls.get(name, 0)
    zero = [0] * len(table.days)
    rows = [table.spent.get(n, zero) for n in rest]
    capped.spent[other] = [sum(row[i] for row in rows) for i in range(len(table.days))]
    capped.held[other] = sum(table.held.get(n, 0) for n in rest)
    capped.calls[other] = sum(table.calls.get(n, 0) for n in rest)
    return capped
