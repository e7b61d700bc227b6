"""A call's attempts: each announced, sent and observed; a retry only when one provably
did nothing (not sent, or a declared not-processed status).

:class:`Attempts` is the half of :class:`~effectguard.callpath.guard.Guard` that runs
after admission, steps 3 and 4 of its call path (dispatch and observe).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable
from typing import TypeVar

import httpx
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from effectguard.callpath.crash import CrashPoints
from effectguard.callpath.exchange import (
    Outbound,
    Reply,
    Send,
    Upstream,
    header_value,
    read_body,
)
from effectguard.callpath.outgoing import outgoing_request, past_lease
from effectguard.callpath.prepare import Prepared, ledger_unavailable, refuse, usage_of
from effectguard.callpath.readonly import describe as _describe
from effectguard.callpath.recorder import Recorder
from effectguard.callpath.stream import GuardedStream
from effectguard.callpath.timing import failed, waited
from effectguard.callpath.wire import (
    answer_kind,
    classify_transport_error,
    client_headers,
    final_answer,
    timed_out,
    unobservable,
)
from effectguard.config.settings import GuardSettings
from effectguard.errors import FencedError, LedgerError, Refusal
from effectguard.ledger import Admitted
from effectguard.rules.guidance import decide_unknown
from effectguard.rules.keymask import key_of, mask_key
from effectguard.telemetry.observer import Observer
from effectguard.telemetry.report import CallReport


class _RetryAttempt(Exception):
    """This attempt provably did nothing; a retry may start (carries the last answer)."""

    def __init__(self, response: Reply | None, refusal: Refusal | None) -> None:
        super().__init__("retryable attempt")
        self.response = response
        self.refusal = refusal


T = TypeVar("T")


#: How long a dispatch cut off while its retry is starting waits for that start to commit:
#: well within the cut-off's own wait for the dispatch (``dispatches.MARKING_WAIT_S``, 5 s),
#: so the cut-off has the provider's last answer, not a 503, whatever the start's pace.
RETRY_START_WAIT_S = 2.0


class CutBetweenAttempts(Exception):
    """A shutdown cut the call off between two of its attempts (contract.md §3.5, §3.8):
    none was on its way, and the provider's answer to the last one, a status it declares
    not processed, is the caller's answer (``answer``), as when the retries run out."""

    def __init__(self, answer: Reply) -> None:
        super().__init__("cut off between attempts")
        self.answer = answer


