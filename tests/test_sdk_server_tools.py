"""Server tools a provider bills per use, through the real anthropic SDK and the transport.

Anthropic's web search tool bills each search (``usage.server_tool_use
.web_search_requests``) on top of the call's tokens, at 10 USD per thousand: five searches
cost far more than a short answer's tokens. The ledger must charge them, read from a JSON
answer and from a stream's ``message_delta``, and the reservation must hold the searches a
request allows (``max_uses``).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
import respx
from test_sdk_transport import (
    ANTHROPIC,
    CLAUDE,
    MESSAGES,
    PROVIDERS,
    Upstream,
    async_anthropic,
    one,
    price_cost,
    settled,
)

from effectguard import AsyncGuardTransport
from effectguard.ops.verify import verify_ledger
from effectguard.rules.money import usd_to_nanos
from effectguard.rules.usage import Usage

MakeTransport = Callable[..., AsyncGuardTransport]
Finish = Callable[[AsyncGuardTransport], Awaitable[None]]

#: Anthropic's server web search tool, as a request declares it.
WEB_SEARCH = {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}
#: What one search costs at the bundled declaration's price (10 USD per thousand).
SEARCH = usd_to_nanos("0.01")

#: A tool-use answer from the Messages API: the model searched, then answered.
SEARCHED_BODY: dict[str, Any] = {
    "id": "msg_ws",
    "type": "message",
    "role": "assistant",
    "model": CLAUDE,
    "content": [
        {
            "type": "server_tool_use",
            "id": "srvtoolu_01",
            "name": "web_search",
            "input": {"query": "effectguard"},
        },
        {
            "type": "web_search_tool_result",
            "tool_use_id": "srvtoolu_01",
            "content": [
                {
                    "type": "web_search_result",
                    "url": "https://example.com/",
                    "title": "Example",
                    "encrypted_content": "abc",
                    "page_age": None,
                }
            ],
        },
        {"type": "text", "text": "Found it.", "citations": None},
    ],
    "stop_reason": "end_turn",
    "stop_sequence": None,
    "usage": {
        "input_tokens": 2100,
        "output_tokens": 90,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "server_tool_use": {"web_search_requests": 5},
        "service_tier": "standard",
    },
}


def _event(name: str, **doc: Any) -> bytes:
    return f"event: {name}\ndata: {json.dumps({'type': name, **doc})}\n\n".encode()


#: The same call streamed: message_delta carries the cumulative server tool use.
SEARCHED_STREAM = [
    _event(
        "message_start",
        message={
            **SEARCHED_BODY,
            "content": [],
            "stop_reason": None,
            "usage": {"input_tokens": 2100, "output_tokens": 1},
        },
    ),
    _event("content_block_start", index=0, content_block={"type": "text", "text": ""}),
    _event("content_block_delta", index=0, delta={"type": "text_delta", "text": "Found it."}),
    _event("content_block_stop", index=0),
    _event(
        "message_delta",
        delta={"stop_reason": "end_turn", "stop_sequence": None},
        usage={"output_tokens": 90, "server_tool_use": {"web_search_requests": 3}},
    ),
    _event("message_stop"),
]


def _tokens_only(input_tokens: int, output_tokens: int) -> int:
    return price_cost("anthropic", CLAUDE, Usage(input_tokens, output_tokens))


def test_the_bundled_anthropic_models_price_web_searches() -> None:
    """Every bundled Claude model declares the per-search price, so none charges zero."""
    for name, price in PROVIDERS["anthropic"].models.items():
        assert price.web_search == SEARCH, name


@respx.mock(base_url=ANTHROPIC)
async def test_web_searches_of_an_answer_are_charged_on_top_of_its_tokens(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """Five searches are five cents: the call is charged them, not only its tokens."""
    respx_mock.post("/v1/messages").mock(return_value=httpx.Response(200, json=SEARCHED_BODY))
    t = make_transport()
    message = await async_anthropic(t).messages.create(
        model=CLAUDE, max_tokens=1024, messages=MESSAGES, tools=[WEB_SEARCH]
    )
    assert message.usage.server_tool_use is not None
    assert message.usage.server_tool_use.web_search_requests == 5
    call = one(await t.ledger.calls())
    assert (call.stage, call.cost) == ("completed", _tokens_only(2100, 90) + 5 * SEARCH)
    await finish(t)


@respx.mock(base_url=ANTHROPIC)
async def test_web_searches_of_a_stream_are_read_from_its_message_delta(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """A stream reports its searches in message_delta's usage; the SDK gets it unchanged."""
    respx_mock.post("/v1/messages").mock(side_effect=Upstream(SEARCHED_STREAM, sync=False))
    t = make_transport()
    client = async_anthropic(t)
    async with client.messages.stream(
        model=CLAUDE, max_tokens=1024, messages=MESSAGES, tools=[WEB_SEARCH]
    ) as stream:
        final = await stream.get_final_message()
    assert final.usage.server_tool_use is not None
    assert final.usage.server_tool_use.web_search_requests == 3
    call = one(await settled(t))
    assert (call.stage, call.cost) == ("completed", _tokens_only(2100, 90) + 3 * SEARCH)
    await finish(t)


@pytest.mark.parametrize(("max_uses", "searches"), [(5, 5), (None, 0)])
@respx.mock(base_url=ANTHROPIC)
async def test_the_reservation_holds_the_searches_a_request_allows(
    respx_mock: respx.MockRouter,
    make_transport: MakeTransport,
    ledger_path: str,
    max_uses: int | None,
    searches: int,
) -> None:
    """``max_uses`` bounds the searches, so the reservation holds them; without it there is
    no stated bound, and the settlement alone charges what ran (an overshoot)."""
    respx_mock.post("/v1/messages").mock(return_value=httpx.Response(200, json=SEARCHED_BODY))
    tool = {k: v for k, v in WEB_SEARCH.items() if k != "max_uses" or max_uses is not None}
    t = make_transport()
    plain = make_transport(ledger=ledger_path + ".plain")
    await async_anthropic(t).messages.create(
        model=CLAUDE, max_tokens=1024, messages=MESSAGES, tools=[tool]
    )
    # The same request with a function tool of the same JSON size reserves the tokens only.
    function = {**tool, "type": "x" * len(str(tool["type"]))}
    await async_anthropic(plain).messages.create(
        model=CLAUDE, max_tokens=1024, messages=MESSAGES, tools=[function]
    )
    searched, unsearched = one(await t.ledger.calls()), one(await plain.ledger.calls())
    assert searched.reserved_at_admission - unsearched.reserved_at_admission == searches * SEARCH
    assert (await verify_ledger(t.ledger)).ok
