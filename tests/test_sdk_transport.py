"""The real openai and anthropic SDKs through AsyncGuardTransport and GuardTransport.

The upstream is respx with realistic JSON bodies and server-sent-event streams.
Checks that responses arrive intact, that the ledger settles at the exact cost
from the declared prices, that abandoned and broken streams are settled or
marked effect-unknown, and that the SDKs' own retries never re-send an effect.
"""

from __future__ import annotations

import asyncio
import gc
import json
import signal
import sys
import threading
import time
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest
import respx

from effectguard import AsyncGuardTransport, GuardSettings, GuardTransport, Ledger
from effectguard.ingress.httpx2 import AsyncHttpx2Transport, Httpx2Transport
from effectguard.ops.verify import VerifyReport, verify_ledger
from effectguard.providers import load_providers
from effectguard.rules.budget import BudgetNode
from effectguard.rules.usage import Usage, cost
from effectguard.rules.workstate import WorkState
from effectguard.testing import fake_provider

OPENAI = "https://api.openai.com"
ANTHROPIC = "https://api.anthropic.com"
GPT = "gpt-4o-mini"
CLAUDE = "claude-haiku-4-5"
PROVIDERS = load_providers([])
MESSAGES = [{"role": "user", "content": "Say hello"}]
FAST = GuardSettings(retry_wait_s=0, retry_wait_max_s=0)

MakeTransport = Callable[..., AsyncGuardTransport]
Finish = Callable[[AsyncGuardTransport], Awaitable[None]]


def price_cost(provider: str, model: str, usage: Usage) -> int:
    """The expected cost of ``usage`` from the provider's declared prices."""
    price = PROVIDERS[provider].price_for(model)
    assert price is not None
    return cost(price, usage)


# -- upstream bodies ----------------------------------------------------------------

CHAT_BODY: dict[str, Any] = {
    "id": "chatcmpl-abc",
    "object": "chat.completion",
    "created": 1_700_000_000,
    "model": "gpt-4o-mini-2024-07-18",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello there!", "refusal": None},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ],
    "usage": {
        "prompt_tokens": 1200,
        "completion_tokens": 42,
        "total_tokens": 1242,
        "prompt_tokens_details": {"cached_tokens": 1024, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0},
    },
    "system_fingerprint": "fp_1",
}
CHAT_USAGE = Usage(input_tokens=1200, output_tokens=42, cached_input_tokens=1024)


def _chunk(**fields: Any) -> bytes:
    doc = {
        "id": "chatcmpl-s",
        "object": "chat.completion.chunk",
        "created": 1_700_000_000,
        "model": "gpt-4o-mini-2024-07-18",
        **fields,
    }
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


CHAT_STREAM = [
    _chunk(choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}}]),
    _chunk(choices=[{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]),
    _chunk(choices=[{"index": 0, "delta": {"content": "lo!"}, "finish_reason": None}]),
    _chunk(choices=[{"index": 0, "delta": {}, "finish_reason": "stop"}]),
    _chunk(
        choices=[],
        usage={"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15},
    ),
    b"data: [DONE]\n\n",
]
CHAT_STREAM_USAGE = Usage(12, 3)

MESSAGE_BODY: dict[str, Any] = {
    "id": "msg_01",
    "type": "message",
    "role": "assistant",
    "model": CLAUDE,
    "content": [{"type": "text", "text": "Hello from Claude"}],
    "stop_reason": "end_turn",
    "stop_sequence": None,
    "usage": {
        "input_tokens": 20,
        "cache_read_input_tokens": 100,
        "cache_creation_input_tokens": 8,
        "output_tokens": 7,
    },
}
# Anthropic's input_tokens exclude cache reads and writes; the ledger counts all input.
MESSAGE_USAGE = Usage(128, 7, cached_input_tokens=100, cache_write_tokens=8)


def _event(name: str, **doc: Any) -> bytes:
    return f"event: {name}\ndata: {json.dumps({'type': name, **doc})}\n\n".encode()


MESSAGE_STREAM = [
    _event(
        "message_start",
        message={
            "id": "msg_02",
            "type": "message",
            "role": "assistant",
            "model": CLAUDE,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 25, "output_tokens": 1},
        },
    ),
    _event("content_block_start", index=0, content_block={"type": "text", "text": ""}),
    _event("ping"),
    _event("content_block_delta", index=0, delta={"type": "text_delta", "text": "Hello"}),
    _event("content_block_delta", index=0, delta={"type": "text_delta", "text": " world"}),
    _event("content_block_stop", index=0),
    _event(
        "message_delta",
        delta={"stop_reason": "end_turn", "stop_sequence": None},
        usage={"output_tokens": 15},
    ),
    _event("message_stop"),
]
MESSAGE_STREAM_USAGE = Usage(25, 15)


#: How long an upstream's stream stalls at ``pause_at``.
PAUSE_S = 1.0


class Upstream:
    """A respx side effect serving one SSE stream per request, optionally breaking mid-way.

    ``break_at`` raises a read error at that event; ``cut_at`` ends the body cleanly there
    (an HTTP/1.0-style close-delimited stream whose connection closed early);
    ``pause_at`` stalls :data:`PAUSE_S` before that event.
    """

    def __init__(
        self,
        events: list[bytes],
        *,
        sync: bool,
        break_at: int | None = None,
        cut_at: int | None = None,
        pause_at: int | None = None,
    ) -> None:
        self.events = events[:cut_at]
        self.sync = sync
        self.break_at = break_at
        self.pause_at = pause_at
        self.read_to_end = threading.Event()

    def _check(self, i: int) -> None:
        if i == self.break_at:
            raise httpx.ReadError("connection reset mid-stream")
        if i == len(self.events) - 1:
            self.read_to_end.set()  # the terminal event is being handed out

    def _sync(self) -> Iterator[bytes]:
        for i, event in enumerate(self.events):
            self._check(i)
            if i == self.pause_at:
                time.sleep(PAUSE_S)
            yield event

    async def _async(self) -> AsyncIterator[bytes]:
        for i, event in enumerate(self.events):
            self._check(i)
            if i == self.pause_at:
                await asyncio.sleep(PAUSE_S)
            yield event
            await asyncio.sleep(0)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        content = self._sync() if self.sync else self._async()
        return httpx.Response(
            200, headers={"content-type": "text/event-stream; charset=utf-8"}, content=content
        )


