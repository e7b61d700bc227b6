"""What may leave the live ledger, and where an archive cuts it. Pure.

The rules (docs/contract.md §8, ``effectguard archive``; written out in docs/operations.md,
"Retention and archives"), each a reason a call stays live:

* it is unresolved (``in_flight``, ``effect_unknown``): every other stage may leave.
  ``refused``, ``completed``, ``failed`` and ``reconciled_applied`` are final (a
  ``failed`` call can no longer be reconciled once archived); the resumable stages
  ``not_sent``, ``not_processed`` and ``reconciled_not_applied`` had no effect, so
  archiving one loses no money or effect, only the resumption: its key, kept like any
  archived call's, answers 409 ``archived`` from then on and new work takes a new key.
  Kept live until its key came again, as it once was, one routine 429 under a key its
  client then dropped held every later call in the live ledger for ever, and no
  command could release it;
* it was resolved at or after the cut-off date: retention counts from the call's last
  event (the one that resolved it; only a late answer kept as evidence may follow, and
  that keeps the call longer, never shorter), not from its admission, so a call that
  stayed unknown for weeks keeps its bodies for the full period after it was decided;
* it is still inside its provider's declared idempotency window (a resend there goes
  to the provider with its header, so the call must stay).

A completed call's key stays replayable under the contract forever, and a resumable
call's key resumes it, while the call is live; once the call is archived, the ledger
keeps its key (root, key, request hash, call id) and a resend answers 409 ``archived``
(:func:`decide_archived`), never a silent new call or attempt.

An archive is a prefix of the hash chain: events ``first..cut``. The cut stops before
the first event of a call that stays live (or the first event written at or after the
cut-off), and never splits a call, so every archived call is whole in the archive.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from effectguard.errors import Refusal
from effectguard.rules.admission import Decision
from effectguard.rules.workstate import WorkState

#: Stages after which no event of the call can follow (next operation ``none``).
FINAL_STAGES: Final = frozenset({"refused", "completed", "failed", "reconciled_applied"})
#: Stages only a request under the call's idempotency key can resume (contract §4), and
#: only while the call is live. None of them had an effect.
RESUMABLE_BY_KEY: Final = frozenset({"not_sent", "not_processed", "reconciled_not_applied"})
#: The stages a call may be archived in: all but the unresolved ones.
ARCHIVABLE_STAGES: Final = FINAL_STAGES | RESUMABLE_BY_KEY
DAY_S: Final = 86400.0
#: The events one step of an archive takes at most (``archive --step-events``). Each
#: step deletes its range in one transaction under the ledger's write lock, which live
#: commits wait for (5 s at most on SQLite before they answer 503): measured on a
#: shared 2-core machine, a step of this size kept live commits waiting about 1 s at
#: most (docs/operations.md, "What an archive costs").
STEP_EVENTS: Final = 50_000


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    """``[retention] keep_bodies_days``: how long a call's events (its request and response
    bodies with them) stay live after the call is resolved."""

    keep_bodies_days: float | None = None

    def cutoff(self, now: float) -> float | None:
        """The ``--before`` instant the policy gives at ``now`` (None: keep forever)."""
        if self.keep_bodies_days is None:
            return None
        return now - self.keep_bodies_days * DAY_S


RESOLVED_LATE: Final = "resolved after the cut-off"
IN_WINDOW: Final = "inside its provider's idempotency window"


def not_final(stage: str) -> str:
    """The reason a call in ``stage`` (not final) stays live."""
    return f"stage {stage} is not final"


def stays_live(state: WorkState, *, resolved_at: float, before: float, now: float) -> str | None:
    """Why ``state``'s call may not be archived yet (None: it may); ``resolved_at`` is the
    time of the call's last event."""
    if state.stage not in ARCHIVABLE_STAGES:
        return not_final(state.stage)
    if resolved_at >= before:
        return RESOLVED_LATE
    window = state.idempotency_window_s
    if window is not None and now - state.created_at <= window:
        return IN_WINDOW
    return None


