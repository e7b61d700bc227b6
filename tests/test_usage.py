"""Usage extraction from bodies and streams, the belief rules, cost and the reservation."""

from __future__ import annotations

import itertools
import json
from decimal import ROUND_CEILING, Decimal
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from effectguard.providers import ModelPrice
from effectguard.rules.money import usd_to_nanos
from effectguard.rules.streamusage import StreamUsage
from effectguard.rules.usage import (
    OutOfBounds,
    Usage,
    UsageResult,
    check_usage,
    cost,
    estimate,
    estimate_tokens,
    reservation,
    usage_from_body,
    wants_stream,
    with_stream_usage,
)

# --- realistic response bodies -------------------------------------------------------------

CHAT_BODY = json.dumps(
    {
        "id": "chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG",
        "object": "chat.completion",
        "created": 1741570283,
        "model": "gpt-4o-2024-08-06",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Héllo — wörld", "refusal": None},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": 1117,
            "completion_tokens": 46,
            "total_tokens": 1163,
            "prompt_tokens_details": {"cached_tokens": 1024, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0},
        },
        "service_tier": "default",
        "system_fingerprint": "fp_fc9f1d7035",
    }
).encode()

EMBEDDINGS_BODY = json.dumps(
    {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": [0.0023064255, -0.009327292]}],
        "model": "text-embedding-3-small",
        "usage": {"prompt_tokens": 8, "total_tokens": 8},
    }
).encode()

RESPONSES_BODY = json.dumps(
    {
        "id": "resp_67ccd2bed1ec8190b14f964abc054267",
        "object": "response",
        "created_at": 1741476542,
        "status": "completed",
        "model": "gpt-4.1-2025-04-14",
        "output": [
            {
                "type": "message",
                "id": "msg_67ccd2bf17f0819081ff3bb2cf6508e6",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "In a peaceful grove…"}],
            }
        ],
        "usage": {
            "input_tokens": 36,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 87,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 123,
        },
    }
).encode()

MESSAGES_BODY = json.dumps(
    {
        "id": "msg_013Zva2CMHLNnXjNJJKqJ2EF",
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-4-5-20250929",
        "content": [{"type": "text", "text": "Hi! My name is Claude."}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 12,
            "cache_creation_input_tokens": 2048,
            "cache_read_input_tokens": 4096,
            "output_tokens": 9,
            "service_tier": "standard",
        },
    }
).encode()


def test_openai_chat_body() -> None:
    """Chat completions: prompt_tokens (incl. cached) and completion_tokens are read."""
    assert usage_from_body("openai", "/v1/chat/completions", CHAT_BODY) == UsageResult(
        Usage(input_tokens=1117, output_tokens=46, cached_input_tokens=1024), None
    )


def test_openai_chat_body_without_details() -> None:
    """A chat usage without prompt_tokens_details (null or absent) has zero cached tokens."""
    body = {"usage": {"prompt_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": None}}
    result = usage_from_body("openai", "/v1/completions", json.dumps(body).encode())
    assert result == UsageResult(Usage(5, 2), None)


def test_openai_embeddings_body() -> None:
    """Embeddings: prompt_tokens are input, output is zero."""
    result = usage_from_body("openai", "/v1/embeddings", EMBEDDINGS_BODY)
    assert result == UsageResult(Usage(8, 0), None)


def test_openai_responses_body() -> None:
    """The Responses API: input_tokens, output_tokens and input_tokens_details.cached_tokens."""
    result = usage_from_body("openai", "/v1/responses", RESPONSES_BODY)
    assert result == UsageResult(Usage(36, 87, 0), None)


def test_anthropic_messages_body() -> None:
    """Anthropic: input counts cache reads and writes; they are also reported apart."""
    result = usage_from_body("anthropic", "/v1/messages", MESSAGES_BODY)
    assert result == UsageResult(Usage(12 + 2048 + 4096, 9, 4096, 2048), None)
    assert result.believed


def test_flat_body_is_zero_tokens() -> None:
    """A flat provider's JSON body yields zero tokens, believed: the per-call price applies."""
    result = usage_from_body("flat", "/v1/send", b'{"id": "op_1", "status": "queued"}')
    assert result == UsageResult(Usage(0, 0), None)


