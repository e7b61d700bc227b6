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


def event(value: object, end: bytes, compact: bool) -> bytes:
    text = json.dumps(value, separators=(",", ":") if compact else None)
    return b"data: " + text.encode() + end + end


@given(
    end=st.sampled_from([b"\n", b"\r\n", b"\r"]),
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
    reader, out, at = AddedUsage(), b"", 0
    for size in cuts * (len(stream) // sum(cuts) + 1):
        if at >= len(stream):
            break
        out += reader.feed(stream[at : at + size])
        at += size
    out += reader.flush()
    assert out == b"".join([*shown, done])
    assert without_added_usage(stream) == out


def test_an_endless_event_is_held_not_shown_and_joined_once() -> None:
    """An upstream that never ends its event: nothing is shown (its reader would wait for
    the rest too), and the held bytes come out whole at the end."""
    reader = AddedUsage()
    parts = [b"data: " + b"x" * 1000 for _ in range(2000)]
    assert all(reader.feed(part) == b"" for part in parts)
    assert reader.flush() == b"".join(parts)
