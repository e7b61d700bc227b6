"""The stream reader passes over events that cannot matter, and that changes nothing.

:class:`StreamUsage` decodes only the events whose bytes could change what it knows
(``streamusage._may_matter``). These properties feed the same streams to it and to a reader
that decodes every event, and require the same answers: usage, its problem, whether and
where the stream finished. The streams mix real chunks of each API with hostile ones:
"usage" keys at any depth, null or not, repeated, spelt with escapes, terminal names inside
content, JSON in UTF-16, bytes that are not JSON, and chunk boundaries anywhere.
"""

from __future__ import annotations

import itertools
import json
import re
import tracemalloc
from typing import Any
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from effectguard.rules import streamusage
from effectguard.rules.streamusage import StreamUsage

#: An SSE line end: CRLF, LF or a lone CR.
LINE_END = re.compile(rb"\r\n|\r|\n")


class DecodesEverything(StreamUsage):
    """The reference: the reader as it was before the filter and the one-pass loop (every
    line through ``_line``, every event decoded), kept here as the oracle. Its lines are
    split by one regular expression; a CR that ends what it was fed ends its line, and an
    LF fed next is the rest of that line end."""

    def __init__(self, dialect: str, path: str) -> None:
        super().__init__(dialect, path)
        self._buffer = b""
        self._cr_ended = False

    def feed(self, chunk: bytes) -> None:
        at = self._fed - len(self._buffer)
        self._fed += len(chunk)
        if self._cr_ended and chunk:
            self._cr_ended = False
            if chunk.startswith(b"\n"):
                chunk, at = chunk[1:], at + 1
        self._buffer += chunk
        start = 0
        for end in LINE_END.finditer(self._buffer):
            line = self._buffer[start : end.start()]
            if self._event_at is None and line.strip():
                self._event_at = at + start
            self._line(line)
            start = end.end()
        self._cr_ended = self._cr_ended or self._buffer.endswith(b"\r")
        self._buffer = self._buffer[start:]

    def _line(self, line: bytes) -> None:
        if not line:
            if self._data:
                was_finished = self._finished
                self._decode(b"\n".join(self._data))
                if self._finished and not was_finished:
                    self._terminal_at = self._event_at
            self._data = []
            self._event_at = None
        elif line.startswith(b"data:"):
            data = line[5:]
            self._data.append(data[1:] if data.startswith(b" ") else data)


APIS = [
    ("openai", "/v1/chat/completions"),
    ("openai", "/v1/embeddings"),
    ("openai", "/v1/responses"),
    ("anthropic", "/v1/messages"),
    ("flat", "/v1/send"),
]

NAMES = [
    "usage",
    "type",
    "message",
    "response",
    "choices",
    "delta",
    "content",
    "prompt_tokens",
    "completion_tokens",
    "input_tokens",
    "output_tokens",
    "cache_read_input_tokens",
]
WORDS = [
    "[DONE]",
    "message_start",
    "message_delta",
    "message_stop",
    "response.completed",
    "response.incomplete",
    "response.failed",
    "response.output_text.delta",
    "content_block_delta",
    '"usage": 5',
    "usage",
    "ok",
]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-3, max_value=2**60),
    st.sampled_from(WORDS),
    st.text(max_size=6),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(NAMES), inner, max_size=4),
    ),
    max_leaves=12,
)
documents = st.dictionaries(st.sampled_from(NAMES), values, max_size=5)


@st.composite
def payloads(draw: st.DrawFn) -> bytes:
    """One event's data: JSON in any spelling, a known chunk, or bytes that are not JSON."""
    kind = draw(st.sampled_from(["json", "json", "json", "known", "raw"]))
    # No CR or LF inside: either would end the data line (an SSE line ends at any of them).
    if kind == "raw":
        return draw(st.binary(max_size=24)).replace(b"\n", b" ").replace(b"\r", b" ")
    if kind == "known":
        return draw(st.sampled_from(KNOWN))
    doc: Any = draw(documents)
    text = json.dumps(
        doc,
        ensure_ascii=draw(st.booleans()),
        separators=draw(st.sampled_from([(",", ":"), (", ", ": "), (" ,\t", " :\t ")])),
    )
    if draw(st.integers(0, 9)) == 0:
        # Any key or word spelt with a \\u escape: the same JSON, other bytes.
        text = text.replace("u", "\\u0075", 1) if '"' in text else text
    encoding = draw(st.sampled_from(["utf-8"] * 8 + ["utf-16", "utf-32"]))
    return text.encode(encoding).replace(b"\n", b" ").replace(b"\r", b" ")


