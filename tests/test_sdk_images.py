"""Images priced per image, through the real openai SDK.

dall-e-2 bills each image it makes, and one request may ask for several (``n``, up to
10): the reservation must hold every image asked for, and the call settle at the images
its answer lists. Before this, a request for four images reserved and was charged one,
so a budget let four times its room out. An image edit is a multipart upload, whose
``n`` is text, not a JSON integer: it counts as well.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

import httpx
import openai
import pytest
import respx
from test_sdk_transport import OPENAI, PROVIDERS, async_openai, one

from effectguard import AsyncGuardTransport, Ledger
from effectguard.rules.money import usd_to_nanos

MakeTransport = Callable[..., AsyncGuardTransport]
Finish = Callable[[AsyncGuardTransport], Awaitable[None]]

PNG = ("cat.png", b"\x89PNG\r\n\x1a\n" + bytes(64), "image/png")
#: dall-e-2's bundled price, per image.
IMAGE = usd_to_nanos("0.020")


def _images(count: int) -> httpx.Response:
    return httpx.Response(200, json={"created": 1, "data": [{"url": "https://x"}] * count})


def test_dall_e_2_declares_its_price_per_image() -> None:
    price = PROVIDERS["openai"].price_for("dall-e-2")
    assert price is not None and price.per_call == IMAGE


@pytest.mark.parametrize(("asked", "made"), [(4, 4), (1, 1), (3, 2)])
@respx.mock(base_url=OPENAI)
async def test_a_generation_reserves_each_image_asked_and_settles_at_those_made(
    respx_mock: respx.MockRouter,
    make_transport: MakeTransport,
    finish: Finish,
    asked: int,
    made: int,
) -> None:
    respx_mock.post("/v1/images/generations").mock(return_value=_images(made))
    t = make_transport()
    await async_openai(t).images.generate(model="dall-e-2", prompt="a cat", n=asked)
    call = one(await t.ledger.calls())
    assert (call.stage, call.reserved_at_admission, call.cost) == (
        "completed",
        asked * IMAGE,
        made * IMAGE,
    )
    await finish(t)


@respx.mock(base_url=OPENAI)
async def test_an_edit_uploaded_as_multipart_counts_its_text_n(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    route = respx_mock.post("/v1/images/edits").mock(return_value=_images(3))
    t = make_transport()
    await async_openai(t).images.edit(model="dall-e-2", image=PNG, prompt="a hat", n=3)
    assert b'name="n"' in route.calls.last.request.content  # the SDK sent n as a form part
    call = one(await t.ledger.calls())
    assert (call.reserved_at_admission, call.cost) == (3 * IMAGE, 3 * IMAGE)
    await finish(t)


@respx.mock(base_url=OPENAI)
async def test_a_token_priced_edit_reserves_its_output_bound_once_per_image(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    usage = {"input_tokens": 10, "output_tokens": 20}
    answer = {"created": 1, "data": [{"b64_json": "AA=="}] * 2, "usage": usage}
    respx_mock.post("/v1/images/edits").mock(return_value=httpx.Response(200, json=answer))
    price = PROVIDERS["openai"].price_for("gpt-image-1")
    assert price is not None
    t = make_transport()
    await async_openai(t).images.edit(model="gpt-image-1", image=PNG, prompt="a hat", n=2)
    call = one(await t.ledger.calls())
    # The prompt of a multipart edit is not read (a part): the output bound, twice.
    assert call.reserved_at_admission == -(-2 * price.max_output_tokens * price.output // 10**6)
    assert call.cost == -(-(10 * price.input + 20 * price.output) // 10**6)
    await finish(t)


@pytest.mark.parametrize("n", ["three", "0", "-2", "1e3", "999"])
@respx.mock(base_url=OPENAI, assert_all_called=False)
async def test_a_form_n_that_is_no_count_in_bounds_is_refused_by_name(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish, n: str
) -> None:
    route = respx_mock.post("/v1/images/edits").mock(return_value=_images(1))
    t = make_transport()
    client = httpx.AsyncClient(transport=t)  # not closed here: that would close the ledger
    answer = await client.post(
        f"{OPENAI}/v1/images/edits",
        data={"model": "dall-e-2", "prompt": "a hat", "n": n},
        files={"image": PNG},
    )
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "n"
    assert not route.called and await t.ledger.calls() == []
    await finish(t)


@respx.mock(base_url=OPENAI)
async def test_an_answer_listing_more_images_than_any_request_may_ask_is_not_believed(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    respx_mock.post("/v1/images/generations").mock(return_value=_images(129))
    t = make_transport()
    await async_openai(t).images.generate(model="dall-e-2", prompt="a cat", n=2)
    call = one(await t.ledger.calls())
    assert (call.cost, call.flagged) == (2 * IMAGE, "usage absurd: settled at reservation")
    await finish(t)


@respx.mock(base_url=OPENAI, assert_all_called=False)
async def test_a_budget_refuses_a_request_for_more_images_than_its_room(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish, ledger_path: str
) -> None:
    route = respx_mock.post("/v1/images/generations").mock(return_value=_images(4))
    async with Ledger.open(ledger_path) as book:
        await book.set_limit("default", 3 * IMAGE)
    t = make_transport()
    with pytest.raises(openai.APIStatusError) as refused:
        await async_openai(t, max_retries=0).images.generate(model="dall-e-2", prompt="a cat", n=4)
    assert refused.value.status_code == 402 and not route.called
    assert json.loads(refused.value.response.content)["error"]["type"] == "budget_exceeded"
    await finish(t)
