"""The usage event effectguard asked for, misshapen, through the openai SDK and both
transports (respx the upstream): the client that did not ask for usage is not shown it.

OpenAI-compatible servers send the usage event ``stream_options.include_usage`` asks for
in other shapes than OpenAI's: without a ``choices`` key at all, or, cut short or garbled,
as data that is not JSON. Shown, it made the SDK's loop (``chunk.choices[0]`` of every
chunk) raise at the end of a call that was answered and paid for. The same through the
proxy is in test_odd_answers.py; the filter's own properties in test_added_usage.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import httpx
import openai
import pytest
import respx

from effectguard import AsyncGuardTransport, GuardSettings, GuardTransport, Ledger
from effectguard.ops.verify import verify_ledger
from effectguard.providers import load_providers
from effectguard.rules.usage import Usage, cost
from effectguard.rules.workstate import WorkState

OPENAI = "https://api.openai.com"
GPT = "gpt-4o-mini"
FAST = GuardSettings(retry_wait_s=0, retry_wait_max_s=0)
USAGE = {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}


def _chunk(**fields: object) -> bytes:
    doc = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": GPT, **fields}
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


CONTENT = [
    _chunk(choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}}]),
    _chunk(choices=[{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]),
    _chunk(choices=[{"index": 0, "delta": {"content": "lo!"}, "finish_reason": "stop"}]),
]
#: Each misshapen usage event, and whether its usage can be read (else: the reservation).
SHAPES = {
    "no-choices": (_chunk(usage=USAGE), True),
    "not-json": (_chunk(choices=[], usage=USAGE)[:-30] + b"\n\n", False),
}
DONE = b"data: [DONE]\n\n"


def _stream(shape: str) -> list[bytes]:
    return [*CONTENT, SHAPES[shape][0], DONE]


def _answer(chunks: list[bytes], sync: bool) -> httpx.Response:
    """The upstream's answer: ``chunks``, one a read."""

    def each() -> Iterator[bytes]:
        yield from chunks

    async def each_async() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk

    content = each() if sync else each_async()
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=content)


def _expected(call: WorkState, read: bool) -> None:
    """The call completed at the exact cost of its usage if ``read``, else at its
    reservation, flagged."""
    price = load_providers([])["openai"].price_for(GPT)
    assert price is not None
    assert call.stage == "completed", call
    if read:
        assert (call.cost, call.flagged) == (cost(price, Usage(12, 3)), None), call
    else:
        assert call.cost == call.reserved_at_admission, call
        assert call.flagged is not None and "usage missing" in call.flagged, call


@pytest.mark.parametrize("shape", sorted(SHAPES))
async def test_the_async_transport_keeps_a_misshapen_usage_event_from_the_sdk(
    shape: str,
    make_transport: Callable[..., AsyncGuardTransport],
    finish: Callable[[AsyncGuardTransport], Awaitable[None]],
) -> None:
    """AsyncOpenAI's loop runs to the end; the provider was asked once, for the usage."""
    with respx.mock(base_url=OPENAI) as mock:
        route = mock.post("/v1/chat/completions").mock(
            side_effect=lambda _: _answer(_stream(shape), sync=False)
        )
        t = make_transport()
        client = openai.AsyncOpenAI(
            api_key="sk-test", base_url=OPENAI + "/v1", http_client=httpx.AsyncClient(transport=t)
        )
        stream = await client.chat.completions.create(
            model=GPT, messages=[{"role": "user", "content": "hi"}], stream=True
        )
        text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
    assert text == "Hello!"
    assert route.call_count == 1
    assert json.loads(route.calls.last.request.content)["stream_options"] == {"include_usage": True}
    calls = await t.ledger.calls()
    assert len(calls) == 1
    _expected(calls[0], SHAPES[shape][1])
    await finish(t)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_sync_transport_keeps_a_misshapen_usage_event_from_the_sdk(
    shape: str, ledger_path: str
) -> None:
    """OpenAI's loop runs to the end through GuardTransport, and again on a keyed replay."""
    t = GuardTransport(ledger=ledger_path, settings=FAST)
    try:
        with respx.mock(base_url=OPENAI) as mock:
            route = mock.post("/v1/chat/completions").mock(
                side_effect=lambda _: _answer(_stream(shape), sync=True)
            )
            client = openai.OpenAI(
                api_key="sk-test", base_url=OPENAI + "/v1", http_client=httpx.Client(transport=t)
            )
            texts = []
            for _ in range(2):  # the answer, then its replay from the ledger
                stream = client.chat.completions.create(
                    model=GPT,
                    messages=[{"role": "user", "content": "hi"}],
                    stream=True,
                    extra_headers={"idempotency-key": f"k-{shape}"},
                )
                texts.append("".join(chunk.choices[0].delta.content or "" for chunk in stream))
    finally:
        t.close()
    assert texts == ["Hello!", "Hello!"]
    assert route.call_count == 1

    async def read() -> tuple[list[WorkState], bool]:
        async with Ledger.open(ledger_path) as ledger:
            return await ledger.calls(), (await verify_ledger(ledger)).ok

    calls, verified = asyncio.run(read())
    assert len(calls) == 1 and verified
    _expected(calls[0], SHAPES[shape][1])
