"""The operator page's page for one call: its state, evidence, and the decisions open.

Takes values read from the ledger and returns a page body (markup); it reads neither
the ledger, a clock nor a request itself.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from typing import Any

from effectguard.ingress.admin.markup import (
    PREFIX,
    ago,
    attr,
    csrf_field,
    esc,
    table,
    usd,
    when,
)
from effectguard.rules import evidence
from effectguard.rules.bodyref import REF_ENCODING, describe_ref
from effectguard.rules.events import AttemptLateAnswer, StoredEvent
from effectguard.rules.guidance import against_applied
from effectguard.rules.liveness import may_still_answer
from effectguard.rules.lookupfirst import lookup_first
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


def stage_badge(stage: str) -> str:
    """A call's stage as a coloured label."""
    return f'<span class="stage {attr(stage)}">{esc(stage)}</span>'


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
        ("admitted", f"{esc(when(state.created_at))} ({ago(now - state.created_at)})"),
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
    lookup: str | None = None,
) -> str:
    """The decisions open (``warning``: why the call must not be resent, if it must not;
    ``gone``: why the owner of a call in flight will not finish it; ``applied``: a late
    answer that says the provider applied the call (evidence.applied_unknown), which
    puts "Applied" first and "Not applied" behind a warning, as ``show`` offers them;
    ``resend``: the keyed resend inside the provider's window, offered first, as ``show``
    offers it; ``lookup``: asking the provider's lookup, offered before the decisions,
    as ``show`` offers it)."""
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
    if lookup is not None:  # decides the call by the provider's word, where it can tell
        then = "Or" if resend is not None else "First"
        forms.append(
            f'<p class="flash">{then}: {esc(lookup)}. Decide below only if the lookup '
            "cannot tell.</p>"
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
    lookup_s: float | None = None,
) -> str:
    """One call: its state, request, attempts, evidence, events and the decisions open.
    ``owner_gone``: why the worker of a call in flight will not finish it (None: it may);
    ``lookup_s``: the search lag of the lookup declared for it (None: none is)."""
    manifest = next((e.data for e in events if e.kind == "call.manifest"), {})
    warning = evidence.resend_warning(state, evidence.applied_late(events))
    applied = evidence.applied_unknown(state, events)
    resend = resend_first(state, events, now, _when_shown)
    lookup = lookup_first(state, events, lookup_s, now, _when_shown)
    return (
        f"<h1>Call <code>{esc(state.call_id)}</code> {stage_badge(state.stage)}</h1>"
        f"{_summary(state, manifest, now, warning, owner_gone)}"
        f"<h2>Decide</h2>{_decide_forms(state, csrf, warning, owner_gone, applied, resend, lookup)}"
        f"<h2>Evidence</h2>{_evidence(events)}"
        f"<h2>Attempts</h2>{_attempts(events)}"
        f"<h2>Request</h2>{_request(manifest)}"
        f"<h2>Events</h2>{_events(events)}"
    )
