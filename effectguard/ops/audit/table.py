"""The legal event sequences of one call, as data.

A call moves through *phases*. The resting phases are the contract's stages (docs/contract.md §6);
the others exist only inside one durable transaction (between ``attempt.observed`` and
its ``call.completed``, say) and each names the event that must come next. A ledger
whose call rests in such a phase at its end, or takes an event the table does not
list from where it stands, has lost, gained or reordered an event.

Some kinds lead to different phases depending on what they say (an observed 200 and an
observed 500 are settled to different stages); :func:`step` reads that ``variant`` from
the event's data, so the table itself stays a plain mapping.
"""

from __future__ import annotations

from typing import Any, Final

NEW: Final = "new"

#: Resting phases: the contract's stages a call may stand in between transactions.
RESTING: Final = frozenset(
    {
        "refused",
        "in_flight",
        "not_sent",
        "effect_unknown",
        "completed",
        "not_processed",
        "failed",
        "reconciled_applied",
        "reconciled_not_applied",
    }
)

#: Phases inside a transaction, and the event each one needs next.
NEEDS: Final[dict[str, str]] = {
    NEW: "call.manifest",
    "admitted": "budget.reserved or call.refused",
    "resumed": "budget.reserved",
    "reserved": "attempt.started",
    "observed_ok": "budget.settled",
    "observed_error": "budget.settled",
    "observed_not_processed": "budget.released or budget.held",
    "observed_unknown": "attempt.interrupted",
    "settled_ok": "call.completed",
    "settled_error": "call.completed",
    "released_not_processed": "call.completed",
    "sent_nothing": "budget.released or budget.held",
    "reheld_not_processed": "call.completed",
    "holding": "budget.held",
    "reconciling_applied": "budget.unheld",
    "reconciling_not_applied": "budget.unheld",
    "correcting_applied": "budget.corrected",
    "correcting_not_applied": "budget.corrected",
}

#: Where a call may start a new attempt (docs/contract.md §4: resumed, or resent under a provider's
#: idempotency window; §3.4: automatic retries after not sent / not processed).
_RESUMABLE: Final = ("not_sent", "not_processed", "reconciled_not_applied", "effect_unknown")

#: Where a call rests once it has started an attempt (every resting stage but refused): a
#: late answer to one of its attempts may be kept there as evidence, and moves nothing
#: (docs/contract.md §6.1).
_ATTEMPTED: Final = RESTING - {"refused"}

