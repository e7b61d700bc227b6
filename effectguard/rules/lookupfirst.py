"""The provider's lookup offered before any decision by hand. Pure.

An ``effect_unknown`` call whose endpoint declares a lookup (contract §2.2) can be decided
by asking the provider whether it applied the call: ``effectguard reconcile --auto`` does
so now (the sweeper does too, in the background) and records only what the answer proves,
so it cannot guess wrong where a person deciding by hand can. ``show`` and the operator
page offer it before ``--applied`` and ``--not-applied`` (after a keyed resend inside the
provider's window, which settles the call too and completes the client's request),
unless evidence already speaks (:func:`effectguard.rules.resendfirst.evidence_silent`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from effectguard.rules.events import StoredEvent
from effectguard.rules.guidance import lookup_advice
from effectguard.rules.resendfirst import evidence_silent
from effectguard.rules.workstate import WorkState

__all__ = ["lookup_first"]


def lookup_first(
    state: WorkState,
    events: Sequence[StoredEvent],
    freshness_s: float | None,
    now: float,
    show_time: Callable[[float], str | None],
) -> str | None:
    """What to do before a decision by hand for ``state`` when that is asking its lookup
    (else None). ``freshness_s``: the declared lookup's search lag (None: the call's
    endpoint declares no lookup); until it has passed since the last attempt began, the
    advice says from when a "not found" can prove anything, written by ``show_time``."""
    if state.stage != "effect_unknown" or freshness_s is None:
        return None
    if not evidence_silent(state, events):
        return None
    started = [e for e in events if e.kind == "attempt.started"]
    last = float(started[-1].data.get("at") or started[-1].at) if started else state.created_at
    ready = last + freshness_s
    return lookup_advice(state.provider, None if now >= ready else show_time(ready))