KNOWN = [
    b"[DONE]",
    b'{"choices":[{"delta":{"content":"hi"}}],"usage":null}',
    b'{"choices":[],"usage":{"prompt_tokens":19,"completion_tokens":10}}',
    b'{"usage":null,"usage":{"prompt_tokens":1,"completion_tokens":2}}',
    b'{"usage" :\tnull, "x": {"usage": {"prompt_tokens": 3}}}',
    b'{"type":"message_start","message":{"usage":{"input_tokens":5,"output_tokens":1}}}',
    b'{"type":"content_block_delta","delta":{"text":"message_stop"}}',
    b'{"type":"message_delta","usage":{"output_tokens":7}}',
    b'{"type":"message_stop"}',
    b'{"type":"response.output_text.delta","delta":"x"}',
    b'{"type":"response.completed","response":{"usage":{"input_tokens":4,"output_tokens":2}}}',
    b'{"type":"[DONE]"}',
    # Found by no other byte than their backslash-u: a key and a type spelt with escapes.
    b'{"\\u0075sage":{"prompt_tokens":4,"completion_tokens":1}}',
    b'{"type":"message_\\u0073tart","message":{"usage":{"input_tokens":5,"output_tokens":1}}}',
    b'{"type":"response.complet\\u0065d","response":{"usage":{"input_tokens":4}}}',
    b'{"type":"message_delt\\u0061","usage":{"output_tokens":7}}',
]


#: The line ends of the SSE standard.
ENDINGS = [b"\n", b"\r\n", b"\r"]


@st.composite
def event_lines(draw: st.DrawFn) -> list[bytes]:
    """An event stream's lines, without their ends: events of one or more data lines (with
    or without the space), "event:"/"id:" lines, comments and blank-looking lines."""
    lines: list[bytes] = []
    for data in draw(st.lists(payloads(), max_size=8)):
        extra = draw(st.sampled_from([b"", b"event: message", b": keep-alive", b"id: 7", b" "]))
        if extra:
            lines.append(extra)
        lines.append(draw(st.sampled_from([b"data: ", b"data:"])) + data)
        if draw(st.integers(0, 5)) == 0:
            lines.append(b"data: " + draw(payloads()))  # a second data line in the event
        lines.append(b"")  # the blank line that ends the event
    if draw(st.booleans()):
        lines.append(b"data: " + draw(payloads()))  # an unterminated last event
    return lines


def cut(body: bytes, cuts: list[int]) -> list[bytes]:
    """``body`` in chunks, split at each of ``cuts``."""
    edges = [0, *sorted(cuts), len(body)]
    return [body[a:b] for a, b in itertools.pairwise(edges)]


@st.composite
def streams(draw: st.DrawFn) -> list[bytes]:
    """An event stream as chunks split anywhere, each line ending in LF, CRLF or CR."""
    body = b"".join(line + draw(st.sampled_from(ENDINGS)) for line in draw(event_lines()))
    return cut(body, draw(st.lists(st.integers(0, len(body)), max_size=5)))


def answers(parser: StreamUsage) -> tuple[object, ...]:
    return (parser.result(), parser.finished, parser.complete, parser.terminal_at, parser.fed)


@settings(max_examples=600, deadline=None)
@given(api=st.sampled_from(APIS), chunks=streams())
def test_skipping_events_gives_the_answers_decoding_every_event_gives(
    api: tuple[str, str], chunks: list[bytes]
) -> None:
    """Whatever the stream, the filtered reader and the decode-everything reader agree."""
    fast, reference = StreamUsage(*api), DecodesEverything(*api)
    for chunk in chunks:
        fast.feed(chunk)
        reference.feed(chunk)
        assert answers(fast) == answers(reference)


