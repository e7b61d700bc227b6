"""What a client is shown of a stream effectguard asked for its usage (rules/addedusage):
everything but the usage-only event, however the stream is cut into chunks. The same
through the SDKs and a real proxy is in test_proxy_integration.py and
test_sdk_transport.py."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from effectguard.rules.addedusage import AddedUsage, without_added_usage

CONTENT = [
    {"choices": [{"index": 0, "delta": {"content": "Bonjour"}}], "usage": None},
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": None},
]
USAGE = {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}}
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
    cuts=st.lists(st.integers(min_value=1, max_value=12), min_size=1, max_size=200),
)
def test_the_client_is_shown_every_event_but_the_usage_one(
    end: bytes, compact: bool, alike: list[object], cuts: list[int]
) -> None:
    shown = [event(v, end, compact) for v in [*CONTENT, *alike]]
    done = b"data: [DONE]" + end + end
    stream = b"".join([*shown, event(USAGE, end, compact), done])
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
