"""The Responses API's built-in web search, charged per search, through the openai SDK.

OpenAI bills each call of the Responses API's web search tool (an output item of type
``web_search_call``) on top of the tokens, and the answer's ``usage`` does not count
them. Before, a call that searched three times was charged its tokens alone: a cent or
more per search went unrecorded, and a budget never saw it. The searches are read from a
JSON answer's ``output`` and from a stream's ``response.completed``.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
import respx
from test_sdk_transport import OPENAI, PROVIDERS, async_openai, one, price_cost, settled

from effectguard import AsyncGuardTransport
from effectguard.rules.money import usd_to_nanos
from effectguard.rules.usage import Usage

MakeTransport = Callable[..., AsyncGuardTransport]
Finish = Callable[[AsyncGuardTransport], Awaitable[None]]

MODEL = "gpt-4o"
#: One search at the bundled gpt-4o price (10 USD per thousand).
SEARCH = usd_to_nanos("0.01")
USAGE = {"input_tokens": 300, "output_tokens": 40, "total_tokens": 340}


def _response(searches: int) -> dict[str, Any]:
    output: list[dict[str, Any]] = [
        {"type": "web_search_call", "id": f"ws_{i}", "status": "completed"} for i in range(searches)
    ]
    text = {"type": "output_text", "text": "Found it.", "annotations": []}
    output.append(
        {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
         "content": [text]}
    )  # fmt: skip
    return {
        "id": "resp_1",
        "object": "response",
        "created_at": 1,
        "model": MODEL,
        "status": "completed",
        "output": output,
        "usage": USAGE,
    }


def _tokens() -> int:
    return price_cost("openai", MODEL, Usage(300, 40))


def _sse(*events: dict[str, Any]) -> bytes:
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)


def test_the_bundled_openai_models_that_search_price_their_searches() -> None:
    for model in ("gpt-4o", "gpt-4o-mini", "gpt-4.1", "gpt-4.1-mini", "o3", "o4-mini"):
        price = PROVIDERS["openai"].price_for(model)
        assert price is not None and price.web_search, model


@pytest.mark.parametrize("searches", [0, 3])
@respx.mock(base_url=OPENAI)
async def test_searches_of_a_responses_answer_are_charged_on_top_of_its_tokens(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish, searches: int
) -> None:
    respx_mock.post("/v1/responses").mock(
        return_value=httpx.Response(200, json=_response(searches))
    )
    t = make_transport()
    answer = await async_openai(t).responses.create(
        model=MODEL, input="what is effectguard?", tools=[{"type": "web_search_preview"}]
    )
    assert answer.output_text == "Found it."
    call = one(await t.ledger.calls())
    assert (call.stage, call.cost) == ("completed", _tokens() + searches * SEARCH)
    await finish(t)


@respx.mock(base_url=OPENAI)
async def test_searches_of_a_responses_stream_are_read_from_its_completed_event(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    done = _response(2)
    body = _sse(
        {"type": "response.created", "sequence_number": 0, "response": {**done, "output": []}},
        {"type": "response.output_text.delta", "sequence_number": 1, "item_id": "msg_1",
         "output_index": 2, "content_index": 0, "delta": "Found it."},
        {"type": "response.completed", "sequence_number": 2, "response": done},
    )  # fmt: skip
    respx_mock.post("/v1/responses").mock(
        return_value=httpx.Response(
            200, content=body, headers={"content-type": "text/event-stream"}
        )
    )
    t = make_transport()
    stream = await async_openai(t).responses.create(
        model=MODEL, input="what is effectguard?", tools=[{"type": "web_search"}], stream=True
    )
    kinds = [event.type async for event in stream]
    assert kinds[-1] == "response.completed"
    call = one(await settled(t))
    assert (call.stage, call.cost) == ("completed", _tokens() + 2 * SEARCH)
    await finish(t)