@st.composite
def endings_and_cuts(draw: st.DrawFn) -> tuple[list[bytes], list[bytes], list[int]]:
    """An event stream's lines, an SSE line end for each (a mix, or one kind throughout),
    and where to cut the stream so ended into chunks: often inside a CRLF."""
    lines = draw(event_lines())
    if draw(st.booleans()):
        ends = [draw(st.sampled_from(ENDINGS))] * len(lines)
    else:
        ends = [draw(st.sampled_from(ENDINGS)) for _ in lines]
    for n in range(len(lines) - 1):
        # A CR, then an empty line ended in LF, is one CRLF: one line end, not two.
        if ends[n] == b"\r" and not lines[n + 1] and ends[n + 1] == b"\n":
            ends[n + 1] = b"\r"
    size = sum(map(len, lines)) + sum(map(len, ends))
    crlfs = list(itertools.accumulate(len(x) + len(e) for x, e in zip(lines, ends, strict=True)))
    inside = [at - 1 for at, e in zip(crlfs, ends, strict=True) if e == b"\r\n"]
    cuts = draw(st.lists(st.integers(0, size), max_size=5))
    if inside:
        cuts += draw(st.lists(st.sampled_from(inside), max_size=3))
    return lines, ends, cuts


@settings(max_examples=600, deadline=None)
@given(api=st.sampled_from(APIS), case=endings_and_cuts())
def test_any_sse_line_end_and_any_cut_read_as_the_same_lines_ended_in_lf(
    api: tuple[str, str], case: tuple[list[bytes], list[bytes], list[int]]
) -> None:
    """Lines ended in LF, CRLF or a lone CR, in any mix, fed in chunks cut anywhere (a CRLF
    in two included), give the usage, the end and the terminal event that the same lines
    ended in LF, fed whole, give: a CR-ended stream was once read as never finishing."""
    lines, ends, cuts = case
    body = b"".join(line + end for line, end in zip(lines, ends, strict=True))
    parser = StreamUsage(*api)
    for chunk in cut(body, cuts):
        parser.feed(chunk)
    reference = DecodesEverything(*api)
    reference.feed(b"".join(line + b"\n" for line in lines))
    # Where each line begins, in the LF stream and in this one: the terminal event's offset.
    lf_starts = itertools.accumulate((len(line) + 1 for line in lines), initial=0)
    starts = itertools.accumulate(
        (len(line) + len(end) for line, end in zip(lines, ends, strict=True)), initial=0
    )
    offset = dict(zip(lf_starts, starts, strict=True))
    assert (parser.result(), parser.finished, parser.complete, parser.fed) == (
        reference.result(),
        reference.finished,
        reference.complete,
        len(body),
    )
    expected = reference.terminal_at
    assert parser.terminal_at == (None if expected is None else offset[expected])
    # The terminal event ends at its blank line: the first empty line after its first line.
    if expected is None:
        assert parser.terminal_end is None
    else:
        first = list(itertools.accumulate((len(line) + 1 for line in lines), initial=0))
        n = first.index(expected)
        blank = next(k for k in range(n + 1, len(lines)) if not lines[k])
        end = offset[first[blank + 1]]
        if ends[blank] == b"\r\n" and end - 1 in cuts:
            end -= 1  # a CR that ends what was fed ends its line: the LF is read later
        assert parser.terminal_end == end


def test_a_stream_of_lone_cr_line_ends_finishes_and_its_usage_is_read() -> None:
    """A chat stream whose lines end in a lone CR (as the SSE standard allows) finishes at
    its [DONE] and its usage is read, fed whole or one byte at a time."""
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":19,"completion_tokens":10}}\r\r'
    stream = b'data: {"choices":[{"delta":{"content":"x"}}]}\r\r' + usage + b"data: [DONE]\r\r"
    whole, bytewise = (
        StreamUsage("openai", "/v1/chat/completions"),
        StreamUsage("openai", "/v1/chat/completions"),
    )
    whole.feed(stream)
    for n in range(len(stream)):
        bytewise.feed(stream[n : n + 1])
    for parser in (whole, bytewise):
        assert parser.finished
        assert parser.terminal_at == len(stream) - len(b"data: [DONE]\r\r")
        assert parser.result().usage is not None and parser.result().usage.output_tokens == 10


