"""The operator page's pages: unknown calls, one call, the budget tree, spend.

Each function takes values read from the ledger and returns a page body (markup);
none reads the ledger, a clock or a request itself.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

from effectguard.ingress.admin import charts
from effectguard.ingress.admin.markup import (
    PREFIX,
    age,
    attr,
    csrf_field,
    esc,
    table,
    usd,
    when,
)
from effectguard.ingress.admin.spend import SpendTable
from effectguard.rules import evidence
from effectguard.rules.bodyref import REF_ENCODING, describe_ref
from effectguard.rules.budget import BudgetNode, BudgetPolicy
from effectguard.rules.budgetview import tree_order
from effectguard.rules.events import AttemptLateAnswer, StoredEvent
from effectguard.rules.guidance import against_applied
from effectguard.rules.liveness import may_still_answer
from effectguard.rules.periods import TOTAL
from effectguard.rules.resendfirst import resend_first
from effectguard.rules.workstate import WorkState

#: Longest request or response body shown on a call's page (the rest is cut, and said so).
BODY_SHOWN = 20_000
#: Event kinds that bear on whether the effect happened, beside any kind not listed in
#: ``_ROUTINE`` (kinds added later show up as evidence rather than being hidden).
_EVIDENCE = {"attempt.observed", "attempt.interrupted", "attempt.not_sent", "call.reconciled"}
_ROUTINE = {
    "call.manifest",
    "attempt.started",
    "budget.reserved",
    "budget.settled",
    "budget.released",
    "budget.held",
    "budget.unheld",
    "call.completed",
    "call.refused",
}


def call_link(call_id: str) -> str:
    """A link to a call's page."""
    return f'<a href="{PREFIX}calls/{attr(call_id)}"><code>{esc(call_id)}</code></a>'


def stage_badge(stage: str) -> str:
    """A call's stage as a coloured label."""
    return f'<span class="stage {attr(stage)}">{esc(stage)}</span>'


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


def _pretty(text: str, encoding: str) -> str:
    """A stored body for reading: JSON pretty-printed, cut at :data:`BODY_SHOWN`."""
    if encoding == REF_ENCODING:  # an upload kept in the body store: named, not shown
        return describe_ref(text, None)
    if encoding != "utf8":
        return f"({len(text)} characters of {encoding}-encoded bytes)"
    with contextlib.suppress(ValueError, RecursionError):  # not JSON (or too deep): as it is
        text = json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    if len(text) > BODY_SHOWN:
        return text[:BODY_SHOWN] + f"\n… ({len(text) - BODY_SHOWN} more characters not shown)"
    return text


def _data(event: StoredEvent) -> str:
    """An event's data without its stored body, compactly."""
    data = {k: v for k, v in event.data.items() if k != "body"}
    return json.dumps(data, ensure_ascii=False, sort_keys=True)


def _summary(
    state: WorkState, manifest: dict[str, Any], now: float, warning: str | None, gone: str | None
) -> str:
    # As `calls` and `show` print it: a call whose owner is gone waits for nothing.
    shown = evidence.shown_next(state, warning, gone)
    fields = [
        ("stage", stage_badge(state.stage)),
        ("effect", esc(state.effect)),
        ("next operation", esc(shown)),
        ("provider", esc(state.provider)),
        ("endpoint", esc(f"{manifest.get('method', '')} {manifest.get('endpoint', '')}")),
        ("model", esc(state.model)),
        ("budget", esc(state.budget)),
        ("idempotency key", esc(state.idempotency_key)),
        ("admitted", f"{esc(when(state.created_at))} ({age(now - state.created_at)} ago)"),
        ("attempts", str(state.attempts)),
        ("reserved at admission", usd(state.reserved_at_admission)),
        ("held", usd(state.held)),
        ("cost", usd(state.settled_cost)),
        ("status", esc(state.status)),
        ("flagged", esc(state.flagged)),
    ]
    if gone is not None:
        owner = f"worker {state.worker} is gone ({gone}): a decision below takes the call over"
        fields.insert(3, ("owner", esc(owner + " first, and it becomes effect_unknown")))
    rows = "".join(f"<tr><th>{esc(k)}</th><td>{v}</td></tr>" for k, v in fields)
    return f"<table>{rows}</table>"


