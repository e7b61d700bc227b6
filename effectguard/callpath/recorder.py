"""The I/O half of settlement: record observations and interruptions durably, and run
the background work that outlives a caller (docs/contract.md §3.6, §3.6).

Both the guard and its guarded streams write through one :class:`Recorder`, so the
rules for what a failed write means live in one place:

* a fenced worker's observation is refused (502 ``observe_refused``) and kept as
  evidence (:mod:`effectguard.callpath.lateanswers`);
* an observation the ledger could not commit makes the call ``effect_unknown``
  (502 ``observe_failed``), marked now or, if the ledger still refuses, on a later sweep;
* background tasks (abandoned dispatches, drained streams, late markings) are kept
  until done, so :meth:`drain` can wait for them at shutdown.
"""

from __future__ import annotations

import asyncio
from asyncio import FIRST_COMPLETED
from collections.abc import Awaitable, Callable
from typing import Any

from effectguard.callpath.crash import NO_CRASH, CrashPoints
from effectguard.callpath.exchange import Headers
from effectguard.callpath.lateanswers import LateAnswers
from effectguard.callpath.prepare import Prepared, ledger_unavailable, refuse
from effectguard.callpath.storefault import brief as _describe
from effectguard.callpath.storefault import told
from effectguard.callpath.wire import storable_headers
from effectguard.errors import FencedError, LedgerError, Refusal
from effectguard.ledger import Admitted, Ledger, Writer, stopadmit
from effectguard.rules import usage as usages
from effectguard.rules.bodytext import encode_body
from effectguard.rules.events import AttemptNotSent, BudgetReleased, Event
from effectguard.rules.guidance import decide_unknown
from effectguard.rules.settlement import Answer, Settlement, settle
from effectguard.telemetry.observer import NullObserver, Observer
from effectguard.telemetry.report import CallReport

#: The flag on a call whose provider bills its real cost later (a batch): the ledger holds
#: only the declared per-call price, and nothing tracks the batch's own cost yet.
DEFERRED = "cost deferred: billed later by the provider, not tracked by effectguard"


