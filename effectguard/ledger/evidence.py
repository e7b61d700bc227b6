"""Evidence about a call's effect that is not its outcome: a late answer, kept and accepted
(docs/contract.md §6.1, §8).

Recording a late answer changes no stage and no counter: the projection ignores it. It is
written by a writer the store accepts (§7 refuses everything of a fenced registration);
who observed the answer is in the event's data. Accepting it is a reconcile whose decision
the evidence makes (:func:`effectguard.rules.evidence.accept`).
"""

from __future__ import annotations

from effectguard.errors import CallNotFound, LedgerError
from effectguard.ledger.base import Tx, Writer
from effectguard.ledger.decisions import check_attempt, effect_unknown_call, reconcile
from effectguard.ledger.operations import append
from effectguard.rules import evidence
from effectguard.rules.events import AttemptLateAnswer
from effectguard.rules.workstate import WorkState


def record_late_answer(tx: Tx, writer: Writer, event: AttemptLateAnswer) -> WorkState:
    """Append a late answer to an attempt the call has started; its state is unchanged."""
    state = tx.get_call(event.call)
    if state is None:
        raise CallNotFound(event.call)
    if not 1 <= event.attempt <= state.attempts:
        raise LedgerError(
            f"call {event.call} has no attempt {event.attempt}; its late answer is not kept"
        )
    return append(tx, writer, [event], {event.call: state})[event.call]


def accept_evidence(
    tx: Tx, writer: Writer, call_id: str, *, note: str | None, by: str, attempt: int | None = None
) -> WorkState:
    """Reconcile an effect-unknown call as its current attempt's late answer proves, only
    while ``attempt`` (if given: the one a person examined) is still its last."""
    state = effect_unknown_call(tx, call_id, "evidence decides only an unknown effect")
    check_attempt(state, attempt)
    events = list(tx.events_of(call_id))
    found = evidence.latest(events, state.attempts)
    applied = evidence.applied_late(events)  # an answer to any attempt may deny "not applied"
    decided = evidence.accept(call_id, found, state.attempts, note, applied)
    return reconcile(
        tx, writer, call_id, applied=decided.applied, cost=decided.cost, note=decided.note, by=by
    )