@pytest.mark.parametrize(
    ("dialect", "path", "body", "problem"),
    [
        ("openai", "/v1/chat/completions", b"not json", "missing"),
        ("openai", "/v1/chat/completions", b"\xff\xfe", "missing"),
        ("openai", "/v1/chat/completions", b"[1, 2]", "missing"),
        ("openai", "/v1/chat/completions", b'{"choices": []}', "missing"),
        ("openai", "/v1/chat/completions", b'{"usage": null}', "missing"),
        ("openai", "/v1/chat/completions", b'{"usage": {"prompt_tokens": 3}}', "missing"),
        ("openai", "/v1/responses", b'{"usage": {"input_tokens": 3}}', "missing"),
        ("anthropic", "/v1/messages", b'{"usage": {"output_tokens": 3}}', "missing"),
        ("flat", "/v1/send", b"<html>", "missing"),
        (
            "openai",
            "/v1/chat/completions",
            b'{"usage": {"prompt_tokens": "3", "completion_tokens": 1}}',
            "malformed",
        ),
        (
            "openai",
            "/v1/chat/completions",
            b'{"usage": {"prompt_tokens": 3.5, "completion_tokens": 1}}',
            "malformed",
        ),
        (
            "anthropic",
            "/v1/messages",
            b'{"usage": {"input_tokens": true, "output_tokens": 1}}',
            "malformed",
        ),
    ],
)
def test_unreadable_usage(dialect: str, path: str, body: bytes, problem: str) -> None:
    """Bodies without readable usage give no usage and name the problem."""
    assert usage_from_body(dialect, path, body) == UsageResult(None, problem)


@pytest.mark.parametrize(
    ("usage", "problem"),
    [
        ({"prompt_tokens": -1, "completion_tokens": 5}, "negative"),
        ({"prompt_tokens": 10, "completion_tokens": -5}, "negative"),
        ({"prompt_tokens": 2**53 + 1, "completion_tokens": 5}, "absurd"),
        ({"prompt_tokens": 10, "completion_tokens": 2**60}, "absurd"),
        (
            {
                "prompt_tokens": 10,
                "completion_tokens": 1,
                "prompt_tokens_details": {"cached_tokens": 11},
            },
            "cached exceeds input",
        ),
    ],
)
def test_unbelievable_usage_is_flagged_but_kept(usage: dict[str, Any], problem: str) -> None:
    """Negative, absurd or cached-over-input usage is kept for the record but not believed."""
    result = usage_from_body(
        "openai", "/v1/chat/completions", json.dumps({"usage": usage}).encode()
    )
    assert result.problem == problem
    assert result.usage is not None and not result.believed


def test_only_read_and_sane_usage_is_believed() -> None:
    """believed needs both: usage that was read, and no problem with it."""
    assert UsageResult(Usage(1, 1), None).believed
    assert not UsageResult(Usage(1, 1), "negative").believed
    assert not UsageResult(None, None).believed


def test_check_usage_rules() -> None:
    """check_usage believes sane usage and names each docs/contract.md §3.7 violation."""
    assert check_usage(Usage(10, 5, 4, 6)) is None
    assert check_usage(Usage(2**53, 2**53)) is None
    assert check_usage(Usage(10, 5, 5, 6)) == "cached exceeds input"
    assert check_usage(Usage(10, 5, -1)) == "negative"
    assert check_usage(Usage(10, 5, 0, 2**53 + 1)) == "absurd"


def test_usage_to_dict() -> None:
    """to_dict names every count."""
    assert Usage(3, 2, 1, 0).to_dict() == {
        "input_tokens": 3,
        "output_tokens": 2,
        "cached_input_tokens": 1,
        "cache_write_tokens": 0,
    }


# --- streams ---------------------------------------------------------------------------------


def sse(*events: dict[str, Any] | str, named: bool = False, crlf: bool = False) -> bytes:
    """Encode events as a server-sent-event stream (``event:`` lines when ``named``)."""
    out = []
    for event in events:
        data = event if isinstance(event, str) else json.dumps(event, ensure_ascii=False)
        head = f"event: {event['type']}\n" if named and isinstance(event, dict) else ""
        out.append(f"{head}data: {data}\n\n")
    text = "".join(out)
    return (text.replace("\n", "\r\n") if crlf else text).encode()


def chat_chunk(content: str | None, usage: dict[str, Any] | None = None) -> dict[str, Any]:
    """One chat.completion.chunk, as OpenAI streams it."""
    choices = [] if content is None else [{"index": 0, "delta": {"content": content}}]
    return {
        "id": "chatcmpl-123",
        "object": "chat.completion.chunk",
        "created": 1694268190,
        "model": "gpt-4o-mini-2024-07-18",
        "choices": choices,
        "usage": usage,
    }


