"""The keyed resend offered before any decision by hand, inside a provider's window. Pure.

A keyed ``effect_unknown`` call of an endpoint with an idempotency window is resent, while
the window is open, under the provider key its attempts carried, which the provider
deduplicates (contract §4): that settles the call without a guess. ``show`` and the
operator page offer it first, unless evidence already speaks (a late answer that decides
the call, one that says the provider applied it) or a resend was authorized.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from effectguard.rules import evidence
from effectguard.rules.events import StoredEvent
from effectguard.rules.guidance import provider_resend_advice
from effectguard.rules.workstate import WorkState

__all__ = ["evidence_silent", "resend_first", "window_open_until"]


def window_open_until(
    stage: str, idempotency_key: str | None, window_s: float | None, created_at: float, now: float
) -> float | None:
    """Until when a keyed effect-unknown call's resend goes to the provider under its
    provider key (the rule of rules/admission: ``now - created_at <= window``), or None:
    not such a call, or its window has closed. A key-less call is never resent (contract
    §4), so it has none."""
    if stage != "effect_unknown" or idempotency_key is None or window_s is None:
        return None
    if now - created_at > window_s:
        return None
    return created_at + window_s


def evidence_silent(state: WorkState, events: Sequence[StoredEvent]) -> bool:
    """Whether nothing recorded yet tells an operator what to do with ``state``: no resend
    was authorized, and no late answer decides the call, says the provider applied it, or
    voids a decision. Only then is a step that asks the provider (a keyed resend, a
    lookup) offered before a decision by hand."""
    if state.resend_authorized or evidence.applied_unknown(state, events) is not None:
        return False
    if evidence.resend_warning(state, evidence.applied_late(events)) is not None:
        return False
    late = evidence.latest(events, state.attempts)
    return late is None or late.effect == "unknown"


def resend_first(
    state: WorkState,
    events: Sequence[StoredEvent],
    now: float,
    show_time: Callable[[float], str | None],
) -> str | None:
    """What to do first for ``state`` when that is its keyed resend (else None), its
    deadline written by ``show_time`` (None: a time no date can show, nothing offered)."""
    if not evidence_silent(state, events):
        return None
    until = window_open_until(
        state.stage, state.idempotency_key, state.idempotency_window_s, state.created_at, now
    )
    deadline = None if until is None else show_time(until)
    if deadline is None:
        return None
    keys = [
        str(e.data["provider_idempotency_key"])
        for e in events
        if e.kind == "attempt.started" and e.data.get("provider_idempotency_key")
    ]
    return provider_resend_advice(deadline, keys[-1] if keys else None)
