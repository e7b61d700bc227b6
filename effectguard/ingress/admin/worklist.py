"""The operator page's start page: the calls waiting for an operator.

Effect-unknown calls (each waits for a decision) and calls in flight whose worker is
gone (each waits for a sweep or a decision). Each function takes values read from the
ledger and returns a page body; none reads the ledger, a clock or a request itself.
"""

from __future__ import annotations

from collections.abc import Sequence

from effectguard.ingress.admin.markup import PREFIX, age, attr, esc, table, usd, when
from effectguard.rules.workstate import WorkState


def call_link(call_id: str) -> str:
    """A link to a call's page."""
    return f'<a href="{PREFIX}calls/{attr(call_id)}"><code>{esc(call_id)}</code></a>'


def unknown_calls(calls: Sequence[WorkState], *, now: float, total: int, held: int) -> str:
    """Effect-unknown calls, oldest first, with their age and the money they hold;
    ``total`` and ``held`` count every unknown call, ``calls`` may be only the oldest."""
    intro = (
        f"<p>{total} call(s) whose effect is unknown, holding {usd(held)}. "
        "Each waits for a decision: open it, look at the evidence, and reconcile it.</p>"
    )
    if not calls:
        return (
            '<h1>Unknown-effect calls</h1><p class="empty">No call is waiting for a decision.</p>'
        )
    rows = [
        [
            call_link(c.call_id),
            age(now - c.created_at),
            f'<span title="{attr(when(c.created_at))}">{esc(when(c.created_at))}</span>',
            usd(c.held),
            esc(c.budget),
            esc(c.provider),
            esc(c.model),
            esc(c.idempotency_key),
            str(c.attempts),
        ]
        for c in calls
    ]
    headings = ["call", "age", "admitted", "held", "budget", "provider", "model", "key", "attempts"]
    more = (
        f'<p class="muted">Only the oldest {len(calls)} are shown; '
        "<code>effectguard calls --state effect_unknown</code> lists more.</p>"
        if total > len(calls)
        else ""
    )
    return f"<h1>Unknown-effect calls</h1>{intro}{table(headings, rows, (1, 3, 8))}{more}"


def gone_owner_calls(calls: Sequence[tuple[WorkState, str]], *, now: float, more: bool) -> str:
    """Calls in flight whose worker is gone, each with why: nothing waits for them but a
    sweep, and a decision on the call's page takes the worker over first."""
    if not calls:
        return ""
    rows = [
        [
            call_link(c.call_id),
            esc(why),
            f"<code>{esc(c.worker)}</code>",
            age(now - c.created_at),
            esc(c.budget),
            esc(c.provider),
            esc(c.model),
            esc(c.idempotency_key),
        ]
        for c, why in calls
    ]
    headings = ["call", "owner gone", "worker", "age", "budget", "provider", "model", "key"]
    intro = (
        f"<p>{len(calls)} call(s) in flight whose worker will not finish them. A sweep "
        "marks them effect unknown; a decision on a call's page takes its worker over first.</p>"
    )
    shown = (
        f'<p class="muted">Only {len(calls)} are shown; <code>effectguard calls --state '
        "in_flight</code> lists every call in flight, <code>effectguard show</code> names "
        "a call's gone owner.</p>"
        if more
        else ""
    )
    return f"<h1>In flight, worker gone</h1>{intro}{table(headings, rows, (3,))}{shown}"