CHAT_STREAM = sse(
    chat_chunk(""),
    chat_chunk("Bonjour — ça va? 👋"),
    chat_chunk("!"),
    chat_chunk(
        None,
        {
            "prompt_tokens": 19,
            "completion_tokens": 10,
            "total_tokens": 29,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    ),
    "[DONE]",
)

RESPONSES_STREAM = sse(
    {"type": "response.created", "sequence_number": 0, "response": {"id": "resp_1", "usage": None}},
    {"type": "response.output_text.delta", "sequence_number": 4, "delta": "Hi 🌍", "item_id": "m"},
    {"type": "response.output_text.done", "sequence_number": 5, "text": "Hi 🌍", "item_id": "m"},
    {
        "type": "response.completed",
        "sequence_number": 8,
        "response": {
            "id": "resp_1",
            "status": "completed",
            "usage": {
                "input_tokens": 1500,
                "input_tokens_details": {"cached_tokens": 1280},
                "output_tokens": 42,
                "output_tokens_details": {"reasoning_tokens": 16},
                "total_tokens": 1542,
            },
        },
    },
    named=True,
)

MESSAGES_STREAM = sse(
    {
        "type": "message_start",
        "message": {
            "id": "msg_1nZdL29xx5MUA1yADyHTEsnR8uuvGzszyY",
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": "claude-haiku-4-5-20251001",
            "stop_reason": None,
            "usage": {
                "input_tokens": 25,
                "cache_creation_input_tokens": 100,
                "cache_read_input_tokens": 2000,
                "output_tokens": 1,
            },
        },
    },
    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    {"type": "ping"},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Héllo"}},
    {"type": "message_delta", "delta": {"stop_reason": None}, "usage": {"output_tokens": 7}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "!"}},
    {"type": "content_block_stop", "index": 0},
    {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
        "usage": {"output_tokens": 15},
    },
    {"type": "message_stop"},
    named=True,
)

STREAMS = [
    ("openai", "/v1/chat/completions", CHAT_STREAM, UsageResult(Usage(19, 10), None)),
    ("openai", "/v1/responses", RESPONSES_STREAM, UsageResult(Usage(1500, 42, 1280), None)),
    ("anthropic", "/v1/messages", MESSAGES_STREAM, UsageResult(Usage(2125, 15, 2000, 100), None)),
]


def feed_all(dialect: str, path: str, chunks: list[bytes]) -> StreamUsage:
    """A StreamUsage fed ``chunks`` in order."""
    parser = StreamUsage(dialect, path)
    for chunk in chunks:
        parser.feed(chunk)
    return parser


@pytest.mark.parametrize(("dialect", "path", "stream", "expected"), STREAMS)
def test_stream_whole(dialect: str, path: str, stream: bytes, expected: UsageResult) -> None:
    """Each dialect's stream yields its final usage and is finished at its terminal marker."""
    parser = feed_all(dialect, path, [stream])
    assert parser.result() == expected
    assert parser.finished


@pytest.mark.parametrize(("dialect", "path", "stream", "expected"), STREAMS)
def test_stream_byte_by_byte_crlf(
    dialect: str, path: str, stream: bytes, expected: UsageResult
) -> None:
    """Feeding one byte at a time, with CRLF line ends, splits UTF-8 and lines yet agrees."""
    crlf = stream.replace(b"\n", b"\r\n")
    parser = feed_all(dialect, path, [crlf[i : i + 1] for i in range(len(crlf))])
    assert parser.result() == expected
    assert parser.finished


@given(data=st.data())
@pytest.mark.parametrize(("dialect", "path", "stream", "expected"), STREAMS)
def test_stream_any_chunking(
    data: st.DataObject, dialect: str, path: str, stream: bytes, expected: UsageResult
) -> None:
    """Any chunking of the same byte stream gives the same usage and the same finish."""
    cuts = sorted(data.draw(st.sets(st.integers(1, len(stream) - 1), max_size=40)))
    bounds = [0, *cuts, len(stream)]
    chunks = [stream[a:b] for a, b in itertools.pairwise(bounds)]
    parser = feed_all(dialect, path, chunks)
    assert parser.result() == expected
    assert parser.finished
    # The terminal event (each sample's last) starts after the blank line before it.
    assert parser.terminal_at == stream.rstrip(b"\n").rfind(b"\n\n") + 2
    assert parser.fed == len(stream)


