"""An answer the store refused as its attempt's outcome (a fenced worker's, or one come
after its attempt was interrupted), kept as evidence instead, and the 502
``observe_refused`` that tells the client what the ledger holds now.

:class:`LateAnswers` is a part of :class:`~effectguard.callpath.recorder.Recorder`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from effectguard.callpath.prepare import Prepared, refuse
from effectguard.callpath.storefault import brief as _describe
from effectguard.errors import FencedError, LedgerError, Refusal
from effectguard.ledger import Admitted, Ledger, Writer
from effectguard.rules import evidence
from effectguard.rules.bodytext import decode_body
from effectguard.rules.events import AttemptLateAnswer, AttemptObserved
from effectguard.rules.settlement import Settlement
from effectguard.rules.workstate import WorkState
from effectguard.telemetry.observer import Observer


class LateAnswers:
    """Keeps refused answers as evidence and words their refusal (a part of ``Recorder``)."""

    ledger: Ledger
    observer: Observer
    evidence_writer: Callable[[Writer], Awaitable[Writer]]

    async def _refuse_late_answer(
        self,
        prepared: Prepared,
        admitted: Admitted,
        settled: Settlement,
        exc: FencedError,
    ) -> Refusal:
        """The 502 ``observe_refused`` for an answer the store refused, kept as evidence.

        It names the stage the ledger holds now, and that stage's next operation, unless
        this very answer contradicts it: a call decided not applied meanwhile, that the
        provider says it applied, is not to be resent (what ``show`` says, contract §9).
        """
        call_id = admitted.call_id
        late = _late_answer(prepared, admitted, settled, str(exc))
        kept = await self._keep_late_answer(admitted, late)
        said = f"its answer (status {late.status}) " + (
            "is kept as evidence" if kept else "could not be kept as evidence either"
        )
        now = await self._state_now(call_id)
        next_operation = None if now is None else now.next_operation
        warning = None if now is None else await self._resend_warning(now, late, kept)
        if warning is not None and now is not None:
            next_operation, said = evidence.contradicted_next(now), f"{said}; {warning}"
        return refuse(
            502,
            "observe_refused",
            f"this worker was fenced; the result of call {call_id} was not recorded as "
            f"its outcome: {exc}; {said}",
            call_id=call_id,
            stage=None if now is None else now.stage,
            next_operation=next_operation,
        )

    async def _state_now(self, call_id: str) -> WorkState | None:
        """``call_id`` as the ledger holds it now (as a takeover left it), or None if the
        ledger cannot say: the refusal of a late answer then names no stage."""
        try:
            return await self.ledger.store.get_call(call_id)
        except LedgerError:
            return None

    async def _resend_warning(
        self, now: WorkState, late: AttemptLateAnswer, kept: bool
    ) -> str | None:
        """Show's "do not resend" for ``now``, the call this late answer is about: this
        answer's own, else (for a call decided not applied, resting after a later attempt
        that proved nothing, or with a resend authorized, whose resend a late applied
        answer to any attempt forbids) that of one kept before, read from the ledger. Not
        the hot path: only a refused answer of such a call reads it
        (evidence.may_be_contradicted)."""
        warning = evidence.resend_warning(now, late, kept)
        if warning is not None or not evidence.may_be_contradicted(now):
            return warning
        try:
            events = await self.ledger.events(now.call_id)
        except LedgerError:
            return None  # the ledger cannot say: the stage's next operation stands
        return evidence.resend_warning(now, evidence.applied_late(events))

    async def _keep_late_answer(self, admitted: Admitted, late: AttemptLateAnswer) -> bool:
        """Keep an answer the store refused as the attempt's outcome, as evidence; whether
        it was kept.

        It is written as a registration of this process the store accepts
        (:attr:`evidence_writer`), never as the fenced one. If even that fails, the answer
        is lost as before: the call stays as the takeover left it.
        """
        try:
            writer = await self.evidence_writer(admitted.writer)
            await self.ledger.record_late_answer(writer, late)
        except (LedgerError, OSError) as exc:  # OSError: registering anew takes a lock file
            self.observer.incident("late_answer_lost", admitted.call_id, _describe(exc))
            return False
        self.observer.incident("late_answer", admitted.call_id, evidence.describe(late))
        return True


def _late_answer(
    prepared: Prepared, admitted: Admitted, settled: Settlement, why: str
) -> AttemptLateAnswer:
    """The evidence event for an answer the store refused as ``admitted``'s outcome."""
    observed = next(e for e in settled.events if isinstance(e, AttemptObserved))
    return evidence.late_answer(
        settled,
        decode_body(observed.body, observed.body_encoding),
        effect=prepared.provider.answer_effect(observed.status),
        observed_by=admitted.writer.worker,
        generation=admitted.writer.generation,
        reason=why,
    )
