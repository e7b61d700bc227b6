"""A guarded server-sent-event stream: chunks forwarded as they arrive, the call
observed and settled durably before the stream's terminal event is released.

* The terminal chunk (``[DONE]``, ``message_stop`` …) is held back until the
  observation is committed, so a client that saw the end knows it is recorded.
* A stream that breaks mid-way records ``attempt.interrupted`` (effect unknown)
  and ends the client's stream with an error, never with a clean finish. An end
  of stream (EOF) before the terminal event is such a break, however cleanly the
  upstream closed the connection: a close-delimited stream cut short looks clean
  to HTTP, and only the event stream itself knows it is incomplete (docs/contract.md §12).
* A stream larger than ``max_answer_bytes`` is broken off there, as above: the whole
  of it is kept for the ledger, so an endless stream must not be read forever.
* So is a stream that has not ended ``stream_timeout_s`` after its headers, as a read
  timeout breaks it: an upstream that trickles, never silent for its read timeout, would
  otherwise hold the call (its reservation, its connections, its client) for as long as
  it kept sending. One timer per stream, cancelled when it settles.
* A client that goes away (``aclose`` before the end) does not cancel the
  call: the upstream is read to its end in the background, then recorded and
  settled (docs/contract.md §3.8).
* So does a client that drops the stream without closing it (an SDK stream left to
  the garbage collector). Its iterator is finalized, which starts that background
  read; and the recorder holds every unsettled stream, so the upstream it reads is
  never collected in the same sweep (which would look like an end before the terminal
  event, a broken stream, for an answer the provider sent whole).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx

from effectguard.callpath.exchange import Upstream, answer_too_slow
from effectguard.callpath.prepare import Prepared
from effectguard.callpath.recorder import Recorder
from effectguard.callpath.timing import Ending, failed, own_time, waited
from effectguard.callpath.wire import answer_too_large
from effectguard.errors import Refusal
from effectguard.ledger import Admitted
from effectguard.rules.addedusage import AddedUsage
from effectguard.rules.streamusage import StreamUsage
from effectguard.telemetry.report import CallReport

#: The reason recorded for a stream dropped half read as its event loop shut down.
LOOP_ENDED = (
    "stream left unread: its event loop shut down (asyncio.run ended) before the end "
    "was read; the provider may have sent it whole"
)


def _loop_shutting_down() -> bool:
    """Whether the running loop is closing its async generators (``asyncio.run`` ending).

    No public API says so; asyncio's and uvloop's loops both keep this flag.
    """
    loop = asyncio.get_running_loop()
    return bool(getattr(loop, "_asyncgens_shutdown_called", False))


class GuardedStream:
    """The client's view of an upstream stream, with ledger bookkeeping.

    Its failures are raised as ``httpx.RemoteProtocolError`` whatever client the
    upstream leg uses: the transports hand them to SDKs as they are, and the proxy
    ends the client's response with an error.
    """

    def __init__(
        self,
        recorder: Recorder,
        prepared: Prepared,
        admitted: Admitted,
        upstream: Upstream,
        sent_at: float,
        report: CallReport,
        limit: int,
    ) -> None:
        """``limit``: the most bytes of the stream read (``max_answer_bytes``); past it the
        stream is broken off, since the whole of it is kept for the ledger."""
        self._recorder = recorder
        self._prepared = prepared
        self._admitted = admitted
        self._upstream = upstream
        self._chunks: AsyncIterator[bytes] = upstream.aiter_raw()
        self._parser = StreamUsage(prepared.provider.dialect, prepared.path)
        self._received: list[bytes] = []
        self._size = 0
        self._limit = limit
        self._sent_at = sent_at
        #: The request's report, handed to the observer when the stream settles.
        self._report = report
        self._forwarded = 0
        self._settled = False
        self._draining = False
        #: Why :meth:`cut_off` stopped it, told to a reader still reading then.
        self._cut_reason: str | None = None
        #: A read of the upstream is under way (a second reader must not start then).
        self._pulling = False
        #: What the client is shown, where effectguard asked for a usage event it did not.
        self._shown = AddedUsage() if prepared.usage_added else None
        #: The end of ``stream_timeout_s`` (see :meth:`end_within`), until it settles.
        self._deadline: asyncio.TimerHandle | None = None
        recorder.open_streams.add(self)

    def end_within(self, seconds: float) -> None:
        """Cut the stream off, as a read timeout would, unless it has settled ``seconds``
        from now (0: no bound)."""
        if seconds > 0:
            loop = asyncio.get_running_loop()
            self._deadline = loop.call_later(seconds, self._too_slow, seconds)

    def _too_slow(self, seconds: float) -> None:
        """``stream_timeout_s`` is over: the stream is broken off where it stands, with the
        read under way, if any, told why (:meth:`cut_off` does the same for a drain)."""
        self._deadline = None
        if self._settled or self._parser.finished:
            return  # settled, or its end came in time and is being recorded now
        why = answer_too_slow("stream_timeout_s", seconds)
        self._cut_reason = why
        self._recorder.spawn(self._broken(why, "timeout"))

    async def __aiter__(self) -> AsyncIterator[bytes]:
        shown = self._shown
        try:
            async for chunk in self._pull():
                if shown is not None and not (chunk := shown.feed(chunk)):
                    continue  # inside an event: the rest of it comes in a later chunk
                yield chunk
                self._forwarded += 1
                if self._forwarded == 1:
                    self._recorder.crash.hit("mid-stream")
            if shown is not None and (rest := shown.flush()):
                yield rest
        finally:
            self.abandon()  # stopped early, closed or dropped: settle in the background

    def _settle(self) -> None:
        self._settled = True
        self._recorder.open_streams.discard(self)
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    async def _pull(self, background: bool = False) -> AsyncIterator[bytes]:
        while True:
            if self._draining and not background:
                # Read in the background now (the transport closed): the rest goes to the
                # ledger, not here, and a stream that just stopped would look whole.
                raise httpx.RemoteProtocolError(
                    "this stream is being read to its end in the background (its transport "
                    f"closed); call {self._admitted.call_id} will be recorded: resend it with "
                    "the same Idempotency-Key to receive its answer"
                )
            if self._settled:
                if self._cut_reason is not None:  # cut off between two reads: not an end
                    raise self._broken_error(self._cut_reason)
                return
            self._pulling = True
            try:
                chunk = await self._chunks.__anext__()
            except StopAsyncIteration:
                if not self._parser.complete:
                    if background and _loop_shutting_down():
                        # Not the provider's doing: asyncio.run closed the upstream's
                        # reader with the stream half read, and no end can be read now.
                        await self._interrupted(LOOP_ENDED)
                        raise self._broken_error(LOOP_ENDED) from None
                    await self._broken("ended before its terminal event")
                    raise self._broken_error("ended before its terminal event") from None
                await self._observe_or_fail()
                return
            except httpx.TransportError as exc:
                # Cut off under its reader (cut_off closed the upstream): that is the why.
                why = self._cut_reason or str(exc) or type(exc).__name__  # some carry no text
                await self._broken(why, failed(exc))
                raise self._broken_error(why) from exc
            finally:
                self._pulling = False
            if self._settled:
                if self._cut_reason is not None:  # its reader must not see a clean end
                    raise self._broken_error(self._cut_reason)
                return
            self._size += len(chunk)
            if self._size > self._limit:
                why = answer_too_large(self._upstream.status, self._limit)
                await self._broken(why)
                raise self._broken_error(why)
            offset = self._parser.fed
            self._take(chunk)
            if self._parser.finished:
                chunk = self._up_to_the_end(chunk, offset)
                # Hold the terminal event back until the observation is durable; what
                # came before it in the same chunk goes to the client now (a fast
                # upstream often sends a whole stream in one chunk).
                terminal = self._parser.terminal_at
                cut = 0 if terminal is None else terminal - offset
                if cut > 0:
                    yield chunk[:cut]
                    chunk = chunk[cut:]
                await self._observe_or_fail()
            yield chunk

    def _up_to_the_end(self, chunk: bytes, offset: int) -> bytes:
        """``chunk`` (the last taken, at stream ``offset``), up to the end of the terminal
        event in it. Once per stream: the bytes behind it in the same read are neither the
        client's nor the ledger's, as they are not when they come a read later (the
        upstream is closed at the terminal event), contract.md §12."""
        end = self._parser.terminal_end
        if end is None or end - offset >= len(chunk):
            return chunk
        chunk = self._received[-1] = chunk[: max(end - offset, 0)]
        return chunk

    def _take(self, chunk: bytes) -> None:
        self._received.append(chunk)
        self._parser.feed(chunk)

    async def _observe_or_fail(self) -> None:
        if self._settled:
            return  # cut off while it waited (cut_off): recorded there
        try:
            await self._observe()
        except Refusal as exc:
            self._report.refused(exc)
            self._report.status = self._upstream.status  # already on its way
            raise httpx.RemoteProtocolError(exc.message) from exc
        finally:
            self._recorder.report(self._report)

    async def _observe(self) -> None:
        if self._settled:
            return
        self._settle()
        await self._upstream.aclose()
        recorder = self._recorder
        self._waited("answered")
        recorder.crash.hit("after:upstream-response")
        try:
            await recorder.observe(
                self._prepared,
                self._admitted,
                self._upstream.status,
                self._upstream.headers,
                self._joined(),
                self._parser.result(),
                self._report,
            )
        finally:
            # As for a plain answer: admission and observation, not the stream's time;
            # taken also when the observation failed (observe_failed), as there.
            own_time(recorder.observer, self._report)
        recorder.crash.hit("after:observe")

    def _joined(self) -> bytes:
        """The answer's bytes, once: the chunks are let go as they are joined, so a large
        stream is not held twice while it is recorded (docs/configuration.md)."""
        received, self._received = self._received, []
        return b"".join(received)

    def _waited(self, ending: Ending) -> None:
        provider = self._prepared.provider.name
        waited(self._recorder.observer, provider, self._report, self._sent_at, ending)

    async def _broken(self, why: str, ending: Ending = "error") -> None:
        await self._interrupted(f"stream broke: {why}"[:300], ending)

    async def cut_off(self, reason: str) -> None:
        """Stop reading a stream whose end will not be waited for (a drain or close ended):
        its attempt is interrupted, its effect unknown, unless it settled first."""
        if not self._settled:
            self._cut_reason = reason
        await self._interrupted(reason, "timeout")  # effectguard stopped waiting for its end

    async def _interrupted(self, reason: str, ending: Ending = "error") -> None:
        if self._settled:
            return  # once: a stream cut off, then ending under its reader, is one record
        self._settle()
        await self._upstream.aclose()
        self._waited(ending)
        try:
            await self._recorder.interrupt_attempt(self._admitted, reason)
        finally:
            own_time(self._recorder.observer, self._report)
            prepared = self._prepared
            model = prepared.model or ""
            self._recorder.observer.request_done(prepared.provider.name, model, "effect_unknown")
            self._report.stage = self._report.outcome = "effect_unknown"
            self._report.error = "stream_broken"
            self._recorder.report(self._report)

    def _broken_error(self, why: str) -> httpx.RemoteProtocolError:
        return httpx.RemoteProtocolError(
            f"upstream stream broke; call {self._admitted.call_id} has an unknown "
            f"effect and will not be re-sent: {why}"
        )

    async def aclose(self) -> None:
        """Settle the call: now if it ended, else in the background after the upstream ends."""
        self.abandon()

    def abandon(self) -> None:
        """Read the rest of the upstream in the background, once, unless already settled
        or a reader is waiting for its next chunk right now (it goes on, and settles it)."""
        if self._settled or self._draining or self._pulling:
            return
        self._draining = True
        self._recorder.spawn(self._drain())

    async def _drain(self) -> None:
        try:
            async for _ in self._pull(background=True):
                pass
        except httpx.RemoteProtocolError:
            pass  # already recorded: interrupted, or the observation failed
