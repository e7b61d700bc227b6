"""What a client is shown of a stream effectguard asked for its usage (rules/addedusage):
everything but the usage-only event, however the stream is cut into chunks. The same
through the SDKs and a real proxy is in test_proxy_integration.py and
test_sdk_transport.py."""

from __future__ import annotations

import json
import re

from hypothesis import given
from hypothesis import strategies as st

from effectguard.rules import addedusage
from effectguard.rules.addedusage import AddedUsage, without_added_usage

CONTENT = [
    {"choices": [{"index": 0, "delta": {"content": "Bonjour"}}], "usage": None},
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": None},
]
USAGE = {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}}
#: The usage event in each shape an upstream sends it: every one is left out.
USAGES = [
    USAGE,
    {"choices": None, "usage": {"prompt_tokens": 1}},  # null choices
    {"choices": [], "usage": {}},  # an empty usage
    {"id": "c1", "usage": {"prompt_tokens": 1, "completion_tokens": 2}},  # no choices key
]
#: Data that is not JSON, as the usage event may come misshapen (cut short, or text).
NOT_JSON = [b'{"choices":[],"usage":{"prompt_tokens":1', b"usage: 3 tokens", b"\xff{}"]
#: Events a client did ask for, or that only look alike: each is shown.
ALIKE = [
    {"choices": [], "usage": None},  # no usage: not the usage chunk
    {"choices": [{"index": 0}], "usage": {"prompt_tokens": 1}},  # choices: content
    ["choices", [], "usage"],  # not an object
]


def event(value: object, end: bytes, compact: bool, blank: bytes | None = None) -> bytes:
    """One event: its data line ended by ``end``, then a blank line ended by ``blank``."""
    text = json.dumps(value, separators=(",", ":") if compact else None)
    return b"data: " + text.encode() + end + (end if blank is None else blank)


LINE_ENDS = [b"\n", b"\r\n", b"\r"]
#: A data line's end and its blank line's, in any mix SSE allows: not a lone CR then an
#: LF, which is one CRLF line end, not two.
MIXED_ENDS = [(a, b) for a in LINE_ENDS for b in LINE_ENDS if not (a == b"\r" and b == b"\n")]


