"""An admission whose transaction runs once this process has stopped sending (a drain's
end, a second signal, a transport's close: docs/operations.md "Shutting down").

Such an admission was waiting for the ledger (its write lock held elsewhere, a slow
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
from effectguard.rules.admission import AdmitRequest
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
    call_id, why = admitted.call_id, f"admitted as the process stopped: {reason}"
    events = [
        AttemptNotSent(call=call_id, attempt=admitted.attempt, reason=why),
        BudgetReleased(call=call_id, budget=admitted.state.budget, amount=req.reserve),
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
