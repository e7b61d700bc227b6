"""An answer whose framing breaks part-way through its body: the body being read fails too.

When aiohttp's parser fails on bytes of an answer's body (a chunk size that is not hex,
say) after the answer's head was read, its C parser (the one installed by default)
puts the failure on the connection's protocol and closes the connection, but not on the
body the caller is reading, and it stops the read timeout: the caller's read of the
body waits for ever. (Its pure-Python parser fails the body; 3.14.5, installed here.)
For the proxy that was a call ``in_flight`` for as long as the process ran, its client
waiting and its key answering 409, and an upstream connection held, so an upstream
that did it again and again took its provider's connections one by one.

:class:`BrokenBody` hands such a failure to the body as well, as aiohttp does for a body
cut short by a close (``ClientPayloadError``, its cause the parser's own error): the read
fails, and the guard books the attempt as an answer that was not HTTP (``effect_unknown``,
contract.md §3.4). Only failures of the parser are handed on; a read timeout or a lost
connection already reaches the body by aiohttp's own path, and handing it again would
change what the read raises.

aiohttp names no public hook for this: the override uses the protocol's private
``_payload`` (the body being read). ``tests/test_odd_answers.py`` pins the behaviour,
so an aiohttp that renames it fails a test rather than silently hanging again.
"""

from __future__ import annotations

from typing import Any

from aiohttp import ClientPayloadError
from aiohttp.client_proto import ResponseHandler
from aiohttp.http_exceptions import HttpProcessingError


class BrokenBody(ResponseHandler):
    """aiohttp's response handler, which fails the body being read when the parser fails."""

    def set_exception(self, exc: BaseException, *cause: Any) -> None:
        # Called only on a failure: no cost to an answer that parses.
        super().set_exception(exc, *cause)
        body = self._payload
        if not isinstance(exc, HttpProcessingError) or body is None:
            return
        if body.is_eof() or body.exception() is not None:
            return  # ended, or already failed by aiohttp itself
        parser_error = cause[0] if cause and isinstance(cause[0], BaseException) else exc
        failed = ClientPayloadError(f"Response payload is not completed: {parser_error!r}")
        failed.__cause__ = parser_error  # what names the failure (callpath.readonly.describe)
        body.set_exception(failed, parser_error)
