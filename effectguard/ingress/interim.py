"""Interim (1xx) answers on the proxy's upstream leg: bounded in number, size and time.

Before its final answer a server may send any number of interim answers (RFC 9110 §15.2:
``100 Continue``, ``103 Early Hints``), and aiohttp reads them all, in one loop that does
not yield while they keep coming (``ClientResponse.start``; 3.14.5, installed here, has no
hook for them and no bound). One upstream that floods them held the event loop from
every other caller, and one that sent a ``100 Continue`` now and then kept its call in
flight for ever: each one restarted the read timeout, and none counted toward
``max_answer_bytes``.

So an attempt may be sent at most :data:`MAX_INTERIM_ANSWERS` interim answers, of at most
:data:`MAX_INTERIM_BYTES` together. Past either bound the answer is refused as one that
is not HTTP (``BadHttpMessage``, which the leg reports as an answer it could not read):
the request was sent, so the call's effect is unknown (contract.md §3.4). Interim answers
are not progress either: the final answer must come within the read timeout of the first
interim answer, or the attempt times out as any read does.

aiohttp names no public hook for this: :class:`InterimBound` overrides the response
handler's ``feed_data``, through which every parsed answer reaches the request, and uses
its private ``_parser`` (a new one per request) and ``_loop``.
``tests/test_odd_answers.py`` pins the behaviour, so an aiohttp that renames them fails a
test rather than silently losing the bound.
"""

from __future__ import annotations

import asyncio
from typing import Final

from aiohttp import SocketTimeoutError
from aiohttp.client_proto import ResponseHandler
from aiohttp.http_exceptions import BadHttpMessage
from aiohttp.http_parser import RawResponseMessage
from aiohttp.streams import StreamReader

#: The most interim answers one attempt may be sent. Real servers send one or two (a
#: ``100 Continue``, a ``103 Early Hints`` or so); no provider's API needs more.
MAX_INTERIM_ANSWERS: Final = 16
#: The most bytes of interim answers one attempt may be sent (their status lines and
#: header fields together, as sent).
MAX_INTERIM_BYTES: Final = 64 << 10


def interim_size(message: RawResponseMessage) -> int:
    """About the bytes ``message`` took on the wire: its status line and header fields."""
    fields = sum(len(name) + len(value) + 4 for name, value in message.raw_headers)
    return len("HTTP/1.1 100 \r\n\r\n") + len(message.reason) + fields


class InterimBound(ResponseHandler):
    """aiohttp's response handler, which bounds each attempt's interim answers."""

    #: The parser whose answer the counts below are for. Every request gets a new parser
    #: (``set_response_params``), so the counts start again with each attempt.
    _interim_parser: object = None
    _interim_answers = 0
    _interim_bytes = 0
    #: The read timeout from the first interim answer to the final one. aiohttp's own
    #: restarts with every byte and stops at the end of each interim answer, so alone it
    #: would never end a drip of them.
    _interim_timer: asyncio.TimerHandle | None = None

    def feed_data(self, data: tuple[RawResponseMessage, StreamReader], size: int = 0) -> None:
        message = data[0]
        if 100 <= message.code < 200 and message.code != 101:
            if not self._admit_interim(message):
                return
        elif self._interim_parser is self._parser:  # only an answer that had interim ones
            self._stop_timer()
            if self._interim_answers > MAX_INTERIM_ANSWERS:
                return  # refused already: it was not read, nor is its answer
        super().feed_data(data, size)

    def _admit_interim(self, message: RawResponseMessage) -> bool:
        """Count ``message``; whether it is within the bounds (else the answer is refused)."""
        if self._interim_parser is not self._parser:
            self._interim_parser = self._parser
            self._interim_answers = self._interim_bytes = 0
            self._stop_timer()
            if self.read_timeout:
                self._interim_timer = self._loop.call_later(self.read_timeout, self._time_out)
        elif self._interim_answers > MAX_INTERIM_ANSWERS:
            return False  # refused already (the rest of the same read)
        self._interim_answers += 1
        self._interim_bytes += interim_size(message)
        if self._interim_answers > MAX_INTERIM_ANSWERS or self._interim_bytes > MAX_INTERIM_BYTES:
            self._interim_answers = MAX_INTERIM_ANSWERS + 1  # marks it refused
            self._refuse()
            return False
        return True

    def _refuse(self) -> None:
        self._stop_timer()
        why = (
            f"the provider sent more than {MAX_INTERIM_ANSWERS} interim (1xx) answers, or "
            f"more than {MAX_INTERIM_BYTES} bytes of them, before its final answer"
        )
        # Sets the connection to close; the request raises it once it has taken the
        # interim answers queued before it.
        self.set_exception(BadHttpMessage(why))
        if self.transport is not None:
            self.transport.pause_reading()  # read no more of the flood: it is closed next

    def _time_out(self) -> None:
        self._interim_timer = None
        if self._parser is not None and self._interim_parser is self._parser:
            # As aiohttp's own read timeout: a timeout after the request went out.
            self.set_exception(
                SocketTimeoutError("Timeout on reading data from socket: no final answer")
            )

    def connection_lost(self, exc: BaseException | None) -> None:
        self._stop_timer()  # its request has its error: the timer would only hold on to it
        super().connection_lost(exc)

    def _stop_timer(self) -> None:
        if self._interim_timer is not None:
            self._interim_timer.cancel()
            self._interim_timer = None
