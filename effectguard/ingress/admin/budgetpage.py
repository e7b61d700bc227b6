"""The operator page's budget tree: each node's use against its limit, a few levels at a time.

Takes values read from the ledger and returns a page body; reads nothing itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from urllib.parse import quote

from effectguard.ingress.admin import charts
from effectguard.ingress.admin.markup import PREFIX, attr, esc, table, usd
from effectguard.rules.budget import BudgetNode, BudgetPolicy
from effectguard.rules.budgetview import tree_order
from effectguard.rules.periods import TOTAL

#: Levels of the budget tree a page shows below the node it opens (the roots at the top).
BUDGET_LEVELS = 2
#: Most nodes a budget page lists; the rest are counted, and reached by opening a node.
BUDGET_ROWS = 500


def budget_tree(
    nodes: Sequence[BudgetNode],
    policies: Mapping[str, BudgetPolicy],
    *,
    under: str | None = None,
    count: int | None = None,
) -> str:
    """The nodes at ``under`` and below it (the whole tree's top without it), as
    ``Ledger.budget_tree`` gives them: parents before children, each in its current period
    with its use against its limit; each name opens the tree below that node. ``count``:
    how many nodes those levels hold, of which ``nodes`` are the first."""
    head = f"<h1>Budgets</h1>{_trail(under)}"
    if not nodes:
        empty = "No budget has been used yet." if under is None else "No budget node here."
        return f'{head}<p class="empty">{esc(empty)}</p>'
    base = 0 if under is None else under.count("/")
    ordered = sorted(nodes, key=tree_order)[:BUDGET_ROWS]
    rows = [_budget_row(n, policies.get(n.path), base, n.path != under) for n in ordered]
    note = (
        '<p class="muted">A call is charged to its budget and every ancestor; use counts '
        "spent, reserved and held money against the node's limit, in the node's current "
        f"period (a day, week or month of its own time zone). {BUDGET_LEVELS} levels are "
        "shown: open a node to see the nodes below it.</p>"
    )
    more = ""
    if (hidden := max(len(nodes), count or 0) - len(rows)) > 0:
        more = (
            f'<p class="flash error">{hidden} more nodes at these levels '
            "are not listed: open a node to see its part of the tree.</p>"
        )
    headings = ["budget", "period", "limit", "spent", "reserved", "held", "room"]
    headings.append("use (spent+reserved+held)")
    return f"{head}{note}{more}{table(headings, rows, (2, 3, 4, 5, 6))}"


def _budget_link(path: str, text: str) -> str:
    return f'<a href="{PREFIX}budgets?under={attr(quote(path, safe="/"))}">{esc(text)}</a>'


def _trail(under: str | None) -> str:
    """Where the page stands in the tree: the top, then each ancestor of ``under``."""
    if under is None:
        return ""
    parts = under.split("/")
    steps = [f'<a href="{PREFIX}budgets">all budgets</a>']
    steps += [_budget_link("/".join(parts[: i + 1]), p) for i, p in enumerate(parts[:-1])]
    steps.append(esc(parts[-1]))
    return f"<p>{' / '.join(steps)}</p>"


def _budget_row(node: BudgetNode, policy: BudgetPolicy | None, base: int, link: bool) -> list[str]:
    name = node.path.rsplit("/", 1)[-1]
    shown = _budget_link(node.path, name) if link else esc(name)
    indent = (node.path.count("/") - base) * 18
    return [
        f'<span style="padding-left:{indent}px" title="{attr(node.path)}">{shown}</span>',
        esc(_period(node, policy)),
        usd(node.limit),
        usd(node.spent),
        usd(node.reserved),
        usd(node.held),
        usd(node.room),
        charts.use_bar(node.committed, node.limit),
    ]


def _period(node: BudgetNode, policy: BudgetPolicy | None) -> str:
    # A label alone ("2026-12-04") does not say whose day it is: a node in
    # Australia/Lord_Howe is a day ahead of one in UTC for half of every day.
    if node.period == TOTAL or policy is None:
        return node.period
    return f"{node.period} ({policy.tz})"