@pytest.mark.parametrize(("dialect", "path", "stream", "expected"), STREAMS)
def test_stream_cut_short(dialect: str, path: str, stream: bytes, expected: UsageResult) -> None:
    """A stream cut before its final blank line is not finished."""
    parser = feed_all(dialect, path, [stream[:-1]])
    assert not parser.finished


def test_chat_stream_without_include_usage_is_missing() -> None:
    """A chat stream without the usage chunk is finished but its usage is missing."""
    stream = sse(chat_chunk("Hi"), chat_chunk("!"), "[DONE]")
    parser = feed_all("openai", "/v1/chat/completions", [stream])
    assert parser.finished
    assert parser.result() == UsageResult(None, "missing")


def test_chat_stream_before_done_has_usage_but_not_finished() -> None:
    """Usage may arrive before [DONE]; until [DONE] the stream is not finished."""
    parser = feed_all("openai", "/v1/chat/completions", [CHAT_STREAM.split(b"data: [DONE]")[0]])
    assert parser.result() == UsageResult(Usage(19, 10), None)
    assert not parser.finished


def test_responses_incomplete_is_terminal_with_usage() -> None:
    """response.incomplete (e.g. max_output_tokens reached) ends the stream and carries usage."""
    event = {
        "type": "response.incomplete",
        "response": {"status": "incomplete", "usage": {"input_tokens": 5, "output_tokens": 16}},
    }
    parser = feed_all("openai", "/v1/responses", [sse(event)])
    assert parser.finished
    assert parser.result() == UsageResult(Usage(5, 16), None)


def test_anthropic_stream_without_message_delta_is_missing() -> None:
    """An Anthropic stream broken before any message_delta has no believable output count."""
    start = MESSAGES_STREAM.split(b"event: content_block_start")[0]
    parser = feed_all("anthropic", "/v1/messages", [start])
    assert parser.result() == UsageResult(None, "missing")
    assert not parser.finished


def test_anthropic_message_delta_input_counts_win() -> None:
    """Where message_delta repeats the input counts (newer API versions), they are used."""
    stream = sse(
        {"type": "message_start", "message": {"usage": {"input_tokens": 10, "output_tokens": 1}}},
        {
            "type": "message_delta",
            "usage": {"input_tokens": 12, "cache_read_input_tokens": None, "output_tokens": 30},
        },
        {"type": "message_stop"},
    )
    assert feed_all("anthropic", "/v1/messages", [stream]).result() == UsageResult(
        Usage(12, 30), None
    )


def test_stream_unbelievable_usage() -> None:
    """Stream usage goes through the same belief rules as body usage."""
    usage = {"prompt_tokens": 3, "completion_tokens": -1}
    stream = sse(chat_chunk(None, usage), "[DONE]")
    result = feed_all("openai", "/v1/chat/completions", [stream]).result()
    assert result.problem == "negative"


def test_stream_ignores_comments_and_garbage() -> None:
    """SSE comments, unknown fields and non-JSON data lines are skipped."""
    stream = b": keep-alive\n\nretry: 100\nid: 7\ndata: {not json\n\n" + CHAT_STREAM
    parser = feed_all("openai", "/v1/chat/completions", [stream])
    assert parser.result() == UsageResult(Usage(19, 10), None)


# --- stream terminal detection (each test below kills a mutant; see docs/testing.md) -------


@pytest.mark.parametrize(("dialect", "path", "stream", "expected"), STREAMS)
def test_stream_is_complete_only_at_its_terminal_event(
    dialect: str, path: str, stream: bytes, expected: UsageResult
) -> None:
    """complete is False until the terminal event, then True; terminal_at is None until then."""
    parser = StreamUsage(dialect, path)
    assert (parser.finished, parser.complete, parser.terminal_at) == (False, False, None)
    parser.feed(stream[:-1])
    assert (parser.finished, parser.complete, parser.terminal_at) == (False, False, None)
    parser.feed(stream[-1:])
    assert (parser.finished, parser.complete) == (True, True)


def test_a_flat_stream_has_no_terminal_event_and_may_end_anywhere() -> None:
    """A flat (per-call) provider declares no terminal event: its EOF is its end; zero tokens."""
    parser = StreamUsage("flat", "/v1/send")
    assert (parser.finished, parser.complete) == (False, True)
    parser.feed(b"data: {}\n\n")
    assert parser.result() == UsageResult(Usage(0, 0), None)


