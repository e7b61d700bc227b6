"""``effectguard show CALL_ID`` as a person reads it: the request, every attempt and why
it ended, the money, and the exact command to run next.

Times are ISO 8601 (UTC); a value that is not there prints as ``-`` or is left out,
never as Python's ``None``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from effectguard.ops.render import ago, iso, money
from effectguard.rules import evidence
from effectguard.rules.bodyref import REF_ENCODING, describe_ref
from effectguard.rules.bodytext import decode_body
from effectguard.rules.events import AttemptLateAnswer, StoredEvent
from effectguard.rules.guidance import (
    AUTO_COMMAND,
    RESEND_AUTHORIZED,
    accept_evidence_command,
    next_command,
)
from effectguard.rules.lookupfirst import lookup_first
from effectguard.rules.resendfirst import resend_first

__all__ = [
    "REQUEST_PREVIEW_CHARS",
    "attempts",
    "late_answers",
    "next_command",
    "next_commands",
    "render",
    "request_json",
]
from effectguard.rules.workstate import WorkState

#: The kind of a late answer kept as evidence (it ends no attempt).
LATE = AttemptLateAnswer.kind
#: Characters of the pretty-printed request shown without ``--full``.
REQUEST_PREVIEW_CHARS = 2000


def request_text(events: list[StoredEvent], stored_bytes: int | None = None) -> str | None:
    """The call's request body as stored in its manifest, pretty-printed if it is JSON.

    A body stored by reference (an upload) is named, not printed: its size
    (``stored_bytes``, read from the body store; None where none is stored) and digest.
    """
    manifest = next((e for e in events if e.kind == "call.manifest"), None)
    if manifest is None:
        return None
    encoding = manifest.data.get("body_encoding", "utf8")
    if encoding == REF_ENCODING:
        text = describe_ref(str(manifest.data.get("body")), stored_bytes)
        return text if stored_bytes is not None else f"{text} (its bytes are not stored)"
    raw = decode_body(str(manifest.data.get("body", "")), encoding)
    try:
        return json.dumps(json.loads(raw), indent=2, ensure_ascii=False)
    except ValueError:
        return raw.decode("utf-8", "replace")


def request_json(events: list[StoredEvent], stored_bytes: int | None = None) -> Any:
    """The request body for ``show --json``: parsed JSON, else its text; a body stored by
    reference as ``{"body_encoding": "sha256", "sha256": …, "bytes": …}``."""
    manifest = next((e.data for e in events if e.kind == "call.manifest"), {})
    if manifest.get("body_encoding") == REF_ENCODING:
        return {
            "body_encoding": REF_ENCODING,
            "sha256": manifest.get("body"),
            "bytes": stored_bytes,
        }
    text = request_text(events)
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def truncated(text: str, full: bool, limit: int = REQUEST_PREVIEW_CHARS) -> str:
    """``text``, cut at ``limit`` characters (with a note saying how to see it all)."""
    if full or len(text) <= limit:
        return text
    return f"{text[:limit]}\n… {len(text) - limit} more characters (--full shows all)"


def attempts(events: list[StoredEvent]) -> list[dict[str, Any]]:
    """Each attempt: when it started, on which worker, and how (and when) it ended."""
    found: dict[int, dict[str, Any]] = {}
    for e in events:
        number = int(e.data.get("attempt") or 0)
        if e.kind == "attempt.started":
            found[number] = {
                "attempt": number,
                "started_at": iso(e.at),
                "worker": e.data.get("worker"),
                "generation": e.data.get("generation"),
                # Where it wrote the call's operation id (None: it wrote none, or an older
                # release sent it, which did not record it): what a lookup's "not found" needs.
                "op_id_in": e.data.get("op_id_in"),
                # Where it was sent and the digest of its credential, for a call a lookup
                # can decide (None: not recorded): a lookup asked elsewhere proves nothing.
                "sent_to": e.data.get("sent_to"),
                "key_digest": e.data.get("key_digest"),
                # The idempotency key the provider saw (None: the endpoint declares none).
                "provider_key": e.data.get("provider_idempotency_key"),
                "ended": "in flight",
            }
        elif number in found and e.kind.startswith("attempt.") and e.kind != LATE:
            found[number].update(ended_at=iso(e.at), ended=_ending(e))
    return [found[n] for n in sorted(found)]


def _ending(e: StoredEvent) -> str:
    d = e.data
    if e.kind == "attempt.observed":
        usage = d.get("usage") or {}
        text = f"observed {d.get('status')}"
        if d.get("not_processed"):
            text += " (a status the provider declares not processed)"
        if usage:
            text += (
                f", usage {usage.get('input_tokens', 0)} in / {usage.get('output_tokens', 0)} out"
            )
        if d.get("not_processed"):
            text += ", its reservation released"  # nothing was charged, usage or not
        elif d.get("usage_problem"):
            text += f", usage {d['usage_problem']}: settled at the reservation"
        return text
    if e.kind == "attempt.not_sent":
        return f"not sent: {d.get('reason')}"
    if e.kind == "attempt.interrupted":
        return f"interrupted by {d.get('by')}: {d.get('reason')}"
    return e.kind


def late_answers(events: list[StoredEvent]) -> list[dict[str, Any]]:
    """Each late answer kept as evidence (``attempt.late_answer``), for ``show --json``."""
    return [
        {"seq": e.seq, "at_iso": iso(e.at), "written_by": e.worker, **e.data}
        for e in events
        if e.kind == LATE
    ]


def _evidence_lines(events: list[StoredEvent]) -> list[str]:
    lines = []
    for e in events:
        if e.kind == LATE:
            late = e.event
            assert isinstance(late, AttemptLateAnswer)
            cost = f"; implies {money(late.cost)} USD" if late.cost is not None else ""
            lines.append(f"  {iso(e.at)} {evidence.describe(late)}{cost}")
    return lines


def next_commands(
    state: WorkState,
    events: list[StoredEvent],
    where: str = "",
    owner_gone: str | None = None,
    now: float | None = None,
    lookup_s: float | None = None,
) -> str | None:
    """The exact command(s) to run next, ``|``-separated; a late answer that decides an
    effect-unknown call offers ``--accept-evidence`` first, and one that says applied
    puts ``--not-applied`` behind a warning (:func:`evidence.applied_advice`). ``where``
    (`` --ledger X``) follows the call id of each: copied as printed, a command reads the
    ledger shown.
    ``owner_gone``: why the worker of a call in flight will not finish it (None: it may).
    ``now``: where given, a keyed effect-unknown call still inside its provider's window
    is offered its keyed resend first (:func:`_inside_window`), and one whose endpoint
    declares a lookup (``lookup_s``: its search lag) ``reconcile --auto`` before the
    decisions by hand (:func:`effectguard.rules.lookupfirst.lookup_first`)."""
    keyed = state.idempotency_key is not None
    command = next_command(state.call_id, state.stage, state.attempts or None, owner_gone, keyed)
    late = evidence.latest(events, state.attempts)
    applied = evidence.applied_unknown(state, events)
    if applied is not None:  # applied first; not applied only behind a warning
        command = evidence.applied_advice(state.call_id, state.attempts, applied)
    elif state.stage == "effect_unknown" and late is not None and late.effect != "unknown":
        accept = accept_evidence_command(state.call_id, state.attempts)
        command = f"{accept} | {command}" if command else accept
    warning = evidence.resend_warning(state, evidence.applied_late(events))
    if warning is not None and state.stage == "effect_unknown":
        # Its authorized resend is void; the decision it awaits is still offered.
        command = f"{warning} | {command}" if command else warning
    elif warning is not None:
        command = warning
    elif state.stage == "effect_unknown" and state.resend_authorized:
        command = f"{RESEND_AUTHORIZED} | {command}" if command else RESEND_AUTHORIZED
    elif applied is None and (late is None or late.effect == "unknown"):
        asks = [_inside_window(state, events, now), _ask_lookup(state, events, now, lookup_s)]
        command = " | ".join([a for a in asks if a] + ([command] if command else [])) or None
    if command is None or not where:
        return command
    verb = re.compile(rf"effectguard \w+ {re.escape(state.call_id)}")
    command = command.replace(f"`{AUTO_COMMAND}`", f"`{AUTO_COMMAND}{where}`")
    return verb.sub(lambda m: m.group(0) + where, command)


def _inside_window(state: WorkState, events: list[StoredEvent], now: float | None) -> str | None:
    """The keyed resend of an effect-unknown call inside its provider's idempotency
    window (:func:`effectguard.rules.resendfirst.resend_first`, which the operator page
    offers too), or None. A key-less call's retry is not resent (contract §4)."""
    return None if now is None else resend_first(state, events, now, iso)


