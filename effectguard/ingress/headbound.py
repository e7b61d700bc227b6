"""An upstream answer's head on the proxy's leg: bounded as a whole, as the transports do.

The transports (httpx over h11, through httpcore) bound only an answer's whole head: an
answer whose status line and header fields are not complete within 100 KiB is refused,
however its lines are cut. aiohttp bounds each line instead, at 8,190 bytes by default,
and not the whole: an answer with one header line of 8,191 bytes (a long
``Content-Security-Policy`` or a large cookie) that the transports took was
``effect_unknown`` through the proxy. The leg now lets aiohttp take lines as long as the
whole head may be (:data:`MAX_HEAD_BYTES`), and :class:`HeadBound` bounds the head: past
that many bytes before the head is complete, or a head larger than that, and the answer
is refused as one that is not HTTP (``BadHttpMessage``): the request was sent, so its
effect is unknown (contract.md §3.4). Each interim (1xx) answer's head is bounded alone,
as h11 bounds each event (:mod:`effectguard.ingress.interim` bounds them together).

The bytes are counted only while a head is being read: once the final answer's head is
read, a chunk costs one comparison more. aiohttp names no public hook: the override uses
the protocol's private ``_parser`` (a new one per request), as
:mod:`effectguard.ingress.interim` does; ``tests/test_answer_header_line.py`` pins it.
"""

from __future__ import annotations

from typing import Final

from aiohttp.client_proto import ResponseHandler
from aiohttp.http_exceptions import BadHttpMessage
from aiohttp.http_parser import RawResponseMessage
from aiohttp.streams import StreamReader

from effectguard.ingress.interim import interim_size

#: The largest head (status line and header fields) an upstream answer may have: the
#: transports' bound (httpcore's ``MAX_INCOMPLETE_EVENT_SIZE``).
MAX_HEAD_BYTES: Final = 100 * 1024


class HeadBound(ResponseHandler):
    """aiohttp's response handler, which bounds the head of each answer it reads."""

    #: The parser whose final answer's head was read: its bytes are no longer counted.
    _head_read: object = None
    #: The parser the count below is for (a new one per request), and the one refused.
    _head_counted: object = None
    _head_refused: object = None
    _head_bytes = 0

    def data_received(self, data: bytes) -> None:
        parser = self._parser
        if parser is self._head_read or parser is None:
            super().data_received(data)
            return
        if parser is self._head_refused:
            return  # refused already: the connection is closed next
        if parser is not self._head_counted:
            self._head_counted, self._head_bytes = parser, 0
        self._head_bytes += len(data)
        super().data_received(data)
        if (
            self._head_bytes > MAX_HEAD_BYTES
            and self._parser is parser
            and parser is not self._head_read
            and parser is not self._head_refused
        ):
            self._refuse_head(parser)

    def feed_data(self, data: tuple[RawResponseMessage, StreamReader], size: int = 0) -> None:
        message = data[0]
        parser = self._parser
        if parser is self._head_refused:
            return
        if 100 <= message.code < 200 and message.code != 101:
            self._head_bytes = 0  # the next head is counted alone
        else:
            # Bytes counted past the bound may be the body's, in the read that ended the
            # head: only then is the head measured.
            if self._head_bytes > MAX_HEAD_BYTES and interim_size(message) > MAX_HEAD_BYTES:
                self._refuse_head(parser)
                return
            self._head_read = parser
        super().feed_data(data, size)

    def _refuse_head(self, parser: object) -> None:
        self._head_refused = parser
        # Sets the connection to close; the request raises it.
        self.set_exception(
            BadHttpMessage(
                f"the provider's answer has a head (status line and header fields) of "
                f"more than {MAX_HEAD_BYTES} bytes"
            )
        )
        if self.transport is not None:
            self.transport.pause_reading()