def test_terminal_at_marks_the_terminal_event_even_as_the_first_event() -> None:
    """A stream that is only [DONE] has its terminal event at offset 0."""
    parser = feed_all("openai", "/v1/chat/completions", [b"data: [DONE]\n\n"])
    assert (parser.finished, parser.terminal_at) == (True, 0)


def test_events_after_the_terminal_event_do_not_move_it() -> None:
    """terminal_at stays at the first terminal event whatever follows it."""
    done = b"data: [DONE]\n\n"
    parser = feed_all("openai", "/v1/chat/completions", [done + sse(chat_chunk("late"))])
    assert parser.terminal_at == 0


_AFTER_THE_END = {
    "/v1/chat/completions": sse(
        chat_chunk(None, {"prompt_tokens": 900_000, "completion_tokens": 1})
    ),
    "/v1/responses": sse(
        {
            "type": "response.completed",
            "response": {"usage": {"input_tokens": 9, "output_tokens": 9}},
        }
    ),
    "/v1/messages": sse(
        {"type": "message_delta", "usage": {"output_tokens": 900_000}}, {"type": "message_stop"}
    ),
}


@pytest.mark.parametrize(("dialect", "path", "stream", "expected"), STREAMS)
def test_events_after_the_terminal_event_change_nothing_wherever_the_network_split_them(
    dialect: str, path: str, stream: bytes, expected: UsageResult
) -> None:
    """A usage event an upstream sends after the terminal event is not read, whether it
    arrives with the terminal event or in a later read. The observation is written at the
    terminal event: a late usage event in the same read as ``[DONE]`` once set the cost,
    and the same bytes split one packet later did not (contract.md §12, "Streams")."""
    late = _AFTER_THE_END[path]
    together = feed_all(dialect, path, [stream + late])
    apart = feed_all(dialect, path, [stream, late])
    assert together.result() == apart.result() == expected
    assert together.finished and together.terminal_at == apart.terminal_at


@pytest.mark.parametrize(
    "path", ["/v1/responses?stream=true", "/v1/responses/", "/v1/responses?a=?b"]
)
def test_the_responses_terminal_event_is_found_whatever_the_query_or_slash(path: str) -> None:
    """A query string or a trailing slash does not hide the Responses API's terminal events."""
    parser = feed_all("openai", path, [RESPONSES_STREAM])
    assert parser.finished
    assert parser.result() == UsageResult(Usage(1500, 42, 1280), None)


def test_data_without_a_space_and_split_over_lines_is_read() -> None:
    """``data:`` without a space, and one event's data over two lines, are one JSON document."""
    stream = b'data:{"type":"message_start","message":{"usage":{"input_tokens":3}}}\n\n'
    stream += b'data: {"type":"message_delta",\ndata: "usage":{"output_tokens":4}}\n\n'
    stream += b'data:{"type":"message_stop"}\n\n'
    parser = feed_all("anthropic", "/v1/messages", [stream])
    assert parser.finished
    assert parser.result() == UsageResult(Usage(3, 4), None)


@pytest.mark.parametrize(
    ("usage", "problem"),
    [(5, "missing"), ({"prompt_tokens": "x", "completion_tokens": 1}, "malformed")],
)
def test_unreadable_stream_usage_is_not_believed(usage: object, problem: str) -> None:
    """Chat stream usage that is not an object, or not integers, is missing or malformed."""
    stream = sse(chat_chunk(None, {"prompt_tokens": 1, "completion_tokens": 1}))
    stream += sse(chat_chunk(None, usage), "[DONE]")  # type: ignore[arg-type]
    assert feed_all("openai", "/v1/chat/completions", [stream]).result() == UsageResult(
        None, problem
    )


def test_responses_usage_is_read_with_the_responses_field_names() -> None:
    """A Responses terminal event carrying chat field names has no readable usage."""
    event = {
        "type": "response.completed",
        "response": {"usage": {"prompt_tokens": 5, "completion_tokens": 6}},
    }
    assert feed_all("openai", "/v1/responses", [sse(event)]).result().problem == "missing"


