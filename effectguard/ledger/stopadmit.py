"""An admission, or the start of a guard's own retry, whose transaction runs once this
process has stopped sending (a drain's end, a second signal, a transport's close:
docs/operations.md "Shutting down").

Such an admission (or retry) was waiting for the ledger (its write lock held elsewhere, a slow
writer) past the moment after which nothing is sent. Its attempt is recorded not sent in
the admission's own transaction, its reservation released, and its caller refused 503
``shutting_down``. Recorded afterwards, in a write of its own, the record could come as
the ledger closed and be refused: the call was left ``in_flight``, its reservation held
(``effect_unknown`` at the next start), though nothing had been sent.
"""

from __future__ import annotations

from collections.abc import Callable

from effectguard.errors import Refusal
from effectguard.ledger import attempts, operations
from effectguard.ledger.base import Tx, Writer
from effectguard.ledger.operations import Admitted
from effectguard.rules.admission import AdmitRequest, Sending
from effectguard.rules.events import AttemptNotSent, BudgetReleased

#: The admissions that start an attempt (the others answer from the ledger or refuse).
_STARTING = frozenset({"admit", "attempt", "provider_resend"})


def admit(tx: Tx, writer: Writer, req: AdmitRequest, stopped: Callable[[], str | None]) -> Admitted:
    """:func:`operations.admit`; if ``stopped()`` (read now, inside the transaction) says
    why this process sends nothing more, an attempt it starts is recorded not sent here,
    and the admission answers the 503 that says so."""
    admitted = operations.admit(tx, writer, req)
    reason = stopped()
    if reason is None or admitted.action not in _STARTING or admitted.state is None:
        return admitted
    return _not_sent(tx, writer, admitted, req.reserve, reason)


def start_retry(
    tx: Tx,
    writer: Writer,
    call_id: str,
    reserve: int,
    provider_key: str | None,
    sending: Sending,
    stopped: Callable[[], str | None],
) -> Admitted:
    """:func:`attempts.start_attempt` (the guard's automatic retry); if ``stopped()``
    (read now, inside the transaction) says why this process sends nothing more, the
    attempt is recorded not sent here, as an admission's is (:func:`admit`)."""
    started = attempts.start_attempt(tx, writer, call_id, reserve, provider_key, sending)
    reason = stopped()
    if reason is None or started.refusal is not None or started.state is None:
        return started
    return _not_sent(tx, writer, started, reserve, reason)


def _not_sent(tx: Tx, writer: Writer, admitted: Admitted, reserve: int, reason: str) -> Admitted:
    """``admitted``'s new attempt recorded not sent (the process stopped for ``reason``),
    its ``reserve`` released; the 503 ``shutting_down`` that says so."""
    assert admitted.state is not None
    call_id, why = admitted.call_id, f"admitted as the process stopped: {reason}"
    events = [
        AttemptNotSent(call=call_id, attempt=admitted.attempt, reason=why),
        BudgetReleased(call=call_id, budget=admitted.state.budget, amount=reserve),
    ]
    state = attempts.record(tx, writer, call_id, admitted.attempt, events)
    refusal = Refusal(
        503,
        "shutting_down",
        f"call {call_id} was admitted as this process stopped ({reason}); nothing was sent, "
        "and a resend is safe",
        call_id=call_id,
        stage=state.stage,
        next_operation="resend",
        retryable=True,
    )
    return Admitted("refuse", call_id, writer, admitted.attempt, state=state, refusal=refusal)