def fed_in_pieces(stream: bytes, cuts: list[int]) -> bytes:
    """What an :class:`AddedUsage` shows of ``stream`` fed in pieces of the ``cuts``
    sizes, over and over, then flushed."""
    reader, out, at = AddedUsage(), b"", 0
    for size in cuts * (len(stream) // sum(cuts) + 1):
        if at >= len(stream):
            break
        out += reader.feed(stream[at : at + size])
        at += size
    return out + reader.flush()


@given(
    end=st.sampled_from(LINE_ENDS),
    compact=st.booleans(),
    alike=st.lists(st.sampled_from(ALIKE), max_size=3),
    usage=st.sampled_from(USAGES),
    cuts=st.lists(st.integers(min_value=1, max_value=12), min_size=1, max_size=200),
)
def test_the_client_is_shown_every_event_but_the_usage_one(
    end: bytes, compact: bool, alike: list[object], usage: object, cuts: list[int]
) -> None:
    """Whatever the usage event's shape (``choices`` empty, null or absent; ``usage`` empty
    or not). One without ``choices`` was shown (the SDK's loop then raised on its
    ``chunk.choices``)."""
    shown = [event(v, end, compact) for v in [*CONTENT, *alike]]
    done = b"data: [DONE]" + end + end
    stream = b"".join([*shown, event(usage, end, compact), done])
    out = fed_in_pieces(stream, cuts)
    assert out == b"".join([*shown, done])
    assert without_added_usage(stream) == out


@given(
    ends=st.lists(st.sampled_from(MIXED_ENDS), min_size=4, max_size=4),
    cuts=st.lists(st.integers(min_value=1, max_value=12), min_size=1, max_size=200),
)
def test_line_ends_in_any_mix_end_events_and_the_usage_one_is_left_out(
    ends: list[tuple[bytes, bytes]], cuts: list[int]
) -> None:
    """Events whose lines end in any mix of LF, CRLF and a lone CR (``\\n\\r\\n``: an
    LF-ended line, then a CRLF blank line) are told apart as one line end alone is: the
    usage event is left out. (A mix was read as no event boundary at all: the client was
    shown nothing until the stream's end, then the usage event with the rest.)"""
    values = [*CONTENT, USAGE, "[DONE]"]
    events = [
        b"data: [DONE]" + a + b if v == "[DONE]" else event(v, a, True, b)
        for v, (a, b) in zip(values, ends, strict=True)
    ]
    stream = b"".join(events)
    out = fed_in_pieces(stream, cuts)
    assert out == b"".join(e for e, v in zip(events, values, strict=True) if v is not USAGE)
    assert without_added_usage(stream) == out


def raw(data: bytes, end: bytes) -> bytes:
    """One event of ``data`` as it is (not JSON), its lines ended by ``end``."""
    return b"data: " + data + end + end


@given(
    end=st.sampled_from(LINE_ENDS),
    data=st.sampled_from(NOT_JSON),
    usage=st.sampled_from([None, USAGE]),
    cuts=st.lists(st.integers(min_value=1, max_value=12), min_size=1, max_size=200),
)
def test_an_event_that_is_not_json_just_before_the_end_is_left_out_and_shown_elsewhere(
    end: bytes, data: bytes, usage: object, cuts: list[int]
) -> None:
    """A last event before ``[DONE]`` whose data is not JSON is the usage event misshapen:
    left out, as the SDK raises its JSON error on it at the end of a paid call (it was
    shown). Anywhere else it is the provider's, shown where it came; a usage event after
    it is still left out."""
    content = [event(v, end, True) for v in CONTENT]
    odd = raw(data, end)
    done = b"data: [DONE]" + end + end
    last = [] if usage is None else [event(usage, end, True)]
    stream = b"".join([content[0], odd, *content[1:], odd, *last, done])
    out = fed_in_pieces(stream, cuts)
    # The one before [DONE] is left out; the one followed by content (or usage) is shown.
    assert out == b"".join([content[0], odd, *content[1:], *([odd] if last else []), done])
    assert without_added_usage(stream) == out


def test_an_event_that_is_not_json_waits_for_the_next_one_to_be_shown() -> None:
    """Whether it is the last before ``[DONE]`` is known at the next event only: it waits
    for it, with any event without data (a comment) after it, in order."""
    reader = AddedUsage()
    first, odd, comment = event(CONTENT[0], b"\n", True), raw(b"oops", b"\n"), b": ping\n\n"
    assert reader.feed(first) == first
    assert reader.feed(odd) == b""
    assert reader.feed(comment) == b""
    assert reader.feed(first) == odd + comment + first
    assert reader.feed(odd + comment) == b""
    assert reader.feed(b"data: [DONE]\n\n") == comment + b"data: [DONE]\n\n"
    assert reader.flush() == b""
    cut_short = AddedUsage()  # a stream ended without [DONE]: what waited is shown at its end
    assert cut_short.feed(odd) == b""
    assert cut_short.flush() == odd


def test_an_event_ended_by_mixed_line_ends_is_shown_as_it_arrives() -> None:
    """Each whole event is shown when it arrives, not held to the stream's end."""
    reader = AddedUsage()
    first, usage = event(CONTENT[0], b"\n", True, b"\r\n"), event(USAGE, b"\n", True, b"\r\n")
    assert reader.feed(first) == first
    assert reader.feed(usage) == b""
    assert reader.feed(b"data: [DONE]\n\r\n") == b"data: [DONE]\n\r\n"
    assert reader.flush() == b""


def test_an_event_ended_by_a_lone_cr_is_shown_at_the_next_byte() -> None:
    """A blank line ended by a CR is known by the byte after it (a CR then an LF is one
    line end): the event before it is shown as soon as that byte comes, not held longer."""
    reader = AddedUsage()
    first = event(CONTENT[0], b"\r", True)
    assert reader.feed(first) == b""  # its last CR may yet begin a CRLF
    assert reader.feed(b"d") == first
    assert reader.feed(b"ata: [DONE]\r\r") == b""
    assert reader.flush() == b"data: [DONE]\r\r"


def test_an_endless_event_is_held_not_shown_and_joined_once() -> None:
    """An upstream that never ends its event: nothing is shown (its reader would wait for
    the rest too), and the held bytes come out whole at the end."""
    reader = AddedUsage()
    parts = [b"data: " + b"x" * 1000 for _ in range(2000)]
    assert all(reader.feed(part) == b"" for part in parts)
    assert reader.flush() == b"".join(parts)


#: SSE's event boundary, as the standard reads it: a line end, then a blank line's end.
BOUNDARY = re.compile(rb"((?:\r\n|\r(?!\n)|\n)(?:\r\n|\r(?=[^\n])|\n))")
#: What each event is, to the oracle below: events of each kind, spelt compact or not.
KINDS: dict[str, list[bytes]] = {
    "content": [
        json.dumps(v, separators=sep).encode() for v in CONTENT for sep in [None, (",", ":")]
    ],
    "usage": [json.dumps(v).encode() for v in USAGES],
    "alike": [json.dumps(v).encode() for v in ALIKE],
    "not-json": NOT_JSON,
    "done": [b"[DONE]"],
}


def shown_by_oracle(stream: bytes) -> bytes:
    """What the client is shown of ``stream``, decided on the whole of it at once, split
    by the standard's boundaries: every event but the usage ones, and but one whose data is
    not JSON when the next event with data is ``[DONE]``. (A run of blank lines after an
    event is one boundary, then empty events: shown.)"""
    parts = BOUNDARY.split(stream)
    pairs = list(zip(parts[0::2], [*parts[1::2], b""], strict=True))
    kinds = [kind_of(text) for text, _ in pairs]
    shown = []
    for i, (text, boundary) in enumerate(pairs):
        after = [k for k in kinds[i + 1 :] if k != "no-data"]
        if kinds[i] == "usage" or (kinds[i] == "not-json" and after[:1] == ["done"]):
            continue
        shown += [text, boundary]
    return b"".join(shown)


def kind_of(text: bytes) -> str:
    """What one event is: no data, ``[DONE]``, a choice (shown unread), usage, not JSON."""
    lines = re.split(rb"\r\n|\r|\n", text)
    data = [
        line.removeprefix(b"data:").removeprefix(b" ")
        for line in lines
        if line.startswith(b"data:")
    ]
    if not data:
        return "no-data"
    joined = b"\n".join(data)
    if joined == b"[DONE]":
        return "done"
    if re.search(rb'"choices"\s*:\s*\[\s*\{', text):
        return "content"
    try:
        value = json.loads(joined)
    except ValueError:
        return "not-json"
    usage = isinstance(value, dict) and value.get("choices") in ([], None)
    return "usage" if usage and isinstance(value.get("usage"), dict) else "other"


@st.composite
def odd_streams(draw: st.DrawFn) -> list[tuple[str, bytes]]:
    """Events of every kind in any order, with line ends in any mix and any run of blank
    lines after an event (each ended as that event's blank line is)."""
    names = draw(st.lists(st.sampled_from([*KINDS, "comment"]), min_size=1, max_size=8))
    events = []
    for name in names:
        end, blank = draw(st.sampled_from(MIXED_ENDS))
        lines = b": ping" if name == "comment" else b"data: " + draw(st.sampled_from(KINDS[name]))
        extra = blank * draw(st.integers(min_value=0, max_value=3))
        events.append((name, lines + end + blank + extra))
    return events


@given(events=odd_streams(), cuts=st.lists(st.integers(1, 40), min_size=1, max_size=50))
def test_what_is_shown_of_any_stream_is_what_the_whole_stream_decides(
    events: list[tuple[str, bytes]], cuts: list[int]
) -> None:
    """Fed in any pieces, the filter shows what a reading of the whole stream at once
    decides, by the standard's event boundaries: its quicker scans of LF-ended lines (one
    scan for the last boundary, a split for the events) read them as the standard does."""
    stream = b"".join(text for _, text in events)
    expected = dispatched(shown_by_oracle(stream))
    assert dispatched(fed_in_pieces(stream, cuts)) == expected
    assert dispatched(without_added_usage(stream)) == expected


def dispatched(stream: bytes) -> list[bytes]:
    """The data of each event an SSE reader dispatches from ``stream``. (A run of blank
    lines may be cut into events differently fed in pieces: the same to a reader.)"""
    events, data = [], []
    for line in re.split(rb"\r\n|\r|\n", stream):
        if not line:
            if data:
                events.append(b"\n".join(data))
            data = []
        elif line.startswith(b"data:"):
            data.append(line.removeprefix(b"data:").removeprefix(b" "))
    return events


@given(
    text=st.lists(st.sampled_from([b"a", b"\n", b"\r"]), max_size=30).map(b"".join),
    held=st.integers(0, 3),
)
def test_the_quick_reading_of_lf_ended_lines_finds_the_standards_boundaries(
    text: bytes, held: int
) -> None:
    """The scans in C for the last boundary and the events (taken when no CR is in the
    bytes) find what the standard's boundary expression finds, on any mix and run of line
    ends: the same last boundary in a chunk after ``held`` bytes of tail, the same events."""
    held = min(held, len(text))
    cuts = [
        m.end() - held
        for m in BOUNDARY.finditer(text)
        if m.end() > held or (m.end() == held and text.endswith(b"\r", 0, held))
    ]
    assert addedusage._last_boundary(text, held) == max(cuts, default=-1)
    parts = BOUNDARY.split(text)
    assert list(addedusage._events(text)) == list(
        zip(parts[0::2], [*parts[1::2], b""], strict=True)
    )