@pytest.mark.parametrize(
    ("delta", "problem"),
    [
        ({"type": "message_delta", "delta": {"stop_reason": "end_turn"}}, "missing"),
        ({"type": "message_delta", "usage": {"input_tokens": 9}}, "missing"),
        ({"type": "message_delta", "usage": {"output_tokens": "7"}}, "malformed"),
    ],
)
def test_anthropic_stream_needs_the_output_count_from_message_delta(
    delta: dict[str, Any], problem: str
) -> None:
    """Without a readable output count in message_delta, Anthropic stream usage is not believed."""
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 3, "output_tokens": 1}}}
    stream = sse(start, delta, {"type": "message_stop"})
    assert feed_all("anthropic", "/v1/messages", [stream]).result() == UsageResult(None, problem)


def test_anthropic_stream_without_message_start_is_missing() -> None:
    """A message_delta without a message_start (no input counts) is not believed."""
    stream = sse({"type": "message_delta", "usage": {"output_tokens": 3}}, {"type": "message_stop"})
    assert feed_all("anthropic", "/v1/messages", [stream]).result() == UsageResult(None, "missing")


# --- cost ------------------------------------------------------------------------------------

SONNET = ModelPrice(
    input=usd_to_nanos("3"),
    output=usd_to_nanos("15"),
    cached_input=usd_to_nanos("0.30"),
    cache_write=usd_to_nanos("3.75"),
    max_output_tokens=64000,
)


def decimal_cost(price: ModelPrice, usage: Usage) -> int:
    """The same cost computed independently in Decimal USD, rounded up to a nano-dollar."""
    per_token = Decimal(10) ** -15  # nanos per million -> USD per token

    def usd(tokens: int, nanos_per_million: int | None) -> Decimal:
        rate = price.input if nanos_per_million is None else nanos_per_million
        return Decimal(tokens) * Decimal(rate) * per_token

    uncached = usage.input_tokens - usage.cached_input_tokens - usage.cache_write_tokens
    total = (
        usd(uncached, price.input)
        + usd(usage.cached_input_tokens, price.cached_input)
        + usd(usage.cache_write_tokens, price.cache_write)
        + Decimal(usage.output_tokens) * Decimal(price.output) * per_token
    )
    nanos = (total * 10**9).to_integral_value(rounding=ROUND_CEILING)
    return int(nanos) + (price.per_call or 0)


def test_cost_example() -> None:
    """A Sonnet call with cache reads and writes costs exactly the list arithmetic."""
    usage = Usage(
        input_tokens=2125, output_tokens=15, cached_input_tokens=2000, cache_write_tokens=100
    )
    # 25 x $3/M + 2000 x $0.30/M + 100 x $3.75/M + 15 x $15/M = $0.001275
    assert cost(SONNET, usage) == usd_to_nanos("0.001275")


def test_cost_rounds_up_once() -> None:
    """A fraction of a nano-dollar is charged as a whole one, rounding the total once."""
    cheap = ModelPrice(input=20, output=20)  # 20 nano-dollars per million tokens
    assert cost(cheap, Usage(1, 0)) == 1
    assert cost(cheap, Usage(50_000, 0)) == 1
    assert cost(cheap, Usage(50_001, 0)) == 2
    assert cost(cheap, Usage(0, 0)) == 0
    assert cost(cheap, Usage(1, 1)) == 1  # not 1 + 1: the total is rounded, not each part


def test_cost_per_call_and_fallback_prices() -> None:
    """Undeclared cache prices fall back to the input price; per_call is added."""
    price = ModelPrice(input=1_000_000, output=2_000_000, per_call=500)
    assert cost(price, Usage(10, 10, 4, 3)) == 10 + 20 + 500


@given(
    input_tokens=st.integers(0, 2**40),
    output_tokens=st.integers(0, 2**40),
    cached=st.integers(0, 2**40),
    write=st.integers(0, 2**40),
    prices=st.tuples(*[st.integers(0, 10**12)] * 4),
    per_call=st.none() | st.integers(0, 10**9),
    optional=st.booleans(),
)
def test_cost_matches_decimal(
    input_tokens: int,
    output_tokens: int,
    cached: int,
    write: int,
    prices: tuple[int, int, int, int],
    per_call: int | None,
    optional: bool,
) -> None:
    """Integer cost equals an independent Decimal computation for any believable usage."""
    usage = Usage(input_tokens + cached + write, output_tokens, cached, write)
    price = ModelPrice(
        input=prices[0],
        output=prices[1],
        cached_input=prices[2] if optional else None,
        cache_write=prices[3] if optional else None,
        per_call=per_call,
    )
    assert cost(price, usage) == decimal_cost(price, usage)