class Attempts:
    """Dispatches an admitted call's attempts and observes each (a part of ``Guard``)."""

    recorder: Recorder
    settings: GuardSettings
    crash: CrashPoints
    observer: Observer

    async def _dispatch(
        self, prepared: Prepared, admitted: Admitted, send: Send, report: CallReport
    ) -> Reply:
        s = self.settings
        current = admitted
        try:
            # The first attempt runs outside tenacity: most calls need no retry, and
            # building the retry machinery costs ~5% of the proxy's CPU per request.
            try:
                return await self._attempt(prepared, current, send, report)
            except _RetryAttempt as first:
                if s.max_retries < 1:
                    raise
                previous = first
                # tenacity backs off from here on
                await self._resting(prepared, report, previous, asyncio.sleep(s.retry_wait_s))
            retrying = AsyncRetrying(
                stop=stop_after_attempt(s.max_retries),
                wait=wait_exponential(multiplier=s.retry_wait_s, max=s.retry_wait_max_s),
                retry=retry_if_exception_type(_RetryAttempt),
                reraise=True,
                sleep=lambda wait: self._resting(prepared, report, previous, asyncio.sleep(wait)),
            )
            async for attempt in retrying:
                with attempt:
                    nxt = await self._next_attempt(prepared, current, previous, report)
                    if isinstance(nxt, Reply):  # the last answer stands: its outcome counts
                        self._count(prepared, report.outcome)
                        return nxt
                    current = nxt
                    try:
                        return await self._attempt(prepared, current, send, report, previous)
                    except _RetryAttempt as again:
                        previous = again
                        raise
        except _RetryAttempt as last:
            # Counted here, once: the attempts retried before it were not the outcome.
            self._count(prepared, "not_sent" if last.refusal is not None else report.outcome)
            if last.refusal is not None:
                raise last.refusal from None
            assert last.response is not None
            return last.response
        raise AssertionError("unreachable: tenacity either returns or re-raises")

    async def _next_attempt(
        self, prepared: Prepared, previous: Admitted, answered: _RetryAttempt, report: CallReport
    ) -> Admitted | Reply:
        """The next attempt; if the ledger will not start it, the provider's last answer,
        if there was one: a 503 ``ledger_unavailable`` says nothing was sent (contract.md §9)."""
        # Shielded: a commit is never stopped, and a retry started as a shutdown cuts the
        # call off must be recorded not sent, not left in flight for a cut-off to mark
        # effect unknown (or a later start to find).
        starting = asyncio.ensure_future(self.recorder.next_attempt(prepared, previous))
        try:
            return await asyncio.shield(starting)
        except asyncio.CancelledError:
            # Bounded, within the cut-off's wait for this dispatch (dispatches.MARKING_WAIT_S):
            # a start still slow then would have the cut-off answer 503 shutting_down for
            # a call the provider answered. It is recorded not sent once it commits.
            await asyncio.wait({starting}, timeout=RETRY_START_WAIT_S)
            unsent = self._unsent_start(prepared, starting)
            if starting.done():
                await unsent
            else:
                self.recorder.spawn(unsent)
            if answered.response is None:
                raise
            raise self._cut_between(prepared, report, answered.response) from None
        except Refusal as refusal:
            # A retry whose start committed once a shutdown stopped sending is recorded
            # not sent; the provider's answer to the attempt before stands (§3.5).
            if refusal.type == "shutting_down" and answered.response is not None:
                return answered.response
            raise
        except (LedgerError, FencedError) as exc:
            if answered.response is not None:
                return answered.response
            # Nothing reached the provider, and the call is not_sent: a retry is safe.
            raise ledger_unavailable(
                exc, previous.call_id, "the next attempt could not be recorded; nothing was sent"
            ) from exc

    async def _unsent_start(self, prepared: Prepared, starting: asyncio.Future[Admitted]) -> None:
        """A retry whose start (``starting``) committed as its dispatch was cut off,
        recorded not sent (one committing once the guard stopped sending is already)."""
        await asyncio.wait({starting})
        if not starting.cancelled() and starting.exception() is None:
            why = f"admitted as the process stopped: {self.recorder.cancel_reason}"
            with contextlib.suppress(Refusal):  # kept and retried on every sweep
                await self.recorder.not_sent(prepared, starting.result(), why)

    async def _ready(self, prepared: Prepared, admitted: Admitted, report: CallReport) -> Outbound:
        """The attempt's request, announced; never sent past the lease it was admitted
        under (contract.md §7): a worker that stood still since may have been taken over;
        nor once a shutdown has stopped waiting for the calls under way (contract.md §3.8)."""
        if self.recorder.stopped is not None:
            raise await self.recorder.stopped_before_sending(prepared, admitted)
        if past_lease(admitted):
            raise await self.recorder.lease_lapsed(prepared, admitted)
        outgoing = outgoing_request(prepared, admitted)
        report.attempts = admitted.attempt
        self.observer.dispatching(report, outgoing)
        return outgoing

    async def _attempt(
        self,
        prepared: Prepared,
        admitted: Admitted,
        send: Send,
        report: CallReport,
        answered: _RetryAttempt | None = None,
    ) -> Reply:
        provider, call_id = prepared.provider, admitted.call_id
        try:
            outgoing = await self._ready(prepared, admitted, report)
        except (Refusal, asyncio.CancelledError) as unsent:
            return self._unsent_retry(prepared, report, unsent, answered)
        sent_at = time.perf_counter()
        try:
            response = await send(outgoing)
            self.crash.hit("after:dispatch")
            content_type = header_value(response.headers, "content-type")
            coding = header_value(response.headers, "transfer-encoding")
            kind = answer_kind(response.status, content_type, prepared.stream, coding)
            if kind == "stream":
                return self._streamed(prepared, admitted, response, sent_at, report)
            limit, within = self.settings.max_answer_bytes, self.settings.upstream_read_timeout_s
            try:
                # Raw bytes: stored and forwarded exactly as received (we ask for identity).
                body = None if kind == "not_http" else await read_body(response, limit, within)
            finally:
                await response.aclose()
        except httpx.TransportError as exc:
            return await self._transport_failed(prepared, admitted, exc, report, sent_at)
        except asyncio.CancelledError:
            self._cut_off(prepared, admitted, report, sent_at)
            raise
        if body is None:
            waited(self.observer, provider.name, report, sent_at, "error")
            why, reason = unobservable(response.status, kind, limit, coding)
            raise await self._effect_unknown(prepared, admitted, why, reason, 502)
        waited(self.observer, provider.name, report, sent_at, "answered")
        self.crash.hit("after:upstream-response")
        if not 200 <= response.status < 300:  # a success is never searched (rules/keymask)
            body = mask_key(body, key_of(outgoing.header(provider.key_header), provider.key_format))
        result = usage_of(prepared, body)
        retried = response.status in provider.retry_statuses
        await self.recorder.observe(
            prepared, admitted, response.status, response.headers, body, result, report, retried
        )
        self.crash.hit("after:observe")
        headers = client_headers(response.headers, call_id)
        if response.status >= 400 and provider.answer_effect(response.status) != "none":
            headers = final_answer(headers, provider.error_shape)
        answer = Reply(response.status, headers, body=body, extensions=response.extensions)
        if retried:
            raise _RetryAttempt(answer, None)
        return answer

    def _streamed(
        self,
        prepared: Prepared,
        admitted: Admitted,
        response: Upstream,
        sent_at: float,
        report: CallReport,
    ) -> Reply:
        """An event stream's answer: forwarded as it arrives and observed at its end
        (callpath/stream), cut off unless it ends ``upstream_stream_timeout_s`` after its
        headers."""
        s = self.settings
        stream = GuardedStream(
            self.recorder, prepared, admitted, response, sent_at, report, s.max_answer_bytes
        )
        stream.end_within(s.upstream_stream_timeout_s)
        headers = client_headers(response.headers, admitted.call_id)
        return Reply(response.status, headers, stream=stream, extensions=response.extensions)

    async def _transport_failed(
        self,
        prepared: Prepared,
        admitted: Admitted,
        exc: httpx.TransportError,
        report: CallReport,
        sent_at: float,
    ) -> Reply:
        waited(self.observer, prepared.provider.name, report, sent_at, failed(exc))
        call_id = admitted.call_id
        if classify_transport_error(exc) == "not_sent":
            await self.recorder.not_sent(prepared, admitted, _describe(exc))
            raise _RetryAttempt(
                None,
                refuse(
                    502,
                    "upstream_unreachable",
                    f"could not connect to {prepared.provider.name}; nothing was sent: "
                    f"{_describe(exc)}",
                    call_id=call_id,
                    stage="not_sent",
                    next_operation="resend",
                    retryable=True,
                ),
            )
        timeout = timed_out(exc)
        why = f"the upstream {'timed out' if timeout else 'failed'} after the request was sent"
        raise await self._effect_unknown(
            prepared, admitted, why, _describe(exc), 504 if timeout else 502
        ) from exc

    def _cut_off(
        self, prepared: Prepared, admitted: Admitted, report: CallReport, sent_at: float
    ) -> None:
        """Cut off (callpath/ticket) while the request may be on the wire: its attempt is
        interrupted, in the background (the caller is leaving)."""
        waited(self.observer, prepared.provider.name, report, sent_at, "timeout")
        self.recorder.spawn(self.recorder.interrupt_attempt(admitted, self.recorder.cancel_reason))

    def _unsent_retry(
        self,
        prepared: Prepared,
        report: CallReport,
        unsent: Refusal | asyncio.CancelledError,
        answered: _RetryAttempt | None,
    ) -> Reply:
        """The answer for an attempt :meth:`_ready` would not send (``unsent``: its
        refusal, or a shutdown's cut-off while it refused): the provider's answer to the
        attempt it retries (``answered``), if there was one, else ``unsent`` raised.

        Its refusals say nothing was sent: a 503 ``ledger_unavailable`` (the lease lapsed
        before it went out), a 503 ``shutting_down`` (a shutdown stopped sending). But the
        provider was reached and its answer is the truth (contract.md §3.5), as when the
        retry cannot even be started (:meth:`_next_attempt`).
        """
        last = answered.response if answered is not None else None
        if last is None:
            raise unsent
        if isinstance(unsent, asyncio.CancelledError):
            raise self._cut_between(prepared, report, last) from None
        self._count(prepared, report.outcome)
        return last

    async def _resting(
        self, prepared: Prepared, report: CallReport, answered: _RetryAttempt, wait: Awaitable[T]
    ) -> T:
        """``wait``, a back-off between attempts; cut off meanwhile by a shutdown, the call
        ends with the provider's answer to the attempt before (:meth:`_cut_between`)."""
        try:
            return await wait
        except asyncio.CancelledError:
            if answered.response is None:  # nothing reached the provider: the cut's 503 says so
                raise
            raise self._cut_between(prepared, report, answered.response) from None

    def _cut_between(
        self, prepared: Prepared, report: CallReport, answer: Reply
    ) -> CutBetweenAttempts:
        """What a dispatch cut off between attempts raises instead of its cancellation:
        the provider's ``answer`` to the attempt before, its outcome counted."""
        self._count(prepared, report.outcome)
        return CutBetweenAttempts(answer)

    def _count(self, prepared: Prepared, outcome: str) -> None:
        self.observer.request_done(prepared.provider.name, prepared.model or "", outcome)

    async def _effect_unknown(
        self,
        prepared: Prepared,
        admitted: Admitted,
        why: str,
        reason: str,
        status: int,
    ) -> Refusal:
        """Interrupt a dispatched attempt whose answer was not observed (``reason`` is
        recorded as the attempt's), and the refusal that tells the client so."""
        call_id = admitted.call_id
        await self.recorder.interrupt_attempt(admitted, reason)
        self._count(prepared, "effect_unknown")
        return refuse(
            status,
            "effect_unknown",
            f"{why}; call {call_id} may have taken effect and will not be re-sent "
            f"automatically ({reason}); {decide_unknown(call_id)}",
            call_id=call_id,
            stage="effect_unknown",
            next_operation="reconcile",
        )