#: ``(phase, kind[:variant]) -> next phase``. Anything not listed is illegal.
TABLE: Final[dict[tuple[str, str], str]] = {
    (NEW, "call.manifest"): "admitted",
    ("admitted", "call.refused"): "refused",
    ("admitted", "budget.reserved"): "reserved",
    **{(stage, "budget.reserved"): "reserved" for stage in _RESUMABLE},
    # A provider-deduplicated resend releases the earlier attempt's hold first.
    ("effect_unknown", "budget.unheld:resend"): "resumed",
    ("resumed", "budget.reserved"): "reserved",
    ("reserved", "attempt.started"): "in_flight",
    ("in_flight", "attempt.observed:ok"): "observed_ok",
    ("in_flight", "attempt.observed:error"): "observed_error",
    ("in_flight", "attempt.observed:not_processed"): "observed_not_processed",
    ("in_flight", "attempt.observed:unknown"): "observed_unknown",
    ("in_flight", "attempt.not_sent"): "sent_nothing",
    ("in_flight", "attempt.interrupted"): "holding",
    ("observed_unknown", "attempt.interrupted"): "holding",
    ("observed_ok", "budget.settled"): "settled_ok",
    ("observed_error", "budget.settled"): "settled_error",
    ("observed_not_processed", "budget.released"): "released_not_processed",
    # contract.md §8: an operator authorizes one resend of an unknown call; the call stays
    # unknown (and its hold stays) until that attempt settles, when the hold is spent.
    ("effect_unknown", "call.resend_authorized"): "effect_unknown",
    ("settled_ok", "budget.unheld:reconcile"): "settled_ok",
    ("settled_error", "budget.unheld:reconcile"): "settled_error",
    ("settled_ok", "call.completed:completed"): "completed",
    ("settled_error", "call.completed:failed"): "failed",
    ("released_not_processed", "call.completed:not_processed"): "not_processed",
    ("sent_nothing", "budget.released"): "not_sent",
    # contract.md §4: a provider-deduplicated resend that proved nothing leaves the earlier
    # attempt's effect unknown: its reservation is held, and the call is unknown again.
    ("observed_not_processed", "budget.held"): "reheld_not_processed",
    ("reheld_not_processed", "call.completed:not_processed"): "effect_unknown",
    ("sent_nothing", "budget.held"): "effect_unknown",
    ("holding", "budget.held"): "effect_unknown",
    ("effect_unknown", "call.reconciled:applied"): "reconciling_applied",
    ("effect_unknown", "call.reconciled:not_applied"): "reconciling_not_applied",
    ("reconciling_applied", "budget.unheld:reconcile"): "reconciled_applied",
    ("reconciling_not_applied", "budget.unheld:reconcile"): "reconciled_not_applied",
    # docs/contract.md §12: a failed call (an error answer booked as applied) may be reconciled too.
    ("failed", "call.reconciled:applied"): "correcting_applied",
    ("failed", "call.reconciled:not_applied"): "correcting_not_applied",
    ("correcting_applied", "budget.corrected"): "reconciled_applied",
    ("correcting_not_applied", "budget.corrected"): "reconciled_not_applied",
    **{(stage, "attempt.late_answer"): stage for stage in _ATTEMPTED},
}

#: The contract stage a call shows once it reaches a phase (None: unchanged).
STAGE_OF: Final[dict[str, str | None]] = {
    **{stage: stage for stage in RESTING},
    "admitted": "in_flight",
    "resumed": None,
    "reserved": None,
    "observed_ok": "completed",
    "observed_error": "failed",
    "observed_not_processed": "not_processed",
    "observed_unknown": None,
    "settled_ok": "completed",
    "settled_error": "failed",
    "released_not_processed": "not_processed",
    "sent_nothing": "not_sent",
    "reheld_not_processed": "effect_unknown",
    "holding": "effect_unknown",
    "reconciling_applied": "reconciled_applied",
    "reconciling_not_applied": "reconciled_not_applied",
    "correcting_applied": "reconciled_applied",
    "correcting_not_applied": "reconciled_not_applied",
}

#: Every kind that belongs to a call.
CALL_KINDS: Final = frozenset(key[1].split(":")[0] for key in TABLE)
#: Kinds that belong to no call.
LEDGER_KINDS: Final = frozenset(
    {"worker.registered", "worker.taken_over", "budget.limit_set", "key.created", "key.revoked"}
)


def variant(kind: str, data: dict[str, Any], phase: str) -> str:
    """``kind`` refined by what the event says, as the table spells it."""
    if kind == "attempt.observed":
        if data.get("not_processed"):
            return f"{kind}:not_processed"
        if data.get("effect_unknown"):
            return f"{kind}:unknown"
        status = data.get("status")
        ok = isinstance(status, int) and 200 <= status < 300
        return f"{kind}:{'ok' if ok else 'error'}"
    if kind == "call.completed":
        return f"{kind}:{data.get('outcome')}"
    if kind == "call.reconciled":
        return f"{kind}:{'applied' if data.get('applied') is True else 'not_applied'}"
    if kind == "budget.unheld":
        return f"{kind}:{'resend' if phase == 'effect_unknown' else 'reconcile'}"
    return kind


def step(phase: str, kind: str, data: dict[str, Any]) -> tuple[str, str] | None:
    """``(next phase, refined kind)``, or None when the table has no such move."""
    refined = variant(kind, data, phase)
    nxt = TABLE.get((phase, refined))
    return None if nxt is None else (nxt, refined)