def _ask_lookup(
    state: WorkState, events: list[StoredEvent], now: float | None, lookup_s: float | None
) -> str | None:
    """``reconcile --auto`` for an effect-unknown call whose endpoint declares a lookup
    (:func:`effectguard.rules.lookupfirst.lookup_first`, which the page offers too)."""
    return None if now is None else lookup_first(state, events, lookup_s, now, iso)


def decisions(events: list[StoredEvent]) -> list[str]:
    """Reconciliations and refusals, one line each."""
    lines = []
    for e in events:
        d = e.data
        if e.kind == "call.reconciled":
            verdict = "applied" if d.get("applied") else "not applied"
            kept = isinstance(d.get("result"), str)
            lines.append(
                f"{iso(e.at)} reconciled {verdict} by {d.get('by')} "
                f"(cost {money(d.get('cost')) or '-'} USD): {d.get('note')}"
                + ("; its recovered result is kept and replayed to resends" if kept else "")
            )
        elif e.kind == "call.refused":
            lines.append(f"{iso(e.at)} refused {d.get('status')} {d.get('reason')}")
    return lines


def _head(
    state: WorkState, events: list[StoredEvent], now: float, owner_gone: str | None
) -> list[str]:
    """The lines of ``show`` above the money: what the call is, and whose."""
    manifest = next((e.data for e in events if e.kind == "call.manifest"), {})
    # Not the stage's resend when a late answer contradicts the decision (see "next").
    warned = evidence.resend_warning(state, evidence.applied_late(events))
    upcoming = evidence.shown_next(state, warned, owner_gone)
    lines = [
        f"call {state.call_id}",
        f"  stage      {state.stage} (effect {state.effect}; next: {upcoming})",
        f"  provider   {state.provider}  {manifest.get('method', '')} "
        f"{manifest.get('endpoint', '')}".rstrip(),
        f"  model      {state.model or '-'}",
        f"  budget     {state.budget}",
        f"  key        {state.idempotency_key or '-'}",
        f"  created    {iso(state.created_at)} ({ago(state.created_at, now)})",
    ]
    if owner_gone is not None:
        lines.append(
            f"  owner      worker {state.worker} is gone ({owner_gone}): "
            "`effectguard reconcile` takes the call over, and it becomes effect_unknown"
        )
    if state.status is not None:
        lines.append(f"  status     {state.status}")
    if state.flagged:
        lines.append(f"  flagged    {state.flagged}")
    return lines


