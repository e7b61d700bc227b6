"""Anthropic's 1-hour cache writes, through the real anthropic SDK and the transport.

A prompt cached with ``cache_control: {"type": "ephemeral", "ttl": "1h"}`` is written at
2x the input price, not the 5-minute write's 1.25x. The answer says which writes were
which (``usage.cache_creation``); the ledger must price each at its own rate, from a JSON
answer and from a stream's ``message_start``.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import respx
from test_sdk_transport import (
    ANTHROPIC,
    CLAUDE,
    MESSAGE_BODY,
    MESSAGE_STREAM,
    PROVIDERS,
    Upstream,
    async_anthropic,
    one,
    settled,
)

from effectguard import AsyncGuardTransport
from effectguard.rules.money import TOKENS_PER_MILLION

MakeTransport = Callable[..., AsyncGuardTransport]
Finish = Callable[[AsyncGuardTransport], Awaitable[None]]

#: A long system prompt cached for an hour, and a short one for five minutes.
SYSTEM = [
    {"type": "text", "text": "policy " * 2000, "cache_control": {"type": "ephemeral", "ttl": "1h"}},
    {"type": "text", "text": "notes " * 600, "cache_control": {"type": "ephemeral"}},
]
#: Usage as the Messages API reports it: cache_creation splits the writes by lifetime.
USAGE: dict[str, Any] = {
    "input_tokens": 12,
    "cache_read_input_tokens": 0,
    "cache_creation_input_tokens": 6000,
    "cache_creation": {"ephemeral_5m_input_tokens": 1000, "ephemeral_1h_input_tokens": 5000},
    "output_tokens": 40,
    "service_tier": "standard",
}


def _expected() -> int:
    """12 input, 1,000 five-minute writes, 5,000 one-hour writes and 40 output, priced from
    the bundled declaration: 1 / 1.25 / 2 / 5 USD per million for claude-haiku-4-5."""
    price = PROVIDERS["anthropic"].price_for(CLAUDE)
    assert price is not None and price.cache_write is not None
    assert price.cache_write_1h == 2 * price.input
    total = 12 * price.input + 1000 * price.cache_write + 5000 * (2 * price.input)
    total += 40 * price.output
    return -(-total // TOKENS_PER_MILLION)


@respx.mock(base_url=ANTHROPIC)
async def test_one_hour_cache_writes_of_an_answer_are_priced_at_their_own_rate(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    respx_mock.post("/v1/messages").mock(
        return_value=httpx.Response(200, json={**MESSAGE_BODY, "usage": USAGE})
    )
    t = make_transport()
    message = await async_anthropic(t).messages.create(
        model=CLAUDE,
        max_tokens=256,
        system=SYSTEM,
        messages=[{"role": "user", "content": "Summarise"}],
    )
    assert message.usage.cache_creation is not None
    assert message.usage.cache_creation.ephemeral_1h_input_tokens == 5000
    call = one(await t.ledger.calls())
    assert (call.stage, call.cost) == ("completed", _expected())
    await finish(t)


def _with_start_usage(usage: dict[str, Any]) -> list[bytes]:
    """MESSAGE_STREAM with ``usage`` in its message_start and 40 output tokens at the end."""
    start = json.loads(MESSAGE_STREAM[0].split(b"data: ", 1)[1])
    start["message"]["usage"] = {**usage, "output_tokens": 1}
    delta = {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
        "usage": {"output_tokens": 40},
    }
    return [
        f"event: message_start\ndata: {json.dumps(start)}\n\n".encode(),
        *MESSAGE_STREAM[1:-2],
        f"event: message_delta\ndata: {json.dumps(delta)}\n\n".encode(),
        MESSAGE_STREAM[-1],
    ]


@respx.mock(base_url=ANTHROPIC)
async def test_one_hour_cache_writes_of_a_stream_are_read_from_its_message_start(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    respx_mock.post("/v1/messages").mock(side_effect=Upstream(_with_start_usage(USAGE), sync=False))
    t = make_transport()
    async with async_anthropic(t).messages.stream(
        model=CLAUDE,
        max_tokens=256,
        system=SYSTEM,
        messages=[{"role": "user", "content": "Summarise"}],
    ) as stream:
        final = await stream.get_final_message()
    assert final.usage.cache_creation is not None
    assert final.usage.cache_creation.ephemeral_1h_input_tokens == 5000
    call = one(await settled(t))
    assert (call.stage, call.cost) == ("completed", _expected())
    await finish(t)