class Recorder(LateAnswers):
    """Writes a call's outcome to the ledger, and owns background work.

    An attempt's outcome is written as the writer that started it (``Admitted.writer``),
    never as a newer registration of this process (a fenced worker registers anew, see
    :class:`~effectguard.callpath.recovery.WorkerRuntime`): so the store refuses it.
    """

    def __init__(
        self,
        ledger: Ledger,
        *,
        crash: CrashPoints = NO_CRASH,
        observer: Observer | None = None,
    ) -> None:
        self.ledger = ledger
        self.crash = crash
        self.observer: Observer = observer or NullObserver()
        self._done: dict[str, asyncio.Event] = {}
        self._background: set[asyncio.Future[Any]] = set()
        #: Streams still to settle, held here so that a client that drops one unread
        #: cannot take its upstream down with it (see :mod:`effectguard.callpath.stream`).
        self.open_streams: set[Any] = set()
        #: Markings to retry: (call, attempt) -> (reason, the writer that started it).
        self._orphans: dict[tuple[str, int], tuple[str, Writer]] = {}
        #: ``attempt.not_sent`` records to retry: (call, attempt) -> (events, writer).
        self._unsent: dict[tuple[str, int], tuple[list[Event], Writer]] = {}
        #: Given a writer the store refused, a writer of this process it accepts now, to
        #: keep a late answer as evidence (the worker runtime registers anew if need be).
        self.evidence_writer: Callable[[Writer], Awaitable[Writer]] = _same_writer
        #: Why a dispatch cancelled from now on was interrupted: its caller went away,
        #: unless the process is stopping (then its 504 and the ledger say why alike).
        self.cancel_reason = "cancelled during dispatch"
        #: Why nothing more is sent: set once a shutdown stops waiting for the calls under
        #: way (None: sending). An attempt admitted after that is recorded not sent.
        self.stopped: str | None = None

    # -- settlement ------------------------------------------------------------
    async def observe(
        self,
        prepared: Prepared,
        admitted: Admitted,
        status: int,
        headers: Headers,
        body: bytes,
        result: usages.UsageResult,
        report: CallReport | None = None,
        retried: bool = False,
    ) -> None:
        """Record the observation and settle the cost, durably (docs/contract.md §3.6).

        ``report``, if given, learns the outcome, usage and cost. ``retried``: an
        automatic retry follows, so this attempt is not the request's outcome (the guard
        counts the request once, when its last attempt is known).
        """
        provider = prepared.provider
        text, encoding = encode_body(body)
        del body  # its text stands for it now (a late answer decodes it): one copy less
        effect = provider.answer_effect(status)
        answer = Answer(
            status=status,
            not_processed=effect == "none",
            headers=storable_headers(headers, [provider.key_header]),
            body=text,
            body_encoding=encoding,
            result=result,
            effect_unknown=effect == "unknown",
        )
        settled = settle(
            admitted.call_id,
            admitted.attempt,
            prepared.admit.budget,
            prepared.reserve,
            prepared.price,
            answer,
            by=admitted.writer.worker,
            deferred=DEFERRED if prepared.endpoint.cost_deferred else None,
            output_cap=prepared.output_cap,
        )
        if settled.actual is not None:
            usage = settled.usage
            self.observer.settled(
                provider.name,
                prepared.model or "",
                usage.input_tokens if usage else 0,
                usage.output_tokens if usage else 0,
                settled.actual,
            )
        await self._record_observation(prepared, admitted, settled)
        if not retried:
            self.observer.request_done(provider.name, prepared.model or "", settled.outcome)
        if report is not None:
            report.stage = report.outcome = settled.outcome
            report.cost_nanos = settled.actual
            if settled.usage is not None:
                report.input_tokens = settled.usage.input_tokens
                report.output_tokens = settled.usage.output_tokens

    async def _record_observation(
        self, prepared: Prepared, admitted: Admitted, settled: Settlement
    ) -> None:
        """Commit the observation; a write that fails becomes a refusal naming the call.

        An observation the store refuses (fenced, or the attempt no longer in flight) is
        kept as evidence instead (:meth:`_keep_late_answer`).
        """
        provider, call_id, model = prepared.provider, admitted.call_id, prepared.model or ""
        writer = admitted.writer
        try:
            await self.ledger.record(writer, call_id, admitted.attempt, list(settled.events))
        except FencedError as exc:
            self.observer.request_done(provider.name, model, "fenced")
            raise await self._refuse_late_answer(prepared, admitted, settled, exc) from exc
        except LedgerError as exc:
            self.observer.request_done(provider.name, model, "observe_failed")
            self.observer.incident("observe_failed", call_id, _describe(exc))
            self.spawn(self.interrupt_attempt(admitted, "observe failed"))
            raise refuse(
                502,
                "observe_failed",
                f"the response to call {call_id} could not be recorded, so its effect is "
                f"unknown ({told(exc, call_id)}); {decide_unknown(call_id)}",
                call_id=call_id,
            ) from exc
        finally:
            self.finish(call_id)

    async def next_attempt(self, prepared: Prepared, previous: Admitted) -> Admitted:
        """Start the automatic retry of ``previous`` (contract.md §3.7), as the call's own writer.

        So a fenced worker starts no new attempt of its calls, even once it has
        registered anew. A retry the budget cannot take raises its 402 refusal; one whose
        start commits once a shutdown stopped sending (:attr:`stopped`, read in its
        transaction) is recorded not sent there and raises 503 ``shutting_down``: recorded
        in a write of its own, a closing ledger could refuse it and leave the call in flight.
        """
        writer = previous.writer
        admitted = await self.ledger.store.write(
            writer,
            lambda tx: stopadmit.start_retry(
                tx,
                writer,
                previous.call_id,
                prepared.reserve,
                previous.provider_idempotency_key,
                prepared.admit.sending,
                lambda: self.stopped,
            ),
        )
        if admitted.refusal is not None:
            raise admitted.refusal
        return admitted

    async def interrupt_attempt(self, admitted: Admitted, reason: str) -> None:
        """Mark ``admitted``'s attempt interrupted, as the writer that started it."""
        await self.interrupt(admitted.writer, admitted.call_id, admitted.attempt, reason)

    async def interrupt(self, writer: Writer, call_id: str, attempt: int, reason: str) -> None:
        """Mark an attempt interrupted (effect unknown); retried by the sweeper if refused."""
        try:
            state, wrote = await self.ledger.interrupt_once(writer, call_id, attempt, reason)
        except FencedError:
            pass  # another worker took this one over; its sweeper marked the call
        except LedgerError as exc:
            # The ledger refused now (disk full, locked): retried on every sweep, as the
            # same writer (if it is fenced meanwhile, its takeover marks the call).
            self._orphans[(call_id, attempt)] = (reason, writer)
            self.observer.incident(
                "interrupt_failed", call_id, f"{reason}; not recorded yet: {_describe(exc)}"
            )
        else:
            # Once, by the path that wrote it: a drain's cut-off and the dispatch it
            # cancels both try, and only the first reason is the ledger's.
            if wrote and state.stage == "effect_unknown" and state.attempts == attempt:
                self.observer.incident("interrupted", call_id, reason)
        finally:
            self.finish(call_id)

    async def not_sent(self, prepared: Prepared, admitted: Admitted, reason: str) -> None:
        """Record that ``admitted``'s attempt never reached the provider, and release it.

        A ledger that refuses the record now raises 503 ``ledger_unavailable``: nothing
        was sent, and a later sweep records it (the call stays in flight until then).
        """
        failed = await self._record_not_sent(prepared, admitted, reason)
        if failed is not None:
            what = (
                f"nothing was sent to {prepared.provider.name} ({reason}), but the ledger "
                "could not record that"
            )
            raise ledger_unavailable(failed, admitted.call_id, what) from failed

    async def lease_lapsed(self, prepared: Prepared, admitted: Admitted) -> Refusal:
        """Record not sent an attempt whose writer's lease lapsed before it went out; the
        refusal for its client (503, nothing sent, retryable).

        The process stood still between recording the attempt and sending it (a pause,
        a suspended machine). Another worker may have taken the call over meanwhile and a
        lookup proven it not applied and sent it again: sent now, it could apply twice.
        """
        why = "the worker's lease lapsed before the attempt was sent (was the process paused?)"
        await self.not_sent(prepared, admitted, why)  # 503 as well if it cannot be recorded
        return refuse(
            503,
            "ledger_unavailable",
            f"call {admitted.call_id} was not sent: {why}; a retry is safe",
            call_id=admitted.call_id,
            retryable=True,
        )

    async def stopped_before_sending(self, prepared: Prepared, admitted: Admitted) -> Refusal:
        """Record not sent an attempt about to go out once a shutdown stopped waiting
        (:attr:`stopped`); the refusal for its client (503 ``shutting_down``, retryable).

        Its admission was still committing (or a keyed resend still deciding its unknown
        call) when the shutdown stopped waiting: sent now, it would start an effect after
        the shutdown decided to stop, its answer left to a ledger about to close.
        """
        reason = f"admitted as the process stopped: {self.stopped}"
        await self.not_sent(prepared, admitted, reason)  # 503 as well if it cannot be recorded
        call_id = admitted.call_id
        return refuse(
            503,
            "shutting_down",
            f"call {call_id} was admitted as this process stopped ({self.stopped}); nothing "
            "was sent, and a resend is safe",
            call_id=call_id,
            stage="not_sent",
            next_operation="resend",
            retryable=True,
        )

    def unsent(self, prepared: Prepared, admitted: Admitted) -> None:
        """The caller of an admission went away (or a stop cut it off) while it committed:
        an attempt it started is never sent, and is recorded so."""
        if admitted.action not in ("refuse", "replay", "recover", "join"):
            why = "its caller went away before it was sent"
            if self.stopped is not None:  # its caller was cut off by the stop
                why = f"admitted as the process stopped: {self.stopped}"
            self.spawn(self._record_not_sent(prepared, admitted, why))

    async def _record_not_sent(
        self, prepared: Prepared, admitted: Admitted, reason: str
    ) -> LedgerError | None:
        """Write ``attempt.not_sent``; the ledger's error if it refused (kept to retry)."""
        call_id = admitted.call_id
        events: list[Event] = [
            AttemptNotSent(call=call_id, attempt=admitted.attempt, reason=reason),
            BudgetReleased(call=call_id, budget=prepared.admit.budget, amount=prepared.reserve),
        ]
        try:
            await self.ledger.record(admitted.writer, call_id, admitted.attempt, events)
        except FencedError as exc:
            return exc  # taken over: the sweeper that fenced this worker marked the call
        except LedgerError as exc:
            # Refused now (disk full, locked): retried on every sweep, as the same writer,
            # so the call does not stay in flight, its key held, until a restart.
            self._unsent[(call_id, admitted.attempt)] = (events, admitted.writer)
            self.observer.incident(
                "not_sent_failed", call_id, f"{reason}; not recorded yet: {_describe(exc)}"
            )
            return exc
        finally:
            self.finish(call_id)
        return None

    def report(self, report: CallReport) -> None:
        """Hand a finished request's report to the observer (once, however often called)."""
        if report.close():
            self.observer.call_finished(report)

    async def retry_orphans(self) -> None:
        """Write the markings and ``attempt.not_sent`` records the ledger refused earlier
        (run by the sweeper)."""
        for (call_id, attempt), (reason, writer) in list(self._orphans.items()):
            try:
                await self.ledger.interrupt(writer, call_id, attempt, reason)
            except FencedError:
                pass
            except LedgerError:
                continue  # still refused; the next sweep tries again. Others go on.
            else:
                self.observer.incident("interrupted", call_id, f"{reason} (marked late)")
            del self._orphans[(call_id, attempt)]
        for (call_id, attempt), (events, writer) in list(self._unsent.items()):
            try:
                await self.ledger.record(writer, call_id, attempt, events)
            except FencedError:
                pass  # taken over, or no longer in flight: nothing left to record
            except LedgerError:
                continue
            del self._unsent[(call_id, attempt)]

    # -- calls in flight in this process -----------------------------------------
    def started(self, call_id: str) -> None:
        """Note that this process dispatches ``call_id`` (joiners wait on it)."""
        self._done.setdefault(call_id, asyncio.Event())

    def finish(self, call_id: str) -> None:
        """Wake whoever waits for ``call_id`` in this process."""
        event = self._done.pop(call_id, None)
        if event is not None:
            event.set()

    def waiter(self, call_id: str) -> asyncio.Event | None:
        """The event set when this process finishes ``call_id`` (None: not ours)."""
        return self._done.get(call_id)

    # -- background work ------------------------------------------------------------
    def spawn(self, coro: Awaitable[Any]) -> None:
        """Run ``coro`` in the background, kept until done so shutdown can wait for it."""
        task: asyncio.Future[Any] = asyncio.ensure_future(coro)
        self.keep(task)

    def keep(self, task: asyncio.Future[Any]) -> None:
        """Hold a reference to ``task`` until it is done."""
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self, timeout: float, cut_off: str | None = None) -> None:
        """Wait (at most ``timeout``) for the calls this process dispatches and for
        background settlements to finish, reading to its end every stream a client left
        open (it would otherwise stay in flight). ``cut_off``: the reason a stream still
        unsettled at the end is interrupted for (effect unknown); None leaves it be."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        await self._drain_until(deadline)
        if cut_off is not None:
            await self.cut_off_streams(cut_off)

    async def cut_off_streams(self, reason: str) -> None:
        """Interrupt every stream still being read (its effect unknown), for ``reason``."""
        for stream in list(self.open_streams):
            await stream.cut_off(reason)

    async def _drain_until(self, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        while (left := deadline - loop.time()) > 0:
            for stream in list(self.open_streams):
                stream.abandon()
            # Calls this process is dispatching finish too: closed under them, the
            # ledger would turn answers on their way into effect_unknown.
            dispatching = {asyncio.ensure_future(done.wait()) for done in self._done.values()}
            pending = set(self._background) | dispatching
            if not pending:
                return
            # Woken often: a dispatch may answer with a stream nobody reads until later.
            await asyncio.wait(pending, timeout=min(left, 0.05), return_when=FIRST_COMPLETED)
            for waiting in dispatching:
                waiting.cancel()


async def _same_writer(writer: Writer) -> Writer:
    """Without a worker runtime, only ``writer`` itself (enough when it was not fenced)."""
    return writer