def render(
    state: WorkState,
    events: list[StoredEvent],
    *,
    full: bool,
    now: float,
    stored_bytes: int | None = None,
    where: str = "",
    owner_gone: str | None = None,
    lookup_s: float | None = None,
) -> str:
    """The text of ``effectguard show`` (``stored_bytes``: see :func:`request_text`;
    ``where``, ``owner_gone`` and ``lookup_s``: see :func:`next_commands`)."""
    lines = _head(state, events, now, owner_gone)
    lines += ["", "money (USD)"]
    lines += [
        f"  reserved at admission  {money(state.reserved_at_admission)}",
        f"  reserved now           {money(state.reserved)}",
        f"  held                   {money(state.held)}",
        f"  spent                  {money(state.cost) or '-'}",
    ]
    lines += ["", "attempts"]
    for a in attempts(events):
        carried = f", provider key {a['provider_key']}" if a["provider_key"] else ""
        carried += f", operation id in {a['op_id_in']}" if a["op_id_in"] else ""
        carried += f", sent to {a['sent_to']}" if a["sent_to"] else ""
        lines.append(f"  #{a['attempt']} started {a['started_at']} on {a['worker']}{carried}")
        lines.append(
            f"     {'ended ' + a['ended_at'] + ': ' if 'ended_at' in a else ''}{a['ended']}"
        )
    if not attempts(events):
        lines.append("  -")
    late = _evidence_lines(events)
    if late:
        lines += ["", "evidence (kept, not the outcome)", *late]
    decided = decisions(events)
    if decided:
        lines += ["", "decisions", *(f"  {line}" for line in decided)]
    lines += ["", "events"]
    lines += [f"  #{e.seq} {iso(e.at)} {e.kind} by {e.worker}" for e in events]
    text = request_text(events, stored_bytes)
    lines += ["", "request"]
    lines += [f"  {line}" for line in truncated(text or "-", full).splitlines()]
    command = next_commands(state, events, where, owner_gone, now, lookup_s)
    choices = command.split(" | ") if command else ["nothing to do"]
    lines += ["", "next", *(f"  {'or ' if i else ''}{c}" for i, c in enumerate(choices))]
    return "\n".join(lines)