class CountingTransport(httpx.AsyncBaseTransport):
    """Counts the requests an SDK sends to the guard (its own retries included)."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.retry_counts: list[str | None] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.retry_counts.append(request.headers.get("x-stainless-retry-count"))
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


class CountingSyncTransport(httpx.BaseTransport):
    """The sync twin of :class:`CountingTransport`."""

    def __init__(self, inner: httpx.BaseTransport) -> None:
        self.inner = inner
        self.retry_counts: list[str | None] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.retry_counts.append(request.headers.get("x-stainless-retry-count"))
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


def async_openai(transport: httpx.AsyncBaseTransport, **kw: Any) -> openai.AsyncOpenAI:
    """An AsyncOpenAI client over ``transport``."""
    return openai.AsyncOpenAI(
        api_key="sk-test",
        base_url=OPENAI + "/v1",
        http_client=httpx.AsyncClient(transport=transport),
        **kw,
    )


def sync_openai(transport: httpx.BaseTransport, **kw: Any) -> openai.OpenAI:
    """An OpenAI client over ``transport``."""
    return openai.OpenAI(
        api_key="sk-test",
        base_url=OPENAI + "/v1",
        http_client=httpx.Client(transport=transport),
        **kw,
    )


def async_anthropic(transport: httpx.AsyncBaseTransport, **kw: Any) -> anthropic.AsyncAnthropic:
    """An AsyncAnthropic client over ``transport`` (through the httpx2 adapter)."""
    client = httpx2.AsyncClient(transport=AsyncHttpx2Transport(transport))
    return anthropic.AsyncAnthropic(
        api_key="test-key", base_url=ANTHROPIC, http_client=client, **kw
    )


def sync_anthropic(transport: httpx.BaseTransport, **kw: Any) -> anthropic.Anthropic:
    """An Anthropic client over ``transport`` (through the httpx2 adapter)."""
    client = httpx2.Client(transport=Httpx2Transport(transport))
    return anthropic.Anthropic(api_key="test-key", base_url=ANTHROPIC, http_client=client, **kw)


Snapshot = tuple[list[WorkState], dict[str, BudgetNode], VerifyReport]


def snapshot(path: str) -> Snapshot:
    """Calls, budgets and a verify report, read from a closed ledger file."""

    async def read() -> Snapshot:
        async with Ledger.open(path) as ledger:
            calls = await ledger.calls()
            nodes = {n.path: n for n in await ledger.budgets()}
            return calls, nodes, await verify_ledger(ledger)

    return asyncio.run(read())


async def settled(transport: AsyncGuardTransport, timeout: float = 10.0) -> list[WorkState]:
    """The calls, once none is in flight any more."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        calls = await transport.ledger.calls()
        if all(c.stage != "in_flight" for c in calls):
            return calls
        assert asyncio.get_running_loop().time() < deadline, calls
        await asyncio.sleep(0.02)


def one(calls: list[WorkState]) -> WorkState:
    """The only call."""
    assert len(calls) == 1, calls
    return calls[0]


# -- non-streaming ------------------------------------------------------------------