def remedy(reason: str) -> str:
    """What an operator can do about a call that holds the cut for ``reason``: only an
    unresolved call has anything to resolve; the others leave by themselves."""
    if reason == not_final("effect_unknown"):
        return "reconcile it to archive the calls after it"
    if reason == not_final("in_flight"):
        return (
            "it leaves once it settles (if the process that sent it is gone, a running "
            "serve's sweeper marks it effect_unknown: then reconcile it)"
        )
    if reason == RESOLVED_LATE:
        return "it leaves with a later cut-off; nothing to resolve"
    if reason == IN_WINDOW:
        return "it leaves once that window has passed; nothing to resolve"
    return "run archive again later"


@dataclass(frozen=True, slots=True)
class EventRef:
    """What the cut needs of one event: its number, its call, when it was written."""

    seq: int
    call_id: str | None
    at: float


def cut(
    events: Iterable[EventRef],
    archivable: Mapping[str, bool],
    *,
    before: float,
    ends: Mapping[str, int] | None = None,
) -> int:
    """The last event of the longest archivable prefix of ``events`` (0: none).

    ``events`` are in chain order; ``archivable`` says, per call, whether it may leave.
    A prefix ends at a call boundary: no call has events on both sides of the cut.
    ``ends`` gives a call's last event where ``events`` are only a window of the chain
    (a call that goes on past the window is never cut inside it).
    """
    refs = list(events)
    last_of = _last_of(refs, ends)
    best, reach = 0, 0
    for ref in refs:
        if ref.at >= before:
            break
        if ref.call_id is not None:
            if not archivable.get(ref.call_id, False):
                break
            reach = max(reach, last_of[ref.call_id])
        if reach <= ref.seq:
            best = ref.seq
    return best


def _last_of(refs: list[EventRef], ends: Mapping[str, int] | None) -> dict[str, int]:
    last_of: dict[str, int] = {}
    for ref in refs:
        if ref.call_id is not None:
            last_of[ref.call_id] = ref.seq
    for call_id, end in (ends or {}).items():
        if call_id in last_of:
            last_of[call_id] = max(last_of[call_id], end)
    return last_of


def closes(events: Iterable[EventRef], ends: Mapping[str, int]) -> bool:
    """Whether a prefix of the window ``events`` ends at a call boundary, each call
    ending at its event in ``ends`` (or its last in the window): else the window must
    grow before a cut can fall in it."""
    refs = list(events)
    last_of = _last_of(refs, ends)
    reach = 0
    for ref in refs:
        if ref.call_id is not None:
            reach = max(reach, last_of[ref.call_id])
        if reach <= ref.seq:
            return True
    return False


def holder(
    events: Iterable[EventRef], reasons: Mapping[str, str | None], *, last: int, before: float
) -> tuple[str, str] | None:
    """The call whose event stops the cut after ``last``, and why it stays live.

    None when the cut stops only at the cut-off (nothing older is held back). An
    operator reads this to learn which call to resolve: one long-unresolved call holds
    back every call after it (the archive is a prefix of the chain).
    """
    for ref in events:
        if ref.seq <= last or ref.call_id is None:
            continue
        if ref.at >= before:
            return None
        reason = reasons.get(ref.call_id, "it has no call row")
        if reason is not None:
            return ref.call_id, reason
    return None


def decide_archived(call_id: str, archived_hash: str, request_hash: str) -> Decision:
    """A keyed request whose key belongs to an archived call: refused, never resent."""
    if archived_hash != request_hash:
        status, type_ = 422, "idempotency_key_reused"
        message = (
            f"this Idempotency-Key belongs to archived call {call_id}, a different request; "
            "send it with a new key"
        )
    else:
        status, type_ = 409, "archived"
        message = (
            f"call {call_id} with this key ended and was archived; its record (and its "
            "response, if it had one) is in the archive (the file `effectguard archive` "
            "wrote, or the archived_events table on PostgreSQL), not resent; new work "
            "needs a new Idempotency-Key"
        )
    refusal = Refusal(
        status, type_, message, call_id=call_id, stage="archived", next_operation="none"
    )
    return Decision("refuse", WorkState(call_id=call_id, request_hash=archived_hash), refusal)