def _attempts(events: Sequence[StoredEvent]) -> str:
    ends = {
        (e.data.get("attempt")): e
        for e in events
        if e.kind in ("attempt.observed", "attempt.not_sent", "attempt.interrupted")
    }
    rows = []
    for e in events:
        if e.kind != "attempt.started":
            continue
        end = ends.get(e.data.get("attempt"))
        if end is None:
            outcome = "still in flight"
        elif end.kind == "attempt.observed":
            outcome = f"answered {end.data.get('status')}"
        else:
            outcome = f"{end.kind.removeprefix('attempt.')}: {end.data.get('reason', '')}"
        rows.append(
            [
                esc(e.data.get("attempt")),
                esc(when(e.at)),
                esc(e.data.get("worker")),
                esc(e.data.get("provider_idempotency_key")),
                esc(outcome),
                esc(when(end.at)) if end is not None else "-",
            ]
        )
    headings = ["#", "started", "worker", "provider key sent", "how it ended", "ended"]
    return table(headings, rows) if rows else '<p class="empty">No attempt was started.</p>'


def _evidence(events: Sequence[StoredEvent]) -> str:
    items = []
    for e in events:
        if e.kind not in _EVIDENCE and e.kind in _ROUTINE:
            continue
        body = ""
        if "body" in e.data:
            text = _pretty(str(e.data["body"]), str(e.data.get("body_encoding", "utf8")))
            body = f"<pre>{esc(text)}</pre>"
        items.append(
            f"<li><b>{esc(e.kind)}</b> #{e.seq} at {esc(when(e.at))} by {esc(e.worker)}"
            f"<br><code>{esc(_data(e))}</code>{body}</li>"
        )
    if not items:
        return '<p class="empty">No evidence recorded yet.</p>'
    return "<ul>" + "".join(items) + "</ul>"


def _events(events: Sequence[StoredEvent]) -> str:
    rows = [
        [str(e.seq), esc(when(e.at)), esc(e.kind), esc(e.worker), f"<code>{esc(_data(e))}</code>"]
        for e in events
    ]
    return table(["seq", "at", "kind", "worker", "data"], rows, (0,))


def _request(manifest: dict[str, Any]) -> str:
    headers = manifest.get("headers") or {}
    head = "".join(f"{k}: {v}\n" for k, v in sorted(headers.items()))
    body = _pretty(str(manifest.get("body", "")), str(manifest.get("body_encoding", "utf8")))
    line = f"{manifest.get('method', '')} {manifest.get('endpoint', '')}\n"
    return f"<pre>{esc(line + head)}</pre><pre>{esc(body)}</pre>"


#: The decisions an operator can record, as the CLI's ``reconcile`` offers them:
#: name -> (button text, what it means for the money).
DECISIONS: dict[str, tuple[str, str]] = {
    "not_applied": (
        "Not applied",
        "The provider did not perform it: the held money is released and the key "
        "may be sent once more.",
    ),
    "applied": (
        "Applied",
        "The provider performed it: the cost (default: what is held) is spent.",
    ),
}


def _decide_forms(
    state: WorkState,
    csrf: str,
    warning: str | None,
    gone: str | None,
    applied: AttemptLateAnswer | None = None,
    resend: str | None = None,
) -> str:
    """The decisions open (``warning``: why the call must not be resent, if it must not;
    ``gone``: why the owner of a call in flight will not finish it; ``applied``: a late
    answer that says the provider applied the call (evidence.applied_unknown), which
    puts "Applied" first and "Not applied" behind a warning, as ``show`` offers them;
    ``resend``: the keyed resend inside the provider's window, offered first, as ``show``
    offers it)."""
    if warning is not None and state.next_operation != "reconcile":
        return (
            f'<p class="flash error">Nothing to decide: this call is {esc(state.stage)}, '
            f"but {esc(warning)}.</p>"
        )
    if state.next_operation != "reconcile" and gone is None:
        return (
            f'<p class="muted">Nothing to decide: this call is {esc(state.stage)} '
            f"(next operation: {esc(state.next_operation)}).</p>"
        )
    forms = [_taking_over(gone)] if gone is not None else []
    if resend is not None:  # settles the call without a guess, where the client can
        forms.append(
            f'<p class="flash">First: {esc(resend)}. Decide below only if that client '
            "cannot resend.</p>"
        )
    if warning is not None:  # its authorized resend is void; the decision is still open
        forms.append(f'<p class="flash error">{esc(warning)}; decide it below.</p>')
    names = list(DECISIONS)
    if applied is not None:
        first = ", or ".join(evidence.applied_first(state.call_id, state.attempts, applied))
        if applied.attempt == state.attempts:  # bare commands: say why they come first
            first = (
                f"the late answer kept for attempt {applied.attempt} (status "
                f"{applied.status}) says the provider applied the call: {first}"
            )
        forms.append(f'<p class="flash error">{esc(first)}.</p>')
        names.reverse()  # "Applied" first
    # What the operator was told a decision does: for an owner gone by its lease, that it
    # records nothing else (refused still if the call was taken over since it was shown).
    seen = "" if gone is None else f'<input type="hidden" name="owner_gone" value="{attr(gone)}">'
    for name in names:
        against = None
        if name == "not_applied" and applied is not None:
            against = against_applied(applied.attempt, applied.status)
        forms.append(_decision_form(state, csrf, name, seen, against))
    return "".join(forms)