@respx.mock(base_url=OPENAI)
async def test_openai_async_completion_is_intact_and_settled_exactly(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """AsyncOpenAI through the guard gets the body intact; the ledger spends the exact price."""
    route = respx_mock.post("/v1/chat/completions").mock(
        return_value=httpx.Response(200, json=CHAT_BODY)
    )
    t = make_transport()
    client = async_openai(t)
    raw = await client.chat.completions.with_raw_response.create(model=GPT, messages=MESSAGES)
    completion = raw.parse()
    assert completion.choices[0].message.content == "Hello there!"
    assert json.loads(raw.http_response.content) == CHAT_BODY
    assert route.call_count == 1
    call = one(await t.ledger.calls())
    assert raw.headers["effectguard-call-id"] == call.call_id
    assert (call.stage, call.model, call.cost) == (
        "completed",
        GPT,
        price_cost("openai", GPT, CHAT_USAGE),
    )
    await finish(t)


def test_openai_sync_completion_is_intact_and_settled_exactly(ledger_path: str) -> None:
    """OpenAI (sync) through GuardTransport gets the body intact; the exact price is spent."""
    t = GuardTransport(ledger=ledger_path, settings=FAST)
    try:
        with respx.mock(base_url=OPENAI) as mock:
            mock.post("/v1/chat/completions").mock(return_value=httpx.Response(200, json=CHAT_BODY))
            completion = sync_openai(t).chat.completions.create(model=GPT, messages=MESSAGES)
    finally:
        t.close()
    assert completion.usage is not None and completion.usage.completion_tokens == 42
    assert completion.choices[0].message.content == "Hello there!"
    calls, nodes, report = snapshot(ledger_path)
    assert (one(calls).stage, one(calls).cost) == (
        "completed",
        price_cost("openai", GPT, CHAT_USAGE),
    )
    assert nodes["default"].spent == price_cost("openai", GPT, CHAT_USAGE)
    assert report.ok, report.problems


@respx.mock(base_url=ANTHROPIC)
async def test_anthropic_async_message_is_intact_and_settled_exactly(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """AsyncAnthropic through the guard; cache reads and writes are priced at their own rates."""
    route = respx_mock.post("/v1/messages").mock(
        return_value=httpx.Response(200, json=MESSAGE_BODY)
    )
    t = make_transport()
    message = await async_anthropic(t).messages.create(
        model=CLAUDE, max_tokens=256, messages=MESSAGES
    )
    assert message.content[0].type == "text"
    assert message.content[0].text == "Hello from Claude"
    assert route.call_count == 1
    # The client's credential passes through to the provider.
    assert route.calls.last.request.headers["authorization"] == "Bearer test-key"
    call = one(await t.ledger.calls())
    assert (call.stage, call.cost) == ("completed", price_cost("anthropic", CLAUDE, MESSAGE_USAGE))
    await finish(t)


def test_anthropic_sync_message_is_intact_and_settled_exactly(ledger_path: str) -> None:
    """Anthropic (sync) through GuardTransport gets the message; the exact price is spent."""
    t = GuardTransport(ledger=ledger_path, settings=FAST)
    try:
        with respx.mock(base_url=ANTHROPIC) as mock:
            mock.post("/v1/messages").mock(return_value=httpx.Response(200, json=MESSAGE_BODY))
            message = sync_anthropic(t).messages.create(
                model=CLAUDE, max_tokens=256, messages=MESSAGES
            )
    finally:
        t.close()
    assert message.usage.cache_read_input_tokens == 100
    calls, _, report = snapshot(ledger_path)
    assert one(calls).cost == price_cost("anthropic", CLAUDE, MESSAGE_USAGE)
    assert report.ok, report.problems


# -- streaming ----------------------------------------------------------------------


@respx.mock(base_url=OPENAI)
async def test_openai_async_stream_is_priced_from_a_usage_chunk_its_client_is_not_shown(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """The guard asks OpenAI for the usage chunk and prices the call from it exactly; the
    client, which did not ask for it, is not shown it, so the loop the SDK's examples
    write (``chunk.choices[0]`` of every chunk) runs to the end."""
    route = respx_mock.post("/v1/chat/completions").mock(
        side_effect=Upstream(CHAT_STREAM, sync=False)
    )
    t = make_transport()
    stream = await async_openai(t).chat.completions.create(
        model=GPT, messages=MESSAGES, stream=True
    )
    text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
    assert text == "Hello!"
    sent = json.loads(route.calls.last.request.content)
    assert sent["stream"] is True
    assert sent["stream_options"] == {"include_usage": True}
    call = one(await t.ledger.calls())
    assert (call.stage, call.cost) == ("completed", price_cost("openai", GPT, CHAT_STREAM_USAGE))
    await finish(t)


@respx.mock(base_url=OPENAI)
async def test_a_stream_whose_line_ends_mix_lf_and_crlf_is_not_shown_its_usage_chunk(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """SSE lets a data line end in LF and its blank line in CRLF: the client that did not
    ask for the usage chunk is still not shown it, so ``chunk.choices[0]`` runs to the
    end. (Such a mix was no event boundary to the reader that hides the chunk: the SDK
    got the whole stream at its end, usage chunk included, and raised IndexError.)"""
    mixed = [event.removesuffix(b"\n") + b"\r\n" for event in CHAT_STREAM]
    respx_mock.post("/v1/chat/completions").mock(side_effect=Upstream(mixed, sync=False))
    t = make_transport()
    stream = await async_openai(t).chat.completions.create(
        model=GPT, messages=MESSAGES, stream=True
    )
    text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
    assert text == "Hello!"
    call = one(await t.ledger.calls())
    assert (call.stage, call.cost) == ("completed", price_cost("openai", GPT, CHAT_STREAM_USAGE))
    await finish(t)


@respx.mock(base_url=OPENAI)
async def test_a_stream_sent_in_one_chunk_is_forwarded_up_to_its_held_terminal_event(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """Only the terminal event waits for the observation; the events before it go at once."""
    whole = b"".join(CHAT_STREAM)  # a fast upstream: the whole stream in one read
    respx_mock.post("/v1/chat/completions").mock(
        return_value=httpx.Response(
            200, headers={"content-type": "text/event-stream"}, stream=httpx.ByteStream(whole)
        )
    )
    t = make_transport()
    body = {"model": GPT, "messages": MESSAGES, "stream": True}
    received: list[bytes] = []
    client = httpx.AsyncClient(transport=t)  # not closed here: that would close the ledger
    async with client.stream("POST", OPENAI + "/v1/chat/completions", json=body) as response:
        async for chunk in response.aiter_raw():
            if not received:  # the first bytes arrive before the call is observed
                assert one(await t.ledger.calls()).stage == "in_flight"
            received.append(chunk)
    shown = b"".join(c for c in CHAT_STREAM if c != CHAT_STREAM[-2])  # no usage chunk
    assert received[0] == shown.removesuffix(CHAT_STREAM[-1])
    assert received[-1] == CHAT_STREAM[-1] == b"data: [DONE]\n\n"
    assert b"".join(received) == shown
    call = one(await t.ledger.calls())
    assert (call.stage, call.cost) == ("completed", price_cost("openai", GPT, CHAT_STREAM_USAGE))
    await finish(t)


@respx.mock(base_url=OPENAI)
async def test_a_stream_event_with_a_hostile_type_is_passed_on_and_settled(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """A usage event whose "type" is a list (not a name) is read as usage (and, as the
    usage event the guard asked for, not shown to the client), the rest passed on.

    The stream reader once raised on it (an unhashable "type"), failing a call the provider
    had answered in full.
    """
    usage = b'"usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}'
    hostile = b'data: {"type": [], "choices": [], ' + usage + b"}\n\n"
    stream = [*CHAT_STREAM[:-2], hostile, CHAT_STREAM[-1]]
    respx_mock.post("/v1/chat/completions").mock(side_effect=Upstream(stream, sync=False))
    t = make_transport()
    body = {"model": GPT, "messages": MESSAGES, "stream": True}
    client = httpx.AsyncClient(transport=t)  # not closed here: that would close the ledger
    async with client.stream("POST", OPENAI + "/v1/chat/completions", json=body) as response:
        received = b"".join([chunk async for chunk in response.aiter_raw()])
    assert received == b"".join(c for c in stream if c != hostile)
    call = one(await t.ledger.calls())
    assert (call.stage, call.cost) == ("completed", price_cost("openai", GPT, CHAT_STREAM_USAGE))
    await finish(t)


def test_openai_sync_stream_gets_usage_chunk_and_is_settled(ledger_path: str) -> None:
    """Through GuardTransport, an OpenAI stream arrives whole and is priced from its usage chunk."""
    t = GuardTransport(ledger=ledger_path, settings=FAST)
    try:
        with respx.mock(base_url=OPENAI) as mock:
            route = mock.post("/v1/chat/completions").mock(
                side_effect=Upstream(CHAT_STREAM, sync=True)
            )
            stream = sync_openai(t).chat.completions.create(
                model=GPT, messages=MESSAGES, stream=True, stream_options={"include_usage": False}
            )
            chunks = list(stream)
    finally:
        t.close()
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello!"
    assert json.loads(route.calls.last.request.content)["stream_options"] == {"include_usage": True}
    calls, _, report = snapshot(ledger_path)
    assert (one(calls).stage, one(calls).cost) == (
        "completed",
        price_cost("openai", GPT, CHAT_STREAM_USAGE),
    )
    assert report.ok, report.problems


@respx.mock(base_url=ANTHROPIC)
async def test_anthropic_async_stream_is_intact_and_settled(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """An Anthropic message stream arrives whole; usage from message_start and message_delta."""
    respx_mock.post("/v1/messages").mock(side_effect=Upstream(MESSAGE_STREAM, sync=False))
    t = make_transport()
    async with async_anthropic(t).messages.stream(
        model=CLAUDE, max_tokens=512, messages=MESSAGES
    ) as stream:
        text = "".join([piece async for piece in stream.text_stream])
        final = await stream.get_final_message()
    assert text == "Hello world"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (25, 15)
    call = one(await t.ledger.calls())
    assert (call.stage, call.cost) == (
        "completed",
        price_cost("anthropic", CLAUDE, MESSAGE_STREAM_USAGE),
    )
    await finish(t)


def test_anthropic_sync_stream_is_intact_and_settled(ledger_path: str) -> None:
    """Through GuardTransport, an Anthropic stream arrives whole and is priced from its usage."""
    t = GuardTransport(ledger=ledger_path, settings=FAST)
    try:
        with respx.mock(base_url=ANTHROPIC) as mock:
            mock.post("/v1/messages").mock(side_effect=Upstream(MESSAGE_STREAM, sync=True))
            events = list(
                sync_anthropic(t).messages.create(
                    model=CLAUDE, max_tokens=512, messages=MESSAGES, stream=True
                )
            )
    finally:
        t.close()
    assert events[0].type == "message_start"
    assert events[-1].type == "message_stop"
    calls, _, report = snapshot(ledger_path)
    assert (one(calls).stage, one(calls).cost) == (
        "completed",
        price_cost("anthropic", CLAUDE, MESSAGE_STREAM_USAGE),
    )
    assert report.ok, report.problems


@respx.mock(base_url=OPENAI)
async def test_abandoned_async_stream_is_read_to_end_and_settled(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """A stream left after one chunk is read to its end and settled, not left in flight."""
    upstream = Upstream(CHAT_STREAM, sync=False)
    respx_mock.post("/v1/chat/completions").mock(side_effect=upstream)
    t = make_transport()
    stream = await async_openai(t).chat.completions.create(
        model=GPT, messages=MESSAGES, stream=True
    )
    async for _ in stream:
        break
    await stream.close()
    call = one(await settled(t))
    assert upstream.read_to_end.is_set()
    assert (call.stage, call.cost, call.reserved) == (
        "completed",
        price_cost("openai", GPT, CHAT_STREAM_USAGE),
        0,
    )
    await finish(t)


def test_abandoned_sync_stream_is_settled(ledger_path: str) -> None:
    """An Anthropic stream abandoned half-read through GuardTransport ends up settled."""
    upstream = Upstream(MESSAGE_STREAM, sync=True)
    t = GuardTransport(ledger=ledger_path, settings=FAST)
    try:
        with respx.mock(base_url=ANTHROPIC) as mock:
            mock.post("/v1/messages").mock(side_effect=upstream)
            stream = sync_anthropic(t).messages.create(
                model=CLAUDE, max_tokens=512, messages=MESSAGES, stream=True
            )
            for event in stream:
                assert event.type == "message_start"
                break
            stream.close()
            assert upstream.read_to_end.wait(10)
    finally:
        t.close()
    calls, nodes, report = snapshot(ledger_path)
    expected = price_cost("anthropic", CLAUDE, MESSAGE_STREAM_USAGE)
    assert (one(calls).stage, one(calls).cost) == ("completed", expected)
    assert (nodes["default"].reserved, nodes["default"].spent) == (0, expected)
    assert report.ok, report.problems


@pytest.mark.skipif(
    sys.version_info < (3, 13),
    reason="Python 3.13 is the first to warn of an async generator's aclose() never awaited",
)
def test_closing_the_sync_transport_finishes_abandoned_streams_quietly(ledger_path: str) -> None:
    """A stream read half-way leaves async generators open on the portal's loop; closing
    the transport finishes them there, so no "never awaited" warning reaches the user."""
    upstream = Upstream(MESSAGE_STREAM, sync=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        t = GuardTransport(ledger=ledger_path, settings=FAST)
        with respx.mock(base_url=ANTHROPIC) as mock:
            mock.post("/v1/messages").mock(side_effect=upstream)
            stream = sync_anthropic(t).messages.create(
                model=CLAUDE, max_tokens=512, messages=MESSAGES, stream=True
            )
            assert next(iter(stream)).type == "message_start"
            stream.close()
            assert upstream.read_to_end.wait(10)
        t.close()
        del t, stream
        gc.collect()
    unawaited = [str(w.message) for w in seen if "never awaited" in str(w.message)]
    assert unawaited == []
    assert one(snapshot(ledger_path)[0]).stage == "completed"


@respx.mock(base_url=OPENAI)
async def test_broken_async_stream_raises_and_is_effect_unknown(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """A stream cut mid-way makes the SDK iteration raise; the call is effect_unknown and held."""
    respx_mock.post("/v1/chat/completions").mock(
        side_effect=Upstream(CHAT_STREAM, sync=False, break_at=3)
    )
    t = make_transport()
    stream = await async_openai(t).chat.completions.create(
        model=GPT, messages=MESSAGES, stream=True
    )
    seen: list[str] = []
    with pytest.raises(openai.APIConnectionError):
        async for chunk in stream:
            seen.append(chunk.choices[0].delta.content or "")
    assert "".join(seen) == "Hello!"  # the chunks before the break were forwarded
    call = one(await t.ledger.calls())
    assert (call.stage, call.held, call.reserved) == (
        "effect_unknown",
        call.reserved_at_admission,
        0,
    )
    assert call.cost is None
    await finish(t)


def test_broken_sync_stream_raises_and_is_effect_unknown(ledger_path: str) -> None:
    """Through GuardTransport, a cut Anthropic stream raises in the SDK; call effect_unknown."""
    t = GuardTransport(ledger=ledger_path, settings=FAST)
    try:
        with respx.mock(base_url=ANTHROPIC) as mock:
            mock.post("/v1/messages").mock(
                side_effect=Upstream(MESSAGE_STREAM, sync=True, break_at=4)
            )
            stream = sync_anthropic(t).messages.create(
                model=CLAUDE, max_tokens=512, messages=MESSAGES, stream=True
            )
            types: list[str] = []
            with pytest.raises((anthropic.APIConnectionError, httpx2.TransportError)):
                for event in stream:
                    types.append(event.type)
    finally:
        t.close()
    assert "message_stop" not in types
    calls, nodes, report = snapshot(ledger_path)
    call = one(calls)
    assert (call.stage, call.held) == ("effect_unknown", call.reserved_at_admission)
    assert nodes["default"].held == call.reserved_at_admission
    assert report.ok, report.problems


@pytest.mark.parametrize(
    ("url", "events", "cut_at"),
    [
        (OPENAI + "/v1/chat/completions", CHAT_STREAM, 3),
        # Every event but [DONE]: even the usage chunk arrived, yet the stream is not over.
        (OPENAI + "/v1/chat/completions", CHAT_STREAM, len(CHAT_STREAM) - 1),
        (ANTHROPIC + "/v1/messages", MESSAGE_STREAM, len(MESSAGE_STREAM) - 1),
    ],
)
async def test_stream_ending_cleanly_before_its_terminal_event_is_effect_unknown(
    url: str, events: list[bytes], cut_at: int, make_transport: MakeTransport, finish: Finish
) -> None:
    """An upstream EOF before [DONE]/message_stop is a broken stream: error, effect_unknown."""
    body: dict[str, Any] = {"model": GPT, "messages": MESSAGES, "stream": True}
    if url.startswith(ANTHROPIC):
        body = {"model": CLAUDE, "max_tokens": 64, "messages": MESSAGES, "stream": True}
    t = make_transport()
    client = httpx.AsyncClient(transport=t)
    seen = b""
    with respx.mock() as mock:
        mock.post(url).mock(side_effect=Upstream(events, sync=False, cut_at=cut_at))
        with pytest.raises(httpx.RemoteProtocolError, match="unknown effect"):
            async with client.stream("POST", url, json=body) as response:
                async for chunk in response.aiter_raw():
                    seen += chunk
    # What came before the cut was forwarded (but the usage chunk the guard asked for).
    assert seen == b"".join(e for e in events[:cut_at] if e != CHAT_STREAM[-2])
    call = one(await t.ledger.calls())
    assert (call.stage, call.effect, call.cost) == ("effect_unknown", "unknown", None)
    assert (call.held, call.reserved) == (call.reserved_at_admission, 0)
    kinds = [e.kind for e in await t.ledger.events(call.call_id)]
    assert "attempt.interrupted" in kinds and "attempt.observed" not in kinds
    await finish(t)


@respx.mock(base_url=OPENAI)
async def test_sdk_stream_cut_cleanly_before_done_raises_in_the_sdk(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """The openai SDK iterating a stream cut before [DONE] raises instead of ending cleanly."""
    respx_mock.post("/v1/chat/completions").mock(
        side_effect=Upstream(CHAT_STREAM, sync=False, cut_at=len(CHAT_STREAM) - 1)
    )
    t = make_transport()
    stream = await async_openai(t).chat.completions.create(
        model=GPT, messages=MESSAGES, stream=True
    )
    with pytest.raises(openai.APIConnectionError):
        async for _ in stream:
            pass
    assert one(await t.ledger.calls()).stage == "effect_unknown"
    await finish(t)


# -- the SDKs' own retries ------------------------------------------------------------


@respx.mock(base_url=OPENAI)
async def test_sdk_retries_never_resend_after_read_timeout(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """With the SDK's default max_retries=2, a read timeout reaches the upstream exactly once."""
    route = respx_mock.post("/v1/chat/completions").mock(side_effect=httpx.ReadTimeout("slow"))
    t = make_transport()
    counting = CountingTransport(t)
    client = async_openai(counting)
    assert client.max_retries == 2
    with pytest.raises(openai.APIStatusError) as raised:
        await client.chat.completions.create(model=GPT, messages=MESSAGES)
    assert raised.value.status_code in (504, 409)
    assert route.call_count == 1
    call = one(await t.ledger.calls())
    assert (call.stage, call.held, call.reserved) == (
        "effect_unknown",
        call.reserved_at_admission,
        0,
    )
    assert call.cost is None
    nodes = {n.path: n for n in await t.ledger.budgets()}
    assert (nodes["default"].held, nodes["default"].spent) == (call.reserved_at_admission, 0)
    await finish(t)


@respx.mock(base_url=OPENAI)
async def test_sdk_does_not_retry_a_409_effect_unknown(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """SDK honours x-should-retry: false on 409 effect_unknown: one request reaches the guard."""
    route = respx_mock.post("/v1/chat/completions").mock(side_effect=httpx.ReadTimeout("slow"))
    t = make_transport()
    counting = CountingTransport(t)
    client = async_openai(counting)
    key = {"Idempotency-Key": "op-1"}
    with pytest.raises(openai.APIStatusError):
        await client.chat.completions.create(model=GPT, messages=MESSAGES, extra_headers=key)
    before = len(counting.retry_counts)
    with pytest.raises(openai.ConflictError) as raised:
        await client.chat.completions.create(model=GPT, messages=MESSAGES, extra_headers=key)
    assert len(counting.retry_counts) - before == 1
    assert raised.value.status_code == 409
    body = raised.value.body
    assert isinstance(body, dict) and body["type"] == "effect_unknown"
    assert route.call_count == 1
    await finish(t)


@pytest.mark.parametrize(
    ("status", "stage", "error"),
    [
        (502, "failed", openai.InternalServerError),  # an undeclared error: booked as applied
        (500, "effect_unknown", openai.InternalServerError),  # declared transient "unknown"
        (409, "failed", openai.ConflictError),  # an SDK retries 409s too
    ],
)
@respx.mock(base_url=OPENAI)
async def test_sdk_does_not_retry_an_error_booked_applied_or_unknown(
    respx_mock: respx.MockRouter,
    make_transport: MakeTransport,
    finish: Finish,
    status: int,
    stage: str,
    error: type[openai.APIStatusError],
) -> None:
    """An error answer the guard books as applied (``failed``) or as an unknown effect
    goes to the client with ``x-should-retry: false``, whatever the provider said: the
    SDK's own retry would be new work, repeating the effect and its charge (three
    provider calls and three charges per SDK call, before), or a 409 hiding the error."""
    route = respx_mock.post("/v1/chat/completions").mock(
        return_value=httpx.Response(
            status, json={"error": {"message": "boom"}}, headers={"x-should-retry": "true"}
        )
    )
    t = make_transport()
    counting = CountingTransport(t)
    client = async_openai(counting)
    assert client.max_retries == 2
    with pytest.raises(error) as raised:
        await client.chat.completions.create(model=GPT, messages=MESSAGES)
    assert raised.value.status_code == status
    assert raised.value.response.headers.get_list("x-should-retry") == ["false"]
    assert (route.call_count, counting.retry_counts) == (1, ["0"])
    assert one(await t.ledger.calls()).stage == stage
    await finish(t)


@respx.mock(base_url=OPENAI)
async def test_a_replayed_error_answer_is_final_too(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """A keyed resend of a failed call replays its error marked ``x-should-retry: false``."""
    respx_mock.post("/v1/chat/completions").mock(
        return_value=httpx.Response(502, json={"error": {"message": "boom"}})
    )
    t = make_transport()
    client = httpx.AsyncClient(transport=t)
    body = {"model": GPT, "messages": MESSAGES}
    key = {"Idempotency-Key": "failed-1"}
    first = await client.post(OPENAI + "/v1/chat/completions", json=body, headers=key)
    replay = await client.post(OPENAI + "/v1/chat/completions", json=body, headers=key)
    assert (first.status_code, replay.status_code) == (502, 502)
    assert replay.headers["effectguard-replayed"] == "true"
    assert replay.headers.get_list("x-should-retry") == ["false"]
    await finish(t)


@pytest.mark.parametrize(
    "timeout", [0.3, httpx.Timeout(None, read=0.3)], ids=["one-number", "read-only"]
)
@respx.mock(base_url=OPENAI)
async def test_a_client_timeout_ends_the_wait_not_the_call(
    respx_mock: respx.MockRouter,
    make_transport: MakeTransport,
    finish: Finish,
    timeout: float | httpx.Timeout,
) -> None:
    """The SDK's timeout (0.3 s) is shorter than the answer (0.8 s): the SDK gets its
    timeout error, the call goes on and is settled from the provider's answer, and a
    resend with the same key gets that answer. The client's timeout used to be passed to
    the upstream read, so the call ended effect_unknown, its money held, for a person to
    reconcile, although the provider answered 200."""

    async def slow(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(0.8)
        return httpx.Response(200, json=CHAT_BODY)

    route = respx_mock.post("/v1/chat/completions").mock(side_effect=slow)
    t = make_transport()
    client = async_openai(t, max_retries=0, timeout=timeout)
    key = {"Idempotency-Key": "slow-1"}
    with pytest.raises(openai.APITimeoutError):
        await client.chat.completions.create(model=GPT, messages=MESSAGES, extra_headers=key)
    call = one(await settled(t))
    assert (call.stage, call.held, call.reserved) == ("completed", 0, 0)
    again = await client.chat.completions.with_raw_response.create(
        model=GPT, messages=MESSAGES, extra_headers=key
    )
    assert again.headers["effectguard-replayed"] == "true"
    assert again.parse().id == CHAT_BODY["id"]
    assert route.call_count == 1
    await finish(t)


@respx.mock(base_url=OPENAI)
async def test_the_sdks_retry_after_its_timeout_gets_the_answer_not_a_second_call(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """No key, the SDK's default retries, a 0.3 s timeout and a 1.2 s answer: the first
    try times out, and its retries join the call or, once it has settled, replay it. One
    provider call, one charge, and the SDK gets the answer. The retry that came after the
    call settled used to be new work, sent again: two effects for one SDK call."""

    async def slow(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(1.2)
        return httpx.Response(200, json=CHAT_BODY)

    route = respx_mock.post("/v1/chat/completions").mock(side_effect=slow)
    t = make_transport()
    counting = CountingTransport(t)
    client = async_openai(counting, timeout=0.3)
    reply = await client.chat.completions.create(model=GPT, messages=MESSAGES)
    assert reply.id == CHAT_BODY["id"]
    assert route.call_count == 1
    assert counting.retry_counts[0] == "0" and len(counting.retry_counts) >= 2
    call = one(await settled(t))
    assert (call.stage, call.attempts) == ("completed", 1)
    again = await async_openai(t).chat.completions.create(model=GPT, messages=MESSAGES)
    assert again.id == CHAT_BODY["id"] and route.call_count == 2  # new work is new work
    await finish(t)


@respx.mock(base_url=OPENAI)
async def test_a_stream_that_stalls_ends_the_callers_wait_not_the_call(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """The SDK's read timeout (0.3 s) bounds each wait for a stream's next chunk, as with
    a plain transport: the upstream stalls 1 s mid-stream, the SDK's iteration gets its
    timeout error, and the call is read to its end and settled, not left unknown. The
    caller used to wait for as long as effectguard's own upstream timeout (600 s)."""
    route = respx_mock.post("/v1/chat/completions").mock(
        side_effect=Upstream(CHAT_STREAM, sync=False, pause_at=3)
    )
    t = make_transport()
    client = async_openai(t, max_retries=0, timeout=httpx.Timeout(5, read=0.3))
    stream = await client.chat.completions.create(model=GPT, messages=MESSAGES, stream=True)
    received = []
    with pytest.raises((httpx.ReadTimeout, openai.APITimeoutError)):
        async for chunk in stream:
            received.append(chunk)
    assert 0 < len(received) < len(CHAT_STREAM) - 1
    await stream.close()
    call = one(await settled(t))
    assert (call.stage, call.cost) == ("completed", price_cost("openai", GPT, CHAT_STREAM_USAGE))
    assert (call.held, call.reserved, route.call_count) == (0, 0, 1)
    await finish(t)


def test_a_sync_stream_that_stalls_ends_the_callers_wait_not_the_call(ledger_path: str) -> None:
    """The same through GuardTransport: the sync SDK's iteration gets its timeout error
    and the call, read to its end in the background, is completed and priced."""
    t = GuardTransport(ledger=ledger_path, settings=FAST)
    try:
        with respx.mock(base_url=OPENAI) as mock:
            route = mock.post("/v1/chat/completions").mock(
                side_effect=Upstream(CHAT_STREAM, sync=True, pause_at=3)
            )
            client = sync_openai(t, max_retries=0, timeout=httpx.Timeout(5, read=0.3))
            stream = client.chat.completions.create(model=GPT, messages=MESSAGES, stream=True)
            with pytest.raises((httpx.ReadTimeout, openai.APITimeoutError)):
                list(stream)
            stream.close()
    finally:
        t.close()  # waits for the stalled read to end and the rest to be read and settled
    calls, _, report = snapshot(ledger_path)
    assert (one(calls).stage, one(calls).cost) == (
        "completed",
        price_cost("openai", GPT, CHAT_STREAM_USAGE),
    )
    assert route.call_count == 1 and report.ok, report.problems


@respx.mock(base_url=OPENAI)
async def test_a_reader_cancelled_mid_stream_leaves_its_call_to_settle(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """A task cancelled while it waits for a stream's next chunk (``asyncio.timeout``
    around the loop, a web framework cancelling the handler whose own client left) ends
    its wait, not the upstream read: the call is read to its end and settled at its exact
    cost, sent once. With the SDK's default timeout the cancellation used to land in the
    upstream read itself, and a stream the provider sent whole was booked effect_unknown,
    its reservation held."""
    upstream = Upstream(CHAT_STREAM, sync=False, pause_at=3)
    route = respx_mock.post("/v1/chat/completions").mock(side_effect=upstream)
    t = make_transport()
    client = async_openai(t, max_retries=0)
    three = asyncio.Event()

    async def read() -> None:
        stream = await client.chat.completions.create(model=GPT, messages=MESSAGES, stream=True)
        received = 0
        async for _ in stream:
            received += 1
            if received == 3:
                three.set()  # the next chunk stalls upstream

    reader = asyncio.ensure_future(read())
    await three.wait()
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    call = one(await settled(t))
    assert (call.stage, call.cost) == ("completed", price_cost("openai", GPT, CHAT_STREAM_USAGE))
    assert (call.held, call.reserved, route.call_count) == (0, 0, 1)
    assert upstream.read_to_end.is_set()
    await finish(t)


def test_a_sync_reader_interrupted_mid_stream_leaves_its_call_to_settle(
    ledger_path: str, default_sigint: None
) -> None:
    """The same through GuardTransport: Ctrl-C (KeyboardInterrupt) while the sync SDK waits
    for a chunk ends the caller's wait; once the stream is closed the rest is read and the
    call settled completed, never cut short."""
    t = GuardTransport(ledger=ledger_path, settings=FAST)
    main = threading.main_thread().ident
    assert main is not None and threading.current_thread() is threading.main_thread()
    try:
        with respx.mock(base_url=OPENAI) as mock:
            upstream = Upstream(CHAT_STREAM, sync=True, pause_at=3)
            route = mock.post("/v1/chat/completions").mock(side_effect=upstream)
            stream = sync_openai(t, max_retries=0).chat.completions.create(
                model=GPT, messages=MESSAGES, stream=True
            )
            received = 0
            with pytest.raises(KeyboardInterrupt):
                for _ in stream:
                    received += 1
                    if received == 3:  # the next chunk stalls upstream: interrupt the wait
                        threading.Timer(0.2, signal.pthread_kill, (main, signal.SIGINT)).start()
            stream.close()
            assert upstream.read_to_end.wait(10)
    finally:
        t.close()
    calls, _, report = snapshot(ledger_path)
    assert (one(calls).stage, one(calls).cost) == (
        "completed",
        price_cost("openai", GPT, CHAT_STREAM_USAGE),
    )
    assert route.call_count == 1 and report.ok, report.problems


def test_a_sync_client_timeout_ends_the_wait_not_the_call(ledger_path: str, tmp_path: Path) -> None:
    """The same through GuardTransport and real sockets: the fake provider answers after
    0.8 s; its receipt log shows one request, and the call is settled, not held."""
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        t = GuardTransport(ledger=ledger_path, settings=FAST, upstreams={"openai": fake.url})
        try:
            client = openai.OpenAI(
                api_key="sk-test",
                base_url=fake.url + "/v1",
                http_client=httpx.Client(transport=t),
                max_retries=0,
                timeout=0.3,
            )
            with pytest.raises(openai.APITimeoutError):
                client.chat.completions.create(
                    model=GPT, messages=MESSAGES, extra_headers={"x-fake-delay": "0.8"}
                )
            time.sleep(1.5)  # the answer arrives at 0.8 s and is settled
        finally:
            t.close()
        assert len(fake.effects()) == 1
    calls, nodes, report = snapshot(ledger_path)
    assert (one(calls).stage, one(calls).held) == ("completed", 0)
    assert nodes["default"].held == 0 and nodes["default"].spent == one(calls).cost
    assert report.ok, report.problems


def test_slow_upstreams_whose_callers_left_hold_up_no_other_call(
    ledger_path: str, tmp_path: Path
) -> None:
    """Eight calls to an upstream answering after 3 s, each caller timing out at 0.3 s,
    then a call to an instant one: it is answered at once. The sync transport's blocking
    upstream calls ran on asyncio's default pool (6 threads here), so the slow calls,
    still read to their end, held up every later call until they ended."""
    body = {"model": GPT, "messages": MESSAGES}
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        t = GuardTransport(ledger=ledger_path, settings=FAST, upstreams={"openai": fake.url})
        url = fake.url + "/v1/chat/completions"
        try:
            with httpx.Client(transport=t) as client:

                def slow(_: int) -> None:
                    with pytest.raises(httpx.ReadTimeout):
                        client.post(url, json=body, headers={"x-fake-delay": "3"}, timeout=0.3)

                with ThreadPoolExecutor(8) as pool:
                    list(pool.map(slow, range(8)))
                quick = client.post(url, json=body, timeout=2.0)
                assert quick.status_code == 200, quick.text
        finally:
            t.close()
        assert len(fake.effects()) == 9
    calls, _, report = snapshot(ledger_path)
    assert sorted(c.stage for c in calls) == ["completed"] * 9
    assert report.ok, report.problems


def test_anthropic_sync_sdk_does_not_retry_effect_unknown(ledger_path: str) -> None:
    """Sync Anthropic sees one 504 then one 409 for a timed-out keyed call; one upstream try."""
    t = GuardTransport(ledger=ledger_path, settings=FAST)
    counting = CountingSyncTransport(t)
    try:
        with respx.mock(base_url=ANTHROPIC) as mock:
            route = mock.post("/v1/messages").mock(side_effect=httpx.ReadTimeout("slow"))
            client = sync_anthropic(counting)
            key = {"Idempotency-Key": "op-2"}
            with pytest.raises(anthropic.APIStatusError) as first:
                client.messages.create(
                    model=CLAUDE, max_tokens=64, messages=MESSAGES, extra_headers=key
                )
            with pytest.raises(anthropic.ConflictError) as second:
                client.messages.create(
                    model=CLAUDE, max_tokens=64, messages=MESSAGES, extra_headers=key
                )
            assert route.call_count == 1
    finally:
        t.close()
    assert first.value.status_code == 504
    assert second.value.status_code == 409
    assert counting.retry_counts == ["0", "0"]
    calls, nodes, report = snapshot(ledger_path)
    assert one(calls).stage == "effect_unknown"
    assert nodes["default"].held == one(calls).reserved_at_admission
    assert report.ok, report.problems


# -- the sync transport from many threads ------------------------------------------------


def test_sync_transport_serves_eight_threads_at_once(ledger_path: str) -> None:
    """One GuardTransport streaming for 8 threads at once records and settles every call."""
    per_thread, threads = 4, 8
    t = GuardTransport(ledger=ledger_path, settings=FAST)
    barrier = threading.Barrier(threads)
    try:
        with respx.mock(base_url=OPENAI) as mock:
            route = mock.post("/v1/chat/completions").mock(
                side_effect=Upstream(CHAT_STREAM, sync=True)
            )
            client = sync_openai(t)

            def work(n: int) -> list[str]:
                barrier.wait(10)
                out = []
                for i in range(per_thread):
                    messages = [{"role": "user", "content": f"thread {n} call {i}"}]
                    stream = client.chat.completions.create(
                        model=GPT, messages=messages, stream=True
                    )
                    out.append(
                        "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
                    )
                return out

            with ThreadPoolExecutor(threads) as pool:
                results = [text for texts in pool.map(work, range(threads)) for text in texts]
            assert route.call_count == per_thread * threads
    finally:
        t.close()
    assert results == ["Hello!"] * (per_thread * threads)
    calls, nodes, report = snapshot(ledger_path)
    assert len(calls) == per_thread * threads
    assert {c.stage for c in calls} == {"completed"}
    each = price_cost("openai", GPT, CHAT_STREAM_USAGE)
    assert (nodes["default"].spent, nodes["default"].reserved) == (each * len(calls), 0)
    assert report.ok, report.problems


async def test_anthropic_sdk_takes_the_guard_through_the_httpx2_adapter(
    make_transport: MakeTransport,
) -> None:
    """anthropic 2.x refuses httpx clients; effectguard's httpx2 adapter lets it use the guard."""
    t = make_transport()
    with pytest.raises(TypeError, match="httpx2"):
        anthropic.AsyncAnthropic(
            api_key="k",
            base_url=ANTHROPIC,
            http_client=httpx.AsyncClient(transport=t),  # type: ignore[arg-type]
        )
    client = anthropic.AsyncAnthropic(
        api_key="k",
        base_url=ANTHROPIC,
        http_client=httpx2.AsyncClient(transport=AsyncHttpx2Transport(t)),
    )
    assert client.max_retries == 2