def test_a_long_chat_stream_decodes_only_its_usage_and_done_events() -> None:
    """The filter is real: content deltas with "usage": null are passed over undecoded."""
    decoded: list[bytes] = []

    class Counting(StreamUsage):
        def _decode(self, data: bytes) -> None:
            decoded.append(data)
            super()._decode(data)

    parser = Counting("openai", "/v1/chat/completions")
    delta = b'data: {"choices":[{"delta":{"content":"x"}}],"usage":null}\n\n'
    last = b'data: {"choices":[],"usage":{"prompt_tokens":19,"completion_tokens":10}}\n\n'
    parser.feed(delta * 300 + last + b"data: [DONE]\n\n")
    assert len(decoded) == 2
    assert (parser.finished, parser.result().usage) == (True, parser.result().usage)
    assert parser.result().usage is not None and parser.result().usage.output_tokens == 10


CAP = 48  # a small cap, so that generated events go over it


@st.composite
def events_over_a_cap(draw: st.DrawFn) -> tuple[list[bytes], list[bytes]]:
    """A stream with events over :data:`CAP` bytes, as chunks split anywhere, and the same
    stream with each such event's lines made comments of the same length (what the reader
    must make of it: dropped unread, every offset kept)."""
    sent: list[bytes] = []
    seen: list[bytes] = []
    for data in draw(st.lists(payloads(), max_size=6)):
        event = [draw(st.sampled_from([b"data: ", b"data:"])) + data]
        if draw(st.booleans()):
            event.append(b"data: " + b"x" * draw(st.integers(0, 2 * CAP)))  # maybe over
        if draw(st.booleans()):
            event.insert(0, b"event: message")
        ends = [draw(st.sampled_from([b"\n", b"\r\n"])) for _ in event]
        lines = [line + end.removesuffix(b"\n") for line, end in zip(event, ends, strict=True)]
        over = sum(len(line) for line in lines) > CAP
        for line in lines:
            sent.append(line + b"\n")
            seen.append((b":" + b"x" * (len(line) - 1) if over else line) + b"\n")
        blank = draw(st.sampled_from([b"\n", b"\r\n"]))
        sent.append(blank)
        seen.append(blank)
    body = b"".join(sent)
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=6)))
    edges = [0, *cuts, len(body)]
    return [body[a:b] for a, b in itertools.pairwise(edges)], seen


@settings(max_examples=400, deadline=None)
@given(api=st.sampled_from(APIS), case=events_over_a_cap())
def test_an_event_over_the_cap_is_dropped_unread_wherever_the_chunks_split(
    api: tuple[str, str], case: tuple[list[bytes], list[bytes]]
) -> None:
    """An event over MAX_EVENT_BYTES is never read, however the stream is cut into chunks
    (held line by line or arriving whole), and every later offset stays exact."""
    chunks, seen = case
    reference = DecodesEverything(*api)
    reference.feed(b"".join(seen))
    with mock.patch.object(streamusage, "MAX_EVENT_BYTES", CAP):
        capped = StreamUsage(*api)
        for chunk in chunks:
            capped.feed(chunk)
    assert answers(capped) == answers(reference)


def test_an_endless_line_is_held_in_bounded_memory_and_dropped() -> None:
    """64 MiB of one line (a misbehaving upstream) in 64 KiB chunks: the reader holds at most
    about its cap, drops the line's event, and still reads the events after it."""
    parser = StreamUsage("openai", "/v1/chat/completions")
    chunk = b"x" * (64 << 10)
    tracemalloc.start()
    try:
        parser.feed(b'data: {"usage": {"prompt_tokens": 1, "completion_tokens": 1}, "x": "')
        for _ in range((64 << 20) // len(chunk)):
            parser.feed(chunk)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < streamusage.MAX_EVENT_BYTES + (4 << 20), peak
    assert parser.result().usage is None  # that event carried usage: it was not read
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4}}\n\n'
    parser.feed(b'"}\n\n' + usage + b"data: [DONE]\n\n")
    assert parser.result().usage is not None and parser.result().usage.output_tokens == 4
    assert parser.finished
    assert parser.terminal_at == parser.fed - len(b"data: [DONE]\n\n")