def _decision_form(state: WorkState, csrf: str, name: str, seen: str, against: str | None) -> str:
    """One decision's form (``seen``: the hidden owner-gone field; ``against``: the
    warning that the evidence says otherwise, shown first in the form)."""
    label, meaning = DECISIONS[name]
    cost = ""
    if name == "applied":
        cost = (
            "<label>Cost in USD (empty: the held amount, "
            f'{usd(state.held)}) <input type="text" name="cost" id="cost-{name}" '
            'inputmode="decimal" placeholder="0.0123"></label>'
        )
    warned = "" if against is None else f'<p class="flash error">{esc(against)}.</p>'
    return (
        f'<form class="decide" method="post" id="reconcile-{name}" '
        f'action="{PREFIX}calls/{attr(state.call_id)}/reconcile">{csrf_field(csrf)}{warned}'
        f'<input type="hidden" name="decision" value="{name}">'
        # What the operator saw: a decision about this attempt, refused once another
        # has been sent (the call may have been decided and resent meanwhile).
        f'<input type="hidden" name="attempt" value="{state.attempts}">{seen}'
        f'<b>{esc(label)}</b> <span class="muted">{esc(meaning)}</span>{cost}'
        f'<label>Note (required: how you know) <textarea name="note" id="note-{name}" '
        f'rows="2" required></textarea></label>'
        f'<button class="primary" type="submit" id="submit-{name}">'
        f"Record: {esc(label.lower())}</button></form>"
    )


def _taking_over(gone: str) -> str:
    """What a decision does first for a call in flight whose owner is gone (``gone``: why),
    as ``effectguard reconcile`` does it."""
    if may_still_answer(gone):
        return (
            '<p class="flash error">Its worker is gone by its lease alone: it may still be '
            "running (paused, overloaded, or on another host) and receive the provider's "
            "answer. A decision takes the call over and records nothing else; look for a "
            "late answer here (reload this page), then decide.</p>"
        )
    return (
        '<p class="muted">A decision first takes the call over from its gone worker '
        "(it becomes effect_unknown), then is recorded.</p>"
    )


def _when_shown(at: float) -> str | None:
    """:func:`when`, or None for a time no date can show."""
    with contextlib.suppress(ValueError, OverflowError, OSError):
        return when(at)
    return None


def call_page(
    state: WorkState,
    events: Sequence[StoredEvent],
    *,
    now: float,
    csrf: str,
    owner_gone: str | None = None,
) -> str:
    """One call: its state, request, attempts, evidence, events and the decisions open.
    ``owner_gone``: why the worker of a call in flight will not finish it (None: it may)."""
    manifest = next((e.data for e in events if e.kind == "call.manifest"), {})
    warning = evidence.resend_warning(state, evidence.applied_late(events))
    applied = evidence.applied_unknown(state, events)
    resend = resend_first(state, events, now, _when_shown)
    return (
        f"<h1>Call <code>{esc(state.call_id)}</code> {stage_badge(state.stage)}</h1>"
        f"{_summary(state, manifest, now, warning, owner_gone)}"
        f"<h2>Decide</h2>{_decide_forms(state, csrf, warning, owner_gone, applied, resend)}"
        f"<h2>Evidence</h2>{_evidence(events)}"
        f"<h2>Attempts</h2>{_attempts(events)}"
        f"<h2>Request</h2>{_request(manifest)}"
        f"<h2>Events</h2>{_events(events)}"
    )


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
