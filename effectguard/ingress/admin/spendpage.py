"""The operator page's spend: per day by provider and model, as a chart and totals.

Takes a :class:`SpendTable` built from the ledger and returns a page body.
"""

from __future__ import annotations

from effectguard.ingress.admin import charts
from effectguard.ingress.admin.markup import PREFIX, esc, table, usd, when
from effectguard.ingress.admin.spend import SpendTable


def spend(spending: SpendTable, *, days: int, partial_from: float | None) -> str:
    """Spend per day by provider and model, as a chart and a table of totals."""
    names = spending.series()
    choose = " · ".join(f'<a href="{PREFIX}spend?days={d}">{d} days</a>' for d in (7, 14, 30, 90))
    head = f"<h1>Spend, last {days} days (UTC)</h1><p>{choose}</p>"
    if partial_from is not None:
        head += (
            '<p class="flash error">Only calls admitted since '
            f"{esc(when(partial_from))} were read; older days may show less.</p>"
        )
    if not names:
        return head + '<p class="empty">No money was spent or held in this window.</p>'
    labels = [d.strftime("%m-%d") for d in spending.days]
    chart = charts.stacked_bars(
        labels,
        {n: spending.spent.get(n, [0] * len(labels)) for n in names},  # legend order = colours
        title="spend per day",
    )
    rows = [
        [
            f'<span style="color:{charts.colour(i)}">■</span> {esc(name)}',
            str(spending.calls.get(name, 0)),
            usd(spending.total(name)),
            usd(spending.held.get(name, 0)),
        ]
        for i, name in enumerate(names)
    ]
    totals = table(["provider/model", "calls", "spent", "held now"], rows, (1, 2, 3))
    return f"{head}<figure>{chart}</figure>{totals}"
