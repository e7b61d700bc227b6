"""Usage from a server-sent-event stream: an incremental parser fed raw chunks.

Pure, no I/O. A stream's events are read for the few that carry usage or end the stream;
the rest (every content delta, hundreds in a long answer) are passed over without being
decoded when their bytes show they cannot matter (:func:`_may_matter`). The usage read is
judged and priced as a body's is (:mod:`effectguard.rules.usage`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

# The shared readers of usage objects; one module's helpers, split out only for size.
from effectguard.rules.usage import (
    Usage,
    UsageResult,
    _anthropic_usage,
    _api,
    _int,
    _judged,
    _openai_usage,
    _table,
    _Unreadable,
    check_usage,
)

__all__ = ["StreamUsage"]

_TERMINAL = {
    "chat": frozenset({"[DONE]"}),
    "embeddings": frozenset({"[DONE]"}),
    # A Responses stream ends with exactly one of these; each carries the final usage.
    "responses": frozenset({"response.completed", "response.incomplete", "response.failed"}),
    "messages": frozenset({"message_stop"}),
    "flat": frozenset(),
}

#: Per API, what an event's bytes must contain for decoding it to change what the parser
#: knows: a "type" naming a terminal or usage-bearing event, or "[DONE]" (a chat stream's
#: end; in another stream it also ends a finished state), and for chat and embeddings a
#: "usage" key whose value is not null. A key is a quoted string followed by a colon, and a
#: quote inside a JSON string is escaped, so the pattern finds every key named usage (at any
#: depth: a nested one only makes the event decoded, which is always exact; the possessive
#: ``\\s*+`` keeps ``: null`` from matching by giving back its space). A JSON string can
#: spell any of these with ``\\u`` escapes, and JSON may come in UTF-16 or UTF-32 (which
#: ``json.loads`` reads from bytes): an event holding a backslash-u or a NUL byte is always
#: decoded.
_MATTERS: dict[str, tuple[bytes, re.Pattern[bytes]]] = {
    api: (literal, re.compile(pattern))
    for api, literal, pattern in [
        ("chat", b'"usage"', rb'"usage"\s*+:\s*+(?!null)'),
        ("embeddings", b'"usage"', rb'"usage"\s*+:\s*+(?!null)'),
        ("responses", b"response.", rb"response\.(?:completed|incomplete|failed)"),
        ("messages", b"message_", rb"message_(?:start|delta|stop)"),
    ]
}


def _may_matter(api: str, data: bytes) -> bool:
    """Whether decoding the event ``data`` could change a parser of ``api``.

    False only when decoding provably changes nothing (see :data:`_MATTERS`; a flat
    provider's stream carries no usage the parser keeps). Skipping such an event is exactly
    what decoding it would do: ``tests/test_stream_usage.py`` checks that against a parser
    that decodes every event. Every event of a stream is searched, a large one (a long
    delta) for its whole length, so each literal is found by ``bytes.find`` (a backslash,
    in most events none, before a backslash-u) and the pattern searched only from its
    literal on: one regular expression of all the alternatives tried each of them at every
    byte, and cost several times more (``python -m effectguard_bench.streamread``).
    """
    matters = _MATTERS.get(api)
    if matters is None:
        return False
    if (
        (data.find(b"\\") >= 0 and data.find(b"\\u") >= 0)
        or data.find(b"\x00") >= 0
        or data.find(b"[DONE]") >= 0
    ):
        return True
    literal, pattern = matters
    at = data.find(literal)
    return at >= 0 and pattern.search(data, at) is not None


#: The largest event the reader reads (its lines together, as sent). A larger one is
#: dropped unread, as if it had not been sent: if it was the terminal event, the stream
#: counts as broken (its effect unknown), and if it carried the usage, the call is charged
#: at its reservation. The largest real event, a Responses API ``response.completed``
#: holding the whole answer, is far smaller; the cap bounds what one stream can make the
#: proxy hold in memory.
MAX_EVENT_BYTES = 16 << 20

#: A carriage return that ends a line by itself: the SSE standard ends lines with CRLF, LF
#: or a lone CR. Made an LF, one byte for one, so every stream offset stays exact.
_LONE_CR = re.compile(rb"\r(?!\n)")


class StreamUsage:
    """Reads usage from a server-sent-event stream, fed raw chunks in arrival order.

    Chunks may split lines, events and UTF-8 characters anywhere; lines end in ``\\n``,
    ``\\r\\n`` or a lone ``\\r``, as the SSE standard allows. A ``\\r`` that ends a chunk
    ends its line at once (a terminal event whose last byte it is must be seen now, not at a
    next chunk that may never come); a ``\\n`` that then begins the next chunk is the rest
    of that line end, and is passed over. An event is handled at the blank line that ends
    it (an unterminated last event is dropped, as the SSE standard says), so a stream cut
    short never looks finished.
    """

    def __init__(self, dialect: str, path: str) -> None:
        self._api = _api(dialect, path)
        self._held: list[bytes] = []  # the chunks of the line not yet ended, in order
        self._held_bytes = 0
        self._line_at = 0  # the stream offset of that line's first byte
        self._skipping = False  # that line is over the cap: its bytes are dropped
        self._after_cr = False  # the last chunk ended in "\r": a "\n" next ends no line
        self._data: list[bytes] = []
        self._event_bytes = 0
        self._spoiled = False  # the current event went over the cap: it is not read
        self._finished = False
        self._usage: Usage | None = None
        self._problem: str | None = "missing"
        self._start: Mapping[str, Any] | None = None  # anthropic message_start usage
        self._delta: Mapping[str, Any] | None = None  # anthropic last message_delta usage
        self._fed = 0  # bytes fed so far
        self._event_at: int | None = None  # stream offset where the current event began
        self._terminal_at: int | None = None
        self._terminal_end: int | None = None

    @property
    def finished(self) -> bool:
        """Whether the stream's terminal marker was seen (it ended cleanly)."""
        return self._finished

    @property
    def complete(self) -> bool:
        """Whether the stream may end here: its terminal event was seen, or its API has none.

        An end of stream before the terminal event is a broken stream, however cleanly the
        connection closed (contract.md §12): a close-delimited response cut short looks complete
        to HTTP.
        """
        return self._finished or not _TERMINAL[self._api]

    @property
    def fed(self) -> int:
        """How many bytes of the stream have been fed."""
        return self._fed

    @property
    def terminal_at(self) -> int | None:
        """The stream offset where the terminal event begins (once :attr:`finished`)."""
        return self._terminal_at

    @property
    def terminal_end(self) -> int | None:
        """The stream offset just past the blank line that ends the terminal event (once
        :attr:`finished`): whatever follows it is behind the end of the stream. A CRLF
        cut in two after its CR ends there, as its line does (the LF comes in a later
        chunk)."""
        return self._terminal_end

    def feed(self, chunk: bytes) -> None:
        """Consume the next raw chunk of the stream."""
        chunk_at = self._fed
        self._fed += len(chunk)
        if self._after_cr and chunk:
            self._after_cr = False
            if chunk[0] == 0x0A:  # the "\n" of a "\r\n" cut in two: its line has ended
                chunk, chunk_at = chunk[1:], chunk_at + 1
                self._line_at += 1
                if not chunk:
                    return
        if b"\r" in chunk:  # LF-only streams, nearly all, pay for this one scan
            self._after_cr = chunk.endswith(b"\r")
            chunk = _LONE_CR.sub(b"\n", chunk)
        cut = chunk.find(b"\n")
        if cut < 0:
            # Held, not joined: joining each chunk to a long line is quadratic, and one
            # endless line from an upstream would stall the event loop for every client.
            self._hold(chunk)
            return
        if self._skipping:  # the over-long line ends here: drop its tail
            self._skipping = False
            text, at = chunk[cut + 1 :], chunk_at + cut + 1
        elif self._held:
            text, at = b"".join((*self._held, chunk)), self._line_at
            self._held, self._held_bytes = [], 0
        else:
            text, at = chunk, self._line_at
        *lines, rest = text.split(b"\n")
        # One pass with the per-line work inline and the event's state in locals: a long
        # answer is hundreds of events of two lines each, and a method call or attribute
        # write per line was most of the reader's cost.
        data, size, spoiled = self._data, self._event_bytes, self._spoiled
        for raw in lines:
            line = raw[:-1] if raw.endswith(b"\r") else raw
            if not line:
                if data and not spoiled:
                    self._dispatch(b"\n".join(data), at + len(raw) + 1)
                data, size, spoiled = [], 0, False
                self._event_at = None
            elif not spoiled:
                if self._event_at is None and not raw.isspace():
                    self._event_at = at
                size += len(raw)
                if size > MAX_EVENT_BYTES:
                    data, size, spoiled = [], 0, True  # over the cap: never decoded
                elif line.startswith(b"data:"):
                    data.append(line[6:] if line.startswith(b"data: ") else line[5:])
                # "event:", "id:", "retry:" and ":" comments carry nothing we need.
            at += len(raw) + 1
        self._data, self._event_bytes, self._spoiled = data, size, spoiled
        self._line_at = self._fed - len(rest)
        if rest:
            self._hold(rest)

    def _hold(self, part: bytes) -> None:
        """Keep ``part`` of a line not yet ended, unless the line (with its event) is over
        :data:`MAX_EVENT_BYTES`: then it is dropped, and the event with it."""
        if self._skipping:
            return
        self._held.append(part)
        self._held_bytes += len(part)
        if self._held_bytes + self._event_bytes > MAX_EVENT_BYTES:
            self._held, self._held_bytes = [], 0
            self._skipping = True
            self._spoil()

    def _spoil(self) -> None:
        """Drop the current event: it is over the cap, so it is never decoded."""
        self._data, self._event_bytes, self._spoiled = [], 0, True

    def result(self) -> UsageResult:
        """The usage reported so far (final once :attr:`finished`); ``missing`` if none."""
        if self._api == "flat":
            return UsageResult(Usage(0, 0), None)
        if self._api == "messages":
            return self._anthropic_result()
        return UsageResult(self._usage, self._problem)

    def _dispatch(self, data: bytes, end: int) -> None:
        """Handle the event ``data``, whose blank line ends at stream offset ``end``."""
        if not _may_matter(self._api, data):
            return  # nearly every event: decoding it would change nothing
        was_finished = self._finished
        self._decode(data)
        if self._finished and not was_finished:
            self._terminal_at, self._terminal_end = self._event_at, end

    def _decode(self, data: bytes) -> None:
        if self._finished:
            # Past the terminal event nothing counts: the observation is written there, so
            # a usage event behind it would count only when the network delivered it in the
            # same read, and the same bytes would be charged two ways.
            return
        if data == b"[DONE]":
            self._finished = "[DONE]" in _TERMINAL[self._api]
            return
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError):  # an event nested too deep
            return
        if not isinstance(doc, dict):
            return
        kind = doc.get("type")
        if not isinstance(kind, str):
            kind = None  # a hostile "type" (a list, an object) names no event: not a crash
        if kind in _TERMINAL[self._api]:
            self._finished = True
        if self._api == "messages":
            if kind == "message_start":
                self._start = _table(_table(doc, "message"), "usage")
            elif kind == "message_delta" and isinstance(doc.get("usage"), dict):
                self._delta = doc["usage"]
        elif self._api == "responses":
            if kind in _TERMINAL["responses"]:
                response = _table(doc, "response")
                self._read(response.get("usage"), response.get("output"))
        elif doc.get("usage") is not None:
            # Chat sends usage in one last chunk when stream_options.include_usage is set;
            # servers that send it in every chunk report running totals, so the last wins.
            self._read(doc["usage"])

    def _read(self, u: object, output: object = None) -> None:
        if not isinstance(u, dict):
            self._usage, self._problem = None, "missing"
            return
        try:
            self._usage = _openai_usage(u, self._api, output)
        except _Unreadable as exc:
            self._usage, self._problem = None, exc.problem
            return
        self._problem = check_usage(self._usage)

    def _anthropic_result(self) -> UsageResult:
        if self._start is None or self._delta is None:
            return UsageResult(None, "missing")
        # message_delta's counts are cumulative; newer API versions repeat the input counts
        # there too, and where they do they are the later word.
        merged = {**self._start, **{k: v for k, v in self._delta.items() if v is not None}}
        try:
            usage = _anthropic_usage(merged, _int(self._delta, "output_tokens"))
        except _Unreadable as exc:
            return UsageResult(None, exc.problem)
        return _judged(usage)
