"""The guard: the one call path both ways in use (docs/contract.md §3–§4).

``Guard.serve`` takes an upstream-bound :class:`Outbound` and a ``send``
function (the upstream leg) and returns a :class:`Reply` (``Guard.handle`` is the
same over httpx objects, for the transports):

1. *prepare* — parse and price the request (pure; refusals cost nothing);
2. *admit* — one durable transaction: idempotency, reservation, manifest,
   ``attempt.started``;
3. *dispatch* — through ``send``, retried with tenacity only when the attempt
   provably did nothing (not sent, or a declared not-processed status);
4. *observe* — one durable transaction before the response is released
   (streams: at their end, see :mod:`effectguard.callpath.stream`).

Steps 3 and 4 are :class:`~effectguard.callpath.attempts.Attempts`, which ``Guard``
extends.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping

import httpx

from effectguard.callpath.attempts import Attempts, CutBetweenAttempts
from effectguard.callpath.crash import NO_CRASH, CrashPoints
from effectguard.callpath.dispatches import MARKING_WAIT_S, Dispatches
from effectguard.callpath.exchange import Outbound, Reply, Send
from effectguard.callpath.httpxshape import (
    HttpxSend,
    httpx_response,
    httpx_send,
    outbound_from_httpx,
)
from effectguard.callpath.join import StoppedWaiting, join_call
from effectguard.callpath.orphans import Orphans
from effectguard.callpath.prepare import Prepared, ledger_unavailable, prepare
from effectguard.callpath.readonly import describe as _describe
from effectguard.callpath.readonly import forward_read_only
from effectguard.callpath.recorder import Recorder
from effectguard.callpath.replays import replay
from effectguard.callpath.reports import from_state, open_report
from effectguard.callpath.resolve import Resolver
from effectguard.callpath.stream import GuardedStream
from effectguard.callpath.ticket import Ticket
from effectguard.callpath.timing import own_time_of
from effectguard.callpath.wire import recovered_response
from effectguard.config.settings import GuardSettings
from effectguard.errors import FencedError, LedgerError, LedgerUnavailable, Refusal
from effectguard.ledger import Admitted, Ledger, Writer
from effectguard.providers import Provider
from effectguard.rules import budget as budgets
from effectguard.telemetry.observer import Observer
from effectguard.telemetry.report import CallReport


class Guard(Attempts):
    """Admits, dispatches, observes and settles every billable request."""

    def __init__(
        self,
        ledger: Ledger,
        providers: Mapping[str, Provider],
        *,
        writer: Writer,
        settings: GuardSettings | None = None,
        crash: CrashPoints = NO_CRASH,
        observer: Observer | None = None,
        resolver: Resolver | None = None,
    ) -> None:
        self.ledger = ledger
        self.providers = dict(providers)
        #: New calls are admitted as this; a fenced worker registers anew and replaces it.
        self.writer = writer
        self.settings = settings or GuardSettings()
        self.recorder = Recorder(ledger, crash=crash, observer=observer)
        self.crash = crash
        self.observer = self.recorder.observer
        #: Decides unknown effects from evidence (lookups, the application's hook).
        self.resolver = resolver or Resolver(ledger, self.providers)
        #: Key-less calls whose caller left before their answer, for its own retry.
        self.orphans = Orphans()
        self.dispatches = Dispatches(ledger, self.recorder, lambda: self.writer)
        #: An admission's caller was cancelled while it committed (it commits on, its end
        #: told to ``Recorder.unsent``): a stop waits for it (``runtime.settle_admissions``).
        self.admissions_cut = False

    # -- the call path --------------------------------------------------------
    async def handle(
        self,
        provider: Provider,
        request: httpx.Request,
        send: HttpxSend,
        *,
        budget: str = budgets.DEFAULT_BUDGET,
    ) -> httpx.Response:
        """:meth:`serve` over httpx objects (``request`` already read)."""
        outbound = outbound_from_httpx(request)
        reply = await self.serve(provider, outbound, httpx_send(send), budget=budget)
        return httpx_response(reply, request)

    async def serve(
        self,
        provider: Provider,
        request: Outbound,
        send: Send,
        *,
        budget: str = budgets.DEFAULT_BUDGET,
        budget_root: str | None = None,
        ticket: Ticket | None = None,
    ) -> Reply:
        """Run ``request`` through the call path; refusals raise :class:`Refusal`.

        ``ticket``, if given, learns the call id as soon as the request becomes a call.
        The observer hears of the request when it starts and once when its outcome is
        known (a guarded stream reports at its end).
        """
        report = open_report(provider, request, budget)
        if ticket is not None:
            report.key = ticket.key
        self.observer.call_started(report)
        try:
            response = await self._handle(
                provider, request, send, report, budget, budget_root, ticket or Ticket()
            )
        except Refusal as refusal:
            report.refused(refusal)
            if ticket is not None and ticket.report_later:
                ticket.report = report  # written once its refusal is (499 if its client left)
            else:
                self.recorder.report(report)
            raise
        except asyncio.CancelledError:
            # The caller went away; a dispatched call still settles in the background.
            report.status, report.outcome = 499, report.outcome or "cancelled"
            if ticket is not None and ticket.report_later:
                ticket.report = report  # the proxy's drain answers it (504), then reports
            else:
                self.recorder.report(report)
            raise
        except Exception as exc:
            report.status, report.error, report.outcome = 500, "internal_error", "error"
            report.message = _describe(exc)
            self.recorder.report(report)
            raise
        report.status = response.status
        if ticket is not None and ticket.report_later:
            ticket.report = report  # a stream's is still reported at its end
        elif not isinstance(response.stream, GuardedStream):
            self.recorder.report(report)
        return response

    async def _handle(
        self,
        provider: Provider,
        request: Outbound,
        send: Send,
        report: CallReport,
        budget: str,
        budget_root: str | None,
        ticket: Ticket,
    ) -> Reply:
        try:
            prepared = prepare(
                provider, request, self.settings, budget=budget, budget_root=budget_root
            )
            if prepared is None:  # read-only: nothing to guard
                report.outcome = report.stage = "read_only"
                return await forward_read_only(
                    provider, request, send, report, self.observer, self.settings
                )
            report.model, report.budget = prepared.model or "", prepared.admit.budget
            prepared = self._adopting(prepared, ticket)
            admitted = await self._admit(prepared)
        except Refusal as refusal:
            report.model = report.model or refusal.model or ""
            self.observer.refused(provider.name, refusal.type)
            raise
        report.call_id = ticket.admitted(admitted.call_id, self.orphans)
        if _unknown_resend(prepared, admitted):
            # A keyed resend met an effect-unknown call: evidence may decide it now. Then it
            # is admitted anew, from the call as it stands: decided by this evidence, or by
            # a concurrent resend's (an attempt, the recovered result, in progress, or 409).
            await self.resolver.at_resend(admitted.call_id, prepared.request, send)
            admitted = await self._admit(prepared)
        self.crash.hit("after:admit")
        if admitted.action == "refuse":
            assert admitted.refusal is not None
            self.observer.refused(provider.name, admitted.refusal.type)
            raise admitted.refusal
        if admitted.action in ("replay", "recover"):
            self.observer.request_done(provider.name, prepared.model or "", "replayed")
            from_state(report, admitted.state, "replayed")
            if admitted.recovered is not None:
                return recovered_response(admitted.call_id, admitted.recovered)
            return replay(admitted.call_id, admitted.observed, prepared)
        try:
            if admitted.action == "join":
                return await self._joined(prepared, admitted.call_id, report, ticket)
            return await self._dispatched(prepared, admitted, send, report, ticket)
        except asyncio.CancelledError:  # the caller left: its retry gets the answer
            self.orphans.left(ticket.retry_key, admitted.call_id)
            raise

    async def _joined(
        self, prepared: Prepared, call_id: str, report: CallReport, ticket: Ticket
    ) -> Reply:
        """Wait for ``call_id``, which this request retries (callpath/join); stopped by a
        shutdown, answered as the call ends here (``Dispatches.joined_end``)."""
        ticket.joining = prepared
        try:
            return await join_call(self.recorder, self.settings, call_id, prepared, report)
        except StoppedWaiting as stop:
            return await self.dispatches.joined_end(call_id, prepared, report, stop.reason)

    async def _dispatched(
        self, prepared: Prepared, admitted: Admitted, send: Send, report: CallReport, ticket: Ticket
    ) -> Reply:
        self.recorder.started(admitted.call_id)
        # The dispatch runs in its own task: a caller that goes away does not cancel a
        # call the provider is already working on (docs/contract.md §3.8); it is read and settled.
        dispatch = self._dispatch(prepared, admitted, send, report)
        task = asyncio.ensure_future(own_time_of(dispatch, self.observer, report))
        self.dispatches.add(ticket, task)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if ticket.cut is not None and not _cancelling():
                # Cut off by a shutdown while its caller still waits: it is told why.
                cut = await asyncio.shield(ticket.cut)
                if isinstance(cut, Reply):
                    return cut
                raise cut from None
            self.recorder.keep(task)
            task.add_done_callback(self._abandoned)
            raise
        except CutBetweenAttempts as cut:  # the provider's last answer stands (§3.5)
            return cut.answer
        except (Refusal, LedgerError):
            raise
        except Exception as exc:
            # A fault of ours after admission: the call must not stay in flight for good.
            why = f"internal error: {exc!r}"
            self.recorder.spawn(self.dispatches.mark_unknown(admitted.call_id, why))
            raise
        except BaseException:  # SystemExit, Ctrl-C: left in flight for recovery (§3.8),
            self.recorder.finish(admitted.call_id)  # but no drain or joiner waits for it
            raise

    def cut_off(self, ticket: Ticket, reason: str) -> asyncio.Task[Refusal | Reply]:
        """End a call whose caller can wait no longer (:meth:`Dispatches.cut_off`)."""
        return self.dispatches.cut_off(ticket, reason)

    async def drain(self, timeout: float, cut_off: str | None = None) -> None:
        """Wait (at most ``timeout``) for the calls under way and the background
        settlements; then cut off, for ``cut_off``, the streams and dispatches still
        under way, marked before this returns (None: they are left be). With ``cut_off``, no
        attempt is sent from then on."""
        await self.recorder.drain(timeout, cut_off)
        if cut_off is None:
            return
        # From here nothing more is sent: a call whose admission still commits would
        # start its effect after the shutdown stopped, its answer left to a closed ledger.
        self.recorder.stopped = cut_off
        if await self.dispatches.cut_off_all(cut_off):
            # The markings their cancelled sends spawned, before the ledger closes.
            await self.recorder.drain(MARKING_WAIT_S)

    def stop_at_once(self, reason: str) -> None:
        """Stop without draining, for ``reason`` (a second signal): nothing is sent from
        now on, as after :meth:`drain` (an admission committing now would start its effect
        after the process was told to stop at once), a dispatch cancelled as the process
        ends is interrupted for ``reason``, and the streams under way are cut off now."""
        self.recorder.stopped = self.recorder.cancel_reason = reason
        self.recorder.spawn(self.recorder.cut_off_streams(reason))

    def _abandoned(self, task: asyncio.Future[Reply]) -> None:
        """Settle the response of a dispatch whose caller went away."""
        if task.cancelled() or task.exception() is not None:
            return
        self.recorder.spawn(task.result().aclose())

    def _adopting(self, prepared: Prepared, ticket: Ticket) -> Prepared:
        """``prepared``, naming the call it repeats if its caller left (callpath/orphans)."""
        ticket.check_client()
        admit = prepared.admit
        if admit.idempotency_key is not None:
            return prepared
        ticket.retry_key = key = (admit.budget_root, admit.request_hash)
        orphan = self.orphans.take(key, admit.retry_window_s) if admit.is_retry else None
        if orphan is None:
            return prepared
        return dataclasses.replace(prepared, admit=dataclasses.replace(admit, orphan_of=orphan))

    async def _admit(self, prepared: Prepared) -> Admitted:
        # The admission commits even if its caller goes away meanwhile (a cancelled caller
        # never stops a commit): an attempt it started is then recorded as never sent. Left
        # alone, it would sit in flight until a restart marked it effect_unknown.
        try:
            # Read in the admission's transaction: one that waited for the ledger past the
            # stop records its attempt not sent there (ledger/stopadmit).
            return await self.ledger.admit(
                self.writer,
                prepared.admit,
                lambda a: self.recorder.unsent(prepared, a),
                lambda: self.recorder.stopped,
            )
        except (LedgerUnavailable, FencedError) as exc:
            raise ledger_unavailable(exc) from exc
        except asyncio.CancelledError:
            self.admissions_cut = True
            raise


def _cancelling() -> bool:
    """Whether the running task is being cancelled (its caller went away), rather than
    seeing the cancellation of a task it awaits."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _unknown_resend(prepared: Prepared, admitted: Admitted) -> bool:
    """Whether admission refused a keyed resend because its call's effect is unknown."""
    refusal, keyed = admitted.refusal, prepared.admit.idempotency_key is not None
    return keyed and refusal is not None and refusal.type == "effect_unknown"
