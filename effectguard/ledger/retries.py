"""Which call a key-less declared retry repeats (docs/contract.md §4), read in the
admission's transaction; and the late answer that forbids repeating a call decided not
applied."""

from __future__ import annotations

import math
from typing import Final

from effectguard.ledger.base import Tx
from effectguard.rules import evidence, workstate
from effectguard.rules.admission import AdmitRequest
from effectguard.rules.events import AttemptLateAnswer
from effectguard.rules.workstate import WorkState

#: A repeated call, and the late answer that says the provider applied it although it
#: was decided not applied (None: there is none, or the call was not so decided).
Repeated = tuple[WorkState | None, AttemptLateAnswer | None]


def contradiction(tx: Tx, call: WorkState) -> AttemptLateAnswer | None:
    """The late answer that says the provider applied ``call``, decided not applied,
    resting not sent / not processed after a later attempt, or effect-unknown with a resend
    authorized (evidence.resend_contradicted), if any. The call's events are read only
    for such a call (evidence.may_be_contradicted): no other admission, and no first
    attempt's automatic retry, pays for the read."""
    if not evidence.may_be_contradicted(call):
        return None
    late = evidence.applied_late(tx.events_of(call.call_id))
    return late if evidence.resend_contradicted(call, late) else None


def retried_call(tx: Tx, req: AdmitRequest, now: float) -> Repeated:
    """The unresolved call a keyless declared retry repeats, if any (or the settled one
    its caller left, ``orphan_of``), with the late answer that contradicts its decision.

    ``Effectguard-Retry-Of`` names it (only within the same budget root and request
    hash); otherwise it is the newest call with this hash inside the retry window that
    is unresolved, was decided applied, or was decided not applied while a late answer
    kept for it says the provider applied it.
    """
    if req.orphan_of is not None:
        left = tx.get_call(req.orphan_of)
        if left is not None and _same_work(left, req) and left.stage in _LEFT_MATCHED:
            return left, contradiction(tx, left)
    if req.retry_of is not None:
        target = tx.get_call(req.retry_of)
        if target is not None and _same_work(target, req):
            return _matched(target, contradiction(tx, target))
    return _newest_by_hash(tx, req, now - req.retry_window_s)


#: What an orphan's retry is answered from: its outcome, or the decision that it was
#: applied (evidence, or a person, decided it while its caller was away).
_SETTLED: Final = frozenset({"completed", "failed", "reconciled_applied"})
#: ... or the pause between its owner's automatic retries (contract.md §3.5): after a
#: not-sent or not-processed attempt the call rests in that stage while this process
#: waits to send it again. Its caller's retry joins it there; admitted as new work, it
#: was sent beside the owner's next attempt: two effects for one SDK call.
_LEFT_MATCHED: Final = _SETTLED | {"not_sent", "not_processed"}
#: The stages of a call a retry repeats. A call decided applied is matched too: it was
#: refused 409 until the decision, and the decision must not turn its retry into new
#: work, sent again. A call decided not applied is matched only with a late answer that
#: says it was applied (:func:`contradiction`): otherwise its retry is new work.
_MATCHED: Final = workstate.UNRESOLVED | {"reconciled_applied"}


def _matched(target: WorkState, late: AttemptLateAnswer | None) -> Repeated:
    if late is not None or target.stage in _MATCHED:
        return target, late
    return None, None


#: How many of the newest calls decided not applied, with a retry's hash in its window,
#: are read for a late answer that contradicts the decision (contract.md §4): a bound on
#: what one retry's admission reads, far above what identical key-less calls decided
#: not applied within minutes of each other come to.
MAX_NOT_APPLIED_READ: Final = 16


def _newest_by_hash(tx: Tx, req: AdmitRequest, since: float) -> Repeated:
    """The newest call inside the window that a retry by hash repeats: unresolved, or
    decided applied since. Before the decision such a retry was refused 409
    ``effect_unknown``; the decision must not make it new work, a second effect. Or
    decided not applied, and contradicted by a late answer since: its retry, new work
    by the decision, would make the effect the provider says it made a second time."""
    root, request_hash = req.budget_root, req.request_hash
    unresolved = tx.find_unresolved(root, request_hash, since)
    found: list[Repeated] = [
        # An effect-unknown call with a resend authorized is read for its late 2xx, too.
        (unresolved, None if unresolved is None else contradiction(tx, unresolved)),
        *((decided, None) for decided in tx.find_decided(root, request_hash, since, True, 1)),
    ]
    newest: Repeated = (None, None)
    for call, late in found:
        if call is not None and (newest[0] is None or call.created_at > newest[0].created_at):
            newest = (call, late)
    bound = None if newest[0] is None else newest[0].created_at
    return _contradicted_by_hash(tx, req, since, bound) or newest


def _contradicted_by_hash(
    tx: Tx, req: AdmitRequest, since: float, newer_than: float | None
) -> Repeated | None:
    """The newest call decided not applied in the window (and newer than ``newer_than``,
    the newest other match, if any) that a late answer contradicts. Not only the newest
    such decision: one that nothing contradicts is no match, so an older contradicted
    call behind it is the newest match (a retry matched by hash may be that call's: it
    cannot be told apart), and its retry would make the effect again. Newest first, at
    most :data:`MAX_NOT_APPLIED_READ` of them, read in one query (``since``, raised to
    just past ``newer_than``: a float's next value, so exactly the calls newer than it)."""
    if newer_than is not None:
        since = max(since, math.nextafter(newer_than, math.inf))
    root, request_hash = req.budget_root, req.request_hash
    for call in tx.find_decided(root, request_hash, since, False, MAX_NOT_APPLIED_READ):
        late = contradiction(tx, call)
        if late is not None:
            return call, late
    return None


def _same_work(call: WorkState, req: AdmitRequest) -> bool:
    return call.budget_root == req.budget_root and call.request_hash == req.request_hash
