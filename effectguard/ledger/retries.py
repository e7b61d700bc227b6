"""Which call a key-less declared retry repeats (docs/contract.md §4), read in the
admission's transaction."""

from __future__ import annotations

from typing import Final

from effectguard.ledger.base import Tx
from effectguard.rules import workstate
from effectguard.rules.admission import AdmitRequest
from effectguard.rules.workstate import WorkState


def retried_call(tx: Tx, req: AdmitRequest, now: float) -> WorkState | None:
    """The unresolved call a keyless declared retry repeats, if any (or the settled one
    its caller left, ``orphan_of``).

    ``Effectguard-Retry-Of`` names it (only within the same budget root and request
    hash); otherwise it is the newest call with this hash inside the retry window that
    is unresolved or was decided applied.
    """
    if req.orphan_of is not None:
        left = tx.get_call(req.orphan_of)
        if left is not None and _same_work(left, req) and left.stage in _LEFT_MATCHED:
            return left
    target = None
    if req.retry_of is not None:
        target = tx.get_call(req.retry_of)
        if target is not None and not _same_work(target, req):
            target = None
    if target is None:
        target = _newest_by_hash(tx, req, now - req.retry_window_s)
    if target is not None and target.stage not in _MATCHED:
        return None
    return target


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
#: work, sent again.
_MATCHED: Final = workstate.UNRESOLVED | {"reconciled_applied"}


def _newest_by_hash(tx: Tx, req: AdmitRequest, since: float) -> WorkState | None:
    """The newest call inside the window that a retry by hash repeats: unresolved, or
    decided applied since. Before the decision such a retry was refused 409
    ``effect_unknown``; the decision must not make it new work, a second effect."""
    root, request_hash = req.budget_root, req.request_hash
    found = [
        tx.find_unresolved(root, request_hash, since),
        tx.find_decided(root, request_hash, since),
    ]
    return max((s for s in found if s is not None), key=lambda s: s.created_at, default=None)


def _same_work(call: WorkState, req: AdmitRequest) -> bool:
    return call.budget_root == req.budget_root and call.request_hash == req.request_hash
