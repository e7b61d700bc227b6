"""The dispatches this process has under way, and how a shutdown cuts them off
(docs/contract.md §3.8).

A shutdown (the proxy's SIGTERM drain, a transport's ``close()``) waits for the calls
under way up to its drain timeout. A call still waiting for its provider's answer then
is cut off: its dispatch is cancelled and the call marked ``effect_unknown``
(``attempt.interrupted``, the reason naming the shutdown, the reservation held) while the
ledger still takes the marking; a caller still waiting is answered 504 ``effect_unknown``
with the call id. Left be, such a call stayed in flight under a closed ledger (its key
answering 409 ``in_progress`` until another worker's sweep found it), and its caller was
answered only once the close broke the provider's connection, by an error that blamed
the provider and a call the ledger still had in flight.

A call cut off while it waits to retry a status its provider declares not processed
(contract.md §3.5) has no request on its way: it ends with the provider's answer to the
attempt before, which its caller gets, as when the retries run out.

A retry that joined a call (contract.md §4) and is still waiting for it then gets what
the call's own caller gets, once the call has ended here: the provider's last answer, or
504 ``effect_unknown``. Until 2026-12-05 it got 503 ``shutting_down`` while the caller got
the provider's 429.

A stream still being read at that point is cut off by its own
:meth:`~effectguard.callpath.stream.GuardedStream.cut_off`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from effectguard.callpath.attempts import CutBetweenAttempts
from effectguard.callpath.exchange import Reply
from effectguard.callpath.join import joined_result, last_observed, stopped_waiting
from effectguard.callpath.prepare import Prepared, refuse
from effectguard.callpath.recorder import Recorder
from effectguard.callpath.replays import replay
from effectguard.callpath.ticket import Ticket
from effectguard.errors import LedgerError, Refusal
from effectguard.ledger import Ledger, Writer
from effectguard.rules.guidance import after_cut_off, decide_unknown
from effectguard.rules.workstate import WorkState
from effectguard.telemetry.report import CallReport

#: How long a shutdown waits, once it has cut calls off, for their markings and for their
#: callers to be answered: ledger writes and a few loop turns, so only a bound.
MARKING_WAIT_S = 5.0


class Dispatches:
    """Each dispatch under way in this process, with its caller's :class:`Ticket`."""

    def __init__(self, ledger: Ledger, recorder: Recorder, writer: Callable[[], Writer]) -> None:
        """``writer``: the writer a marking is made as (the guard's current one)."""
        self._ledger = ledger
        self._recorder = recorder
        self._writer = writer
        self._under_way: dict[asyncio.Future[Reply], Ticket] = {}

    def add(self, ticket: Ticket, task: asyncio.Future[Reply]) -> None:
        """``task`` dispatches ``ticket``'s call: held until it is done."""
        ticket.dispatch = task
        self._under_way[task] = ticket
        task.add_done_callback(self._under_way.pop)

    def cut_off(self, ticket: Ticket, reason: str) -> asyncio.Task[Refusal | Reply]:
        """End a call whose caller can wait no longer (the drain timeout of a shutdown).

        Its dispatch stops, and, if still in flight, the call is marked effect unknown
        (``attempt.interrupted``) — durably, in a task the recorder keeps, so a shutdown
        that drains the recorder waits for the marking. The task answers the refusal to
        send the caller (504 ``effect_unknown`` with the call id); a caller waiting for
        the dispatch is answered it (``ticket.cut``).
        """
        # A dispatch cancelled in its send marks its attempt itself, with this reason: the
        # ledger's then says why whichever marking comes first (it could say "cancelled
        # during dispatch", as if its caller had cancelled it, while its 504 named this).
        self._recorder.cancel_reason = reason
        if ticket.dispatch is not None:
            ticket.dispatch.cancel()
        assert ticket.call_id is not None
        if ticket.joining is not None:  # a joined retry: the call's end, as its caller's
            joined = self.joined_end(ticket.call_id, ticket.joining, None, reason)
            task = asyncio.ensure_future(_answer_of(joined))
        else:
            task = asyncio.ensure_future(self._cut_off(ticket.call_id, reason, ticket.dispatch))
        ticket.cut = task
        self._recorder.keep(task)
        return task

    async def cut_off_all(self, reason: str) -> bool:
        """Cut off every dispatch still under way, for ``reason``; return once each is
        marked. Whether there was any."""
        cuts = [self.cut_off(t, reason) for d, t in list(self._under_way.items()) if not d.done()]
        if cuts:
            await asyncio.wait(cuts)
        return bool(cuts)

    async def _cut_off(
        self, call_id: str, reason: str, dispatch: asyncio.Future[Reply] | None
    ) -> Refusal | Reply:
        owner = dispatch is not None
        if dispatch is not None:
            # Its end first: one waiting between attempts has its answer (and a retry it
            # was starting is recorded not sent before the call is read).
            await asyncio.wait({dispatch}, timeout=MARKING_WAIT_S)
            ended = dispatch.done() and not dispatch.cancelled()
            if ended and isinstance(cut := dispatch.exception(), CutBetweenAttempts):
                return cut.answer
        state: WorkState | None = None
        try:
            if owner:
                state = await self.mark_unknown(call_id, reason)
            else:
                state = await self._ledger.store.get_call(call_id)
            stage = state.stage if state is not None else "missing"
        except LedgerError:  # it closed, or refuses: the call stays as it was
            stage = "in_flight"
        if stage == "effect_unknown" or (owner and stage == "in_flight"):
            return _cut_unknown(call_id, reason, stage)
        # Unread (the ledger refused): advise as for a keyed call, which resends nothing new.
        keyed = state is None or state.idempotency_key is not None
        advice, safe = after_cut_off(call_id, stage, keyed)
        return refuse(
            503,
            "shutting_down",
            f"call {call_id} ended as {stage} as it was cut off ({reason}); {advice}",
            call_id=call_id,
            stage=stage,
            retryable=safe,
        )

    async def joined_end(
        self, call_id: str, prepared: Prepared, report: CallReport | None, reason: str
    ) -> Reply:
        """The answer of a retry that joined ``call_id`` and can wait no longer (a
        shutdown, for ``reason``): once the call has ended here, what its own caller got
        (the provider's last answer, or 504 ``effect_unknown``); a call another worker
        ended, its answer as §4 gives it; else 503 ``shutting_down``, the call not ended
        (another worker's, or one still settling here in the background, its own caller
        gone)."""
        under_way = self._dispatch_of(call_id)
        if under_way is not None:
            # Its caller's cut-off (or the stop's) ends it now, its caller there or gone
            # (the proxy cuts off every request still running): its end, then its marking.
            dispatch, owner = under_way
            await asyncio.wait({dispatch}, timeout=MARKING_WAIT_S)
            if owner.cut is not None:
                await asyncio.wait({owner.cut}, timeout=MARKING_WAIT_S)
        try:
            return await self._joined_end(call_id, prepared, report, reason)
        except LedgerError:  # closed, or refuses: not known to have ended
            raise stopped_waiting(call_id, "in_flight", reason) from None

    async def _joined_end(
        self, call_id: str, prepared: Prepared, report: CallReport | None, reason: str
    ) -> Reply:
        state = await self._ledger.store.get_call(call_id)
        if state is None or self._dispatch_of(call_id) is not None:
            raise stopped_waiting(call_id, state.stage if state else "in_flight", reason)
        if state.worker != self._writer().worker:  # another worker's: ended, or not known to
            if state.stage in ("in_flight", "not_sent", "not_processed"):
                raise stopped_waiting(call_id, state.stage, reason)
            return await joined_result(self._recorder, call_id, state, prepared, report)
        if state.stage in ("effect_unknown", "in_flight"):  # in flight: the marking refused
            raise _cut_unknown(call_id, reason, state.stage)
        if state.stage != "not_sent":
            return await joined_result(self._recorder, call_id, state, prepared, report)
        # A retry started as it was cut off (recorded not sent): the answer before it.
        last = await last_observed(self._recorder, call_id)
        if last is None:  # nothing reached the provider
            raise stopped_waiting(call_id, state.stage, reason)
        self._recorder.observer.request_done(prepared.provider.name, prepared.model or "", "joined")
        return replay(call_id, last, prepared)

    def _dispatch_of(self, call_id: str) -> tuple[asyncio.Future[Reply], Ticket] | None:
        """The dispatch of ``call_id`` under way in this process, with its caller's ticket."""
        for dispatch, ticket in self._under_way.items():
            if ticket.call_id == call_id and not dispatch.done():
                return dispatch, ticket
        return None

    async def mark_unknown(self, call_id: str, reason: str) -> WorkState | None:
        """Interrupt ``call_id``'s current attempt if it is still in flight; its state after."""
        state = await self._ledger.store.get_call(call_id)
        if state is not None and state.stage == "in_flight":
            await self._recorder.interrupt(self._writer(), call_id, state.attempts, reason)
            state = await self._ledger.store.get_call(call_id)
        return state


def _cut_unknown(call_id: str, reason: str, stage: str) -> Refusal:
    """504 ``effect_unknown`` for a call cut off after it was sent: ``stage`` is
    ``in_flight`` when the ledger refused its marking (a later sweep makes it). Its request
    went out all the same: it may have taken effect."""
    later = "" if stage == "effect_unknown" else "once a later start has marked it, "
    return refuse(
        504,
        "effect_unknown",
        f"call {call_id} was cut off ({reason}) after it was admitted; it may have "
        f"taken effect and will not be re-sent automatically; {later}"
        f"{decide_unknown(call_id)}",
        call_id=call_id,
        stage=stage,
        next_operation="reconcile",
    )


async def _answer_of(joined: Awaitable[Reply]) -> Refusal | Reply:
    """``joined``'s answer, its refusal returned rather than raised (as a cut's task)."""
    try:
        return await joined
    except Refusal as refusal:
        return refusal