# --- estimate (contract.md §5 reservation) --------------------------------------------------------

MINI = ModelPrice(input=usd_to_nanos("0.15"), output=usd_to_nanos("0.60"), max_output_tokens=16384)


def test_estimate_chat_uses_bytes_and_max_tokens() -> None:
    """R = UTF-8 bytes of message content x input price + max tokens x output price."""
    request = {
        "model": "gpt-4o-mini",
        "messages": [
            {"role": "system", "content": "Be brief."},  # 9 bytes
            {"role": "user", "content": [{"type": "text", "text": "héllo"}]},  # 6 bytes
        ],
        "max_completion_tokens": 100,
    }
    assert estimate(MINI, request) == (15 * 150_000_000 + 100 * 600_000_000) // 1_000_000


def test_estimate_defaults_to_declared_max_output() -> None:
    """Without max tokens in the request, the model's declared maximum bounds the output."""
    request = {"messages": [{"role": "user", "content": "ab"}]}
    assert estimate(MINI, request) == -(-(2 * 150_000_000 + 16384 * 600_000_000) // 1_000_000)


def test_estimate_request_max_tokens_beyond_declared_is_refused() -> None:
    """A request's max tokens above the model's declared maximum is refused, naming it."""
    request = {"messages": [], "max_tokens": 20000}
    with pytest.raises(OutOfBounds) as caught:
        estimate(MINI, request)
    assert caught.value.field == "max_tokens"
    assert "max_tokens" in str(caught.value)  # the 400 shows this text to the client


def test_estimate_n_choices_multiply_output() -> None:
    """n choices each generate up to the output bound."""
    request = {"messages": [], "max_tokens": 10, "n": 3}
    assert estimate(MINI, request) == 30 * 600


def test_estimate_anthropic_system_and_tools() -> None:
    """Anthropic system blocks and tool definitions count toward the input bound."""
    tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    request = {
        "model": "claude-sonnet-4-5",
        "system": [{"type": "text", "text": "You are terse."}],  # 14 bytes
        "messages": [{"role": "user", "content": "Weather?"}],  # 8 bytes
        "tools": tools,
        "max_tokens": 1024,
    }
    tool_bytes = len(json.dumps(tools, separators=(",", ":")).encode())
    want = ((14 + 8 + tool_bytes) * SONNET.input + 1024 * SONNET.output + 999_999) // 1_000_000
    assert estimate(SONNET, request) == want


def test_estimate_embeddings_and_responses_input() -> None:
    """Embeddings and Responses inputs count, as strings, lists, items and token ids."""
    embed = ModelPrice(input=usd_to_nanos("0.02"), output=0, max_output_tokens=0)
    assert estimate(embed, {"input": ["abc", "dé"]}) == -(-(6 * 20_000_000) // 1_000_000)
    assert estimate(embed, {"input": [[1, 2, 3]]}) == -(-(3 * 20_000_000) // 1_000_000)
    request = {
        "instructions": "Be kind.",  # 8 bytes
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
        "max_output_tokens": 0,
    }
    assert estimate(MINI, request) == -(-(10 * 150_000_000) // 1_000_000)


def test_estimate_flat_is_per_call() -> None:
    """A flat tool's reservation is its per-call price."""
    price = ModelPrice(input=0, output=0, max_output_tokens=0, per_call=usd_to_nanos("0.001"))
    assert estimate(price, {"to": "a@example.com", "body": "hi"}) == 1_000_000


def test_estimate_images_count_as_json() -> None:
    """A non-text content part counts by its JSON size, a generous bound."""
    part = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    request = {"messages": [{"role": "user", "content": [part]}], "max_tokens": 0}
    size = len(json.dumps(part, separators=(",", ":")).encode())
    assert estimate(MINI, request) == -(-(size * 150_000_000) // 1_000_000)


# --- request rewriting -----------------------------------------------------------------------


def test_wants_stream() -> None:
    """Only stream: true asks for a stream."""
    assert wants_stream({"stream": True})
    assert not wants_stream({"stream": False})
    assert not wants_stream({"stream": "true"})
    assert not wants_stream({})


def test_with_stream_usage_adds_include_usage() -> None:
    """A streaming OpenAI chat request gains include_usage in a new dict; the original stays."""
    request: dict[str, Any] = {"model": "m", "stream": True, "stream_options": {"x": 1}}
    changed = with_stream_usage("openai", "/v1/chat/completions", request)
    assert changed == {**request, "stream_options": {"x": 1, "include_usage": True}}
    assert request["stream_options"] == {"x": 1}


@pytest.mark.parametrize(
    ("dialect", "path", "request_body"),
    [
        (
            "openai",
            "/v1/chat/completions",
            {"stream": True, "stream_options": {"include_usage": True}},
        ),
        ("openai", "/v1/chat/completions", {"stream": False}),
        ("openai", "/v1/responses", {"stream": True}),
        ("anthropic", "/v1/messages", {"stream": True}),
    ],
)
def test_with_stream_usage_no_change(dialect: str, path: str, request_body: dict[str, Any]) -> None:
    """Requests that already get usage in their stream (or do not stream) are left alone."""
    assert with_stream_usage(dialect, path, request_body) is None


# --- reservation inputs the mutation run found untested (see docs/testing.md) -------------

#: One nano-dollar per input byte and per output token: R reads as bytes + tokens.
UNIT = ModelPrice(input=1_000_000, output=1_000_000, max_output_tokens=100)


def test_estimate_counts_a_legacy_prompt_and_legacy_functions() -> None:
    """A completions ``prompt`` and the legacy ``functions`` list are input, like messages."""
    functions = [{"name": "f", "parameters": {}}]
    request = {"prompt": "x" * 40, "functions": functions, "max_tokens": 0}
    size = len(json.dumps(functions, separators=(",", ":")))
    assert estimate(UNIT, request) == 40 + size


def test_estimate_counts_an_assistant_messages_tool_calls() -> None:
    """The tool calls an assistant message carries are input (their JSON), beside its text."""
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    message = {"role": "assistant", "content": "ok", "tool_calls": calls}
    size = len(json.dumps(calls, separators=(",", ":")))
    assert estimate(UNIT, {"messages": [message], "max_tokens": 0}) == 2 + size


def test_estimate_counts_token_ids_and_odd_values() -> None:
    """Token ids count one each; a value of no known shape counts as its JSON."""
    assert estimate(UNIT, {"prompt": [12345, 67890], "max_tokens": 0}) == 2
    assert estimate(UNIT, {"prompt": False, "max_tokens": 0}) == len("false")


def test_estimate_best_of_multiplies_the_output_bound() -> None:
    """Legacy ``best_of`` candidates are each generated and billed, like ``n`` choices."""
    assert estimate(UNIT, {"prompt": "", "max_tokens": 10, "best_of": 3}) == 30
    assert estimate(UNIT, {"prompt": "", "max_tokens": 10, "n": 2, "best_of": 3}) == 30


def test_body_usage_shape_follows_its_field_names() -> None:
    """Chat names (prompt_tokens) win when present; input/output names are read otherwise."""
    both = {"usage": {"prompt_tokens": 5, "completion_tokens": 6, "input_tokens": 99}}
    assert usage_from_body("openai", "/v1/chat/completions", json.dumps(both).encode()) == (
        UsageResult(Usage(5, 6), None)
    )
    images = {"usage": {"input_tokens": 7, "output_tokens": 8}}
    assert usage_from_body("openai", "/v1/images/generations", json.dumps(images).encode()) == (
        UsageResult(Usage(7, 8), None)
    )


@pytest.mark.parametrize(
    "path",
    ["/v1/chat/completions?stream=true", "/v1/chat/completions/", "/v1/chat/completions?a=?b"],
)
def test_with_stream_usage_sees_the_endpoint_through_query_and_slash(path: str) -> None:
    """A query string or trailing slash does not stop the include_usage rewrite."""
    request = {"model": "m", "stream": True, "stream_options": "not an object"}
    assert with_stream_usage("openai", path, request) == {
        "model": "m",
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@given(
    st.lists(st.text(max_size=40), max_size=4),
    st.one_of(st.none(), st.integers(0, 2000)),
    st.sampled_from(["openai", "anthropic", "flat"]),
)
def test_reservation_is_estimate_and_estimate_tokens(
    contents: list[str], cap: int | None, dialect: str
) -> None:
    """Admission reads both from one walk of the body; each equals its own function."""
    request: dict[str, Any] = {"messages": [{"role": "user", "content": c} for c in contents]}
    if cap is not None:
        request["max_tokens"] = cap
    assert reservation(MINI, request, dialect=dialect) == (
        estimate(MINI, request, dialect=dialect),
        estimate_tokens(MINI, request, dialect=dialect),
    )
