"""Small inline SVG charts: pure functions from numbers to markup, nothing loaded.

The chart is a stacked bar per day with one colour per series; its legend is the
page's table (same colours), so the SVG itself stays small and readable.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from decimal import Decimal

from effectguard.ingress.admin.markup import attr, esc, usd
from effectguard.rules.money import NANOS_PER_USD

#: Distinguishable colours (Okabe-Ito and friends); series beyond them share the last.
PALETTE = (
    "#3a6fd8",
    "#e69f00",
    "#009e73",
    "#cc79a7",
    "#56b4e9",
    "#d55e00",
    "#7f7f7f",
    "#b8a300",
)
WIDTH, HEIGHT = 960, 260
_LEFT, _BOTTOM, _TOP = 100, 28, 12


def colour(i: int) -> str:
    """The colour of the ``i``-th series."""
    return PALETTE[min(i, len(PALETTE) - 1)]


def stacked_bars(labels: Sequence[str], series: Mapping[str, Sequence[int]], *, title: str) -> str:
    """A stacked bar chart: one bar per label, one segment per series (nano-dollars)."""
    totals = [sum(values[i] for values in series.values()) for i in range(len(labels))]
    top = max(totals, default=0) or 1
    plot_h = HEIGHT - _BOTTOM - _TOP
    step = (WIDTH - _LEFT - 10) / max(1, len(labels))
    bar_w = max(2.0, step * 0.7)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'width="100%" role="img" aria-label="{attr(title)}"><title>{esc(title)}</title>',
        _axis(top, plot_h),
    ]
    for i, label in enumerate(labels):
        x = _LEFT + i * step + (step - bar_w) / 2
        base = float(HEIGHT - _BOTTOM)
        for n, (name, values) in enumerate(series.items()):
            h = values[i] / top * plot_h
            if h <= 0:
                continue
            base -= h
            tip = f"{label} {name}: {usd(values[i])}"
            parts.append(
                f'<rect x="{x:.1f}" y="{base:.1f}" width="{bar_w:.1f}" height="{h:.1f}" '
                f'fill="{colour(n)}"><title>{esc(tip)}</title></rect>'
            )
        if len(labels) <= 16 or i % max(1, len(labels) // 12) == 0:
            parts.append(
                f'<text x="{x + bar_w / 2:.1f}" y="{HEIGHT - 10}" text-anchor="middle">'
                f"{esc(label)}</text>"
            )
    parts.append("</svg>")
    return "".join(parts)


def _axis(top: int, plot_h: float) -> str:
    """The baseline and three gridlines labelled in USD."""
    lines = []
    for fraction in (0.0, 0.5, 1.0):
        y = HEIGHT - _BOTTOM - fraction * plot_h
        amount = axis_usd(int(top * fraction))
        lines.append(
            f'<line x1="{_LEFT}" x2="{WIDTH - 10}" y1="{y:.1f}" y2="{y:.1f}" '
            f'stroke="#d5d9e1"/><text x="{_LEFT - 6}" y="{y + 4:.1f}" '
            f'text-anchor="end">{esc(amount)}</text>'
        )
    return "".join(lines)


def axis_usd(nanos: int) -> str:
    """An axis label: USD to three significant digits (``$0.0000128``, ``$12.5``)."""
    if nanos <= 0:
        return "$0"
    amount = Decimal(nanos) / NANOS_PER_USD
    places = max(2, 2 - amount.adjusted())
    return f"${amount:.{places}f}"


def use_bar(used: int, limit: int | None) -> str:
    """A budget node's use against its limit as a small bar (empty without a limit)."""
    if not limit:
        return '<span class="muted">no limit</span>' if limit is None else ""
    share = used / limit
    over = " over" if share > 1 else ""
    width = min(100.0, share * 100)
    return (
        f'<span class="bar" title="{share:.0%} of the limit"><i class="{over.strip()}" '
        f'style="width:{width:.1f}%"></i></span> {share:.0%}'
    )
