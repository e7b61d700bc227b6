"""The fake provider, run as a real process and spoken to with httpx and the official SDKs."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from effectguard.testing import FakeProvider, fake_provider

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeProvider]:
    """One process for the tests that look only at answers, not at receipt counts."""
    with fake_provider(tmp_path_factory.mktemp("shared") / "receipts.jsonl") as running:
        yield running


@pytest.fixture
def provider(tmp_path: Path) -> Iterator[FakeProvider]:
    """A fresh process and receipt log, for tests that count effects."""
    with fake_provider(tmp_path / "receipts.jsonl") as running:
        yield running


@pytest.fixture
def idempotent(tmp_path: Path) -> Iterator[FakeProvider]:
    with fake_provider(tmp_path / "receipts.jsonl", idempotent=True) as running:
        yield running


def oai(provider: FakeProvider, **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=provider.url + "/v1", api_key="x", **kwargs)


def ant(provider: FakeProvider, **kwargs: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=provider.url, api_key="x", **kwargs)


def post(provider: FakeProvider, path: str, body: Any, **headers: str) -> httpx.Response:
    return httpx.post(provider.url + path, json=body, headers=headers)


def sse_data(text: str) -> list[Any]:
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


USER: Any = [{"role": "user", "content": "hello"}]


# -- shapes the SDKs parse ---------------------------------------------------


def test_openai_chat_parses_and_echoes_model(shared: FakeProvider) -> None:
    """The openai SDK parses a chat completion that echoes the model and reports usage."""
    completion = oai(shared).chat.completions.create(model="gpt-x", messages=USER, max_tokens=3)
    assert completion.model == "gpt-x"
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].message.content == "ok ok ok "
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None and completion.usage.completion_tokens == 3
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 3


def test_usage_is_a_function_of_the_request_bytes(shared: FakeProvider) -> None:
    """Input tokens are len(body) // 4; output tokens are max_tokens capped at 16."""
    body = {"model": "m", "messages": USER * 20, "max_tokens": 100}
    raw = json.dumps(body).encode()
    response = httpx.post(shared.url + CHAT, content=raw)
    usage = response.json()["usage"]
    assert usage == {
        "prompt_tokens": len(raw) // 4,
        "completion_tokens": 16,
        "total_tokens": len(raw) // 4 + 16,
    }


def test_openai_chat_stream_ends_with_usage_chunk(shared: FakeProvider) -> None:
    """With include_usage, every chunk has usage None except a final choices-less usage chunk."""
    stream = oai(shared).chat.completions.create(
        model="gpt-x",
        messages=USER,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert len(chunks) == 7  # role, 4 words, finish, usage
    assert all(chunk.usage is None for chunk in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == "ok " * 4
    assert chunks[-2].choices[0].finish_reason == "stop"


def test_openai_chat_stream_without_include_usage_has_no_usage(shared: FakeProvider) -> None:
    """Without stream_options.include_usage the stream carries no usage key and ends in [DONE]."""
    response = post(shared, CHAT, {"model": "m", "messages": USER, "stream": True})
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text.endswith("data: [DONE]\n\n")
    assert all("usage" not in chunk for chunk in sse_data(response.text))


def test_openai_completions_and_embeddings(shared: FakeProvider) -> None:
    """Legacy completions and embeddings (base64 by the SDK's default, and floats) parse."""
    client = oai(shared)
    completion = client.completions.create(model="davinci", prompt="hi", max_tokens=2)
    assert completion.choices[0].text == "ok ok " and completion.usage is not None
    embedded = client.embeddings.create(model="emb", input=["a", "b"])
    assert [item.index for item in embedded.data] == [0, 1]
    assert embedded.data[0].embedding == pytest.approx([0.1 * i for i in range(1, 9)])
    floats = client.embeddings.create(model="emb", input="a", encoding_format="float")
    assert floats.data[0].embedding == pytest.approx([0.1 * i for i in range(1, 9)])
    assert floats.usage.prompt_tokens >= 1
    streamed = list(
        client.completions.create(
            model="davinci",
            prompt="hi",
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in streamed[:-1]) == "ok ok "
    assert streamed[-1].usage is not None and streamed[-1].usage.completion_tokens == 2


def test_openai_responses_plain_and_streamed(shared: FakeProvider) -> None:
    """The Responses API parses, and its stream goes created → deltas → completed with usage."""
    client = oai(shared)
    response = client.responses.create(model="gpt-r", input="hi", max_output_tokens=3)
    assert response.output_text == "ok ok ok "
    assert response.usage is not None and response.usage.output_tokens == 3
    events = list(client.responses.create(model="gpt-r", input="hi", stream=True))
    assert events[0].type == "response.created"
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) == 16
    assert events[-1].type == "response.completed"
    assert events[-1].response.usage is not None
    assert events[-1].response.usage.output_tokens == 16
    with client.responses.stream(model="gpt-r", input="hi", max_output_tokens=2) as stream:
        assert stream.get_final_response().output_text == "ok ok "


def test_anthropic_message_parses(shared: FakeProvider) -> None:
    """The anthropic SDK parses a message with end_turn and cache fields in usage."""
    message = ant(shared).messages.create(model="claude-x", max_tokens=5, messages=USER)
    assert message.id.startswith("msg_") and message.model == "claude-x"
    assert message.content[0].type == "text" and message.content[0].text == "ok " * 5
    assert message.stop_reason == "end_turn"
    assert message.usage.output_tokens == 5
    assert message.usage.cache_read_input_tokens == 0


def test_anthropic_stream_accumulates(shared: FakeProvider) -> None:
    """The anthropic stream helper sees message_start … message_stop and the final usage."""
    with ant(shared).messages.stream(model="c", max_tokens=3, messages=USER) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.content[0].type == "text" and final.content[0].text == "ok ok ok "
    assert final.usage.output_tokens == 3 and final.usage.input_tokens >= 1


def test_models_list_for_both_sdks(provider: FakeProvider) -> None:
    """GET /v1/models parses for both SDKs and writes no receipt."""
    assert [model.id for model in oai(provider).models.list()] == ["fake-model"]
    assert [model.id for model in ant(provider).models.list()] == ["fake-model"]
    assert provider.receipts() == []


def test_send_tool(provider: FakeProvider) -> None:
    """POST /v1/send answers a flat 'sent' object and counts as an effect."""
    response = post(provider, "/v1/send", {"to": "a@b.c"})
    assert response.json()["status"] == "sent" and response.json()["id"]
    assert len(provider.effects()) == 1


def test_usage_missing_header(shared: FakeProvider) -> None:
    """x-fake-usage: missing drops usage from bodies and from streams."""
    headers = {"x-fake-usage": "missing"}
    body = post(shared, CHAT, {"model": "m", "messages": USER}, **headers).json()
    assert "usage" not in body
    stream = {"model": "m", "max_tokens": 2, "stream": True}
    events = sse_data(post(shared, "/v1/messages", stream, **headers).text)
    assert all("usage" not in event and "usage" not in event.get("message", {}) for event in events)


# -- the receipt log ---------------------------------------------------------


def test_one_receipt_per_post(provider: FakeProvider) -> None:
    """Each POST appends one numbered line with path, key, body hash and model; GETs none."""
    raw = json.dumps({"model": "gpt-x", "messages": USER}).encode()
    httpx.post(provider.url + CHAT, content=raw, headers={"Idempotency-Key": "k1"})
    post(provider, "/v1/messages", {"model": "claude", "max_tokens": 1})
    httpx.get(provider.url + "/ops/k1")
    receipts = provider.receipts()
    assert [r["seq"] for r in receipts] == [1, 2]
    first = receipts[0]
    assert first["method"] == "POST" and first["path"] == CHAT
    assert first["idempotency_key"] == "k1" and first["model"] == "gpt-x"
    assert first["body_sha256"] == hashlib.sha256(raw).hexdigest()
    assert first["deduped"] is False and first["status"] == 200
    assert receipts[1]["idempotency_key"] is None and receipts[1]["path"] == "/v1/messages"


def test_receipt_is_durable_before_the_answer(provider: FakeProvider) -> None:
    """The receipt line is on disk while the answer is still being held back by a delay."""
    answered = threading.Event()

    def call() -> None:
        post(provider, "/v1/send", {}, **{"x-fake-delay": "0.5"})
        answered.set()

    thread = threading.Thread(target=call)
    thread.start()
    deadline = time.monotonic() + 2
    while not provider.receipts() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(provider.receipts()) == 1 and not answered.is_set()
    thread.join()


async def test_concurrent_requests_get_one_line_each(provider: FakeProvider) -> None:
    """Concurrent POSTs each get one whole, uniquely numbered receipt line."""
    async with httpx.AsyncClient(base_url=provider.url) as client:
        calls = [client.post("/v1/send", json={"n": n}) for n in range(40)]
        answers = await asyncio.gather(*calls)
    assert all(answer.status_code == 200 for answer in answers)
    assert sorted(r["seq"] for r in provider.receipts()) == list(range(1, 41))


def test_sdk_retries_are_separate_effects(provider: FakeProvider) -> None:
    """The openai SDK's retry of a 500 reaches the provider as a second receipt."""
    client = oai(provider, max_retries=1)
    with pytest.raises(openai.InternalServerError):
        client.with_options(timeout=5).chat.completions.create(
            model="m", messages=USER, extra_headers={"x-fake-status": "500"}
        )
    receipts = provider.receipts()
    assert len(receipts) == 2 and all(r["status"] == 500 for r in receipts)


def test_seq_continues_an_existing_log(tmp_path: Path) -> None:
    """A restarted provider keeps numbering after the lines already in its receipt file."""
    path = tmp_path / "receipts.jsonl"
    for _ in range(2):
        with fake_provider(path) as running:
            post(running, "/v1/send", {})
    assert [r["seq"] for r in json.loads(f"[{','.join(path.read_text().split())}]")] == [1, 2]


# -- idempotency and the lookup read path ------------------------------------


def test_idempotent_replays_first_answer(idempotent: FakeProvider) -> None:
    """With --idempotent a repeated key and body replays the first answer, marked deduped."""
    body = {"model": "m", "messages": USER, "stream": True}
    first = post(idempotent, CHAT, body, **{"Idempotency-Key": "k"})
    again = post(idempotent, CHAT, body, **{"Idempotency-Key": "k"})
    assert again.content == first.content
    assert [r["deduped"] for r in idempotent.receipts()] == [False, True]
    assert len(idempotent.effects()) == 1


@pytest.mark.parametrize("status", [409, 429])
def test_idempotent_does_not_save_a_429_or_409(idempotent: FakeProvider, status: int) -> None:
    """A 429 or 409 is not saved under its key (Stripe saves neither): the repeat is worked
    on. It was replayed from the store, so a retry after a rate limit never went through."""
    once = {"x-fake-behaviour": f"status={status};id=s;times=1", "Idempotency-Key": "k"}
    assert post(idempotent, "/v1/send", {"to": "a"}, **once).status_code == status
    assert post(idempotent, "/v1/send", {"to": "a"}, **once).status_code == 200
    again = post(idempotent, "/v1/send", {"to": "a"}, **{"Idempotency-Key": "k"})
    assert again.status_code == 200
    receipts = idempotent.receipts()
    assert [(r["status"], r["deduped"]) for r in receipts] == [
        (status, False),
        (200, False),
        (200, True),
    ]


def test_idempotent_key_reuse_with_other_body_is_422(idempotent: FakeProvider) -> None:
    """With --idempotent the same key with a different body is refused with 422."""
    post(idempotent, "/v1/send", {"to": "a"}, **{"Idempotency-Key": "k"})
    response = post(idempotent, "/v1/send", {"to": "b"}, **{"Idempotency-Key": "k"})
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "idempotency_key_reused"
    assert [r["status"] for r in idempotent.receipts()] == [200, 422]


def test_without_idempotent_repeats_are_new_effects(provider: FakeProvider) -> None:
    """Without --idempotent a repeated key is a new effect with a new answer."""
    first = post(provider, "/v1/send", {}, **{"Idempotency-Key": "k"}).json()
    again = post(provider, "/v1/send", {}, **{"Idempotency-Key": "k"}).json()
    assert first["id"] != again["id"]
    assert len(provider.effects()) == 2


def test_ops_lookup(shared: FakeProvider) -> None:
    """GET /ops/{key} says applied only once a request with that key was received."""
    assert httpx.get(shared.url + "/ops/k9").json() == {"key": "k9", "applied": False}
    post(shared, "/v1/send", {}, **{"Idempotency-Key": "k9"})
    assert httpx.get(shared.url + "/ops/k9").json() == {"key": "k9", "applied": True}


# -- switches ----------------------------------------------------------------


def test_break_after_drops_the_stream(provider: FakeProvider) -> None:
    """x-fake-break-after: K sends K events then drops the connection without the end."""
    body = {"model": "c", "max_tokens": 8, "stream": True}
    seen = b""
    with (
        pytest.raises(httpx.RemoteProtocolError),
        httpx.stream(
            "POST", provider.url + "/v1/messages", json=body, headers={"x-fake-break-after": "3"}
        ) as response,
    ):
        for chunk in response.iter_bytes():
            seen += chunk
    assert seen.count(b"event: ") == 3 and b"message_stop" not in seen
    assert len(provider.effects()) == 1


def test_cut_clean_ends_a_close_delimited_stream_without_its_terminal_event(
    shared: FakeProvider,
) -> None:
    """close=K sends K events with no length or chunking, then a clean close."""
    body = {"model": "c", "max_tokens": 8, "stream": True}
    with httpx.stream(
        "POST", shared.url + "/v1/messages", json=body, headers={"x-fake-behaviour": "close=3"}
    ) as response:
        seen = response.read()  # no error: to HTTP the body simply ended
    assert "content-length" not in response.headers
    assert "transfer-encoding" not in response.headers
    assert seen.count(b"event: ") == 3 and b"message_stop" not in seen


def test_cut_stream_clean_flag_leaves_plain_bodies_whole(tmp_path: Path) -> None:
    """--cut-stream-clean cuts streams only: a non-stream answer is sent in full."""
    with fake_provider(tmp_path / "r.jsonl", cut_stream_clean=1) as running:
        answer = post(running, CHAT, {"model": "m", "messages": USER})
        assert answer.json()["usage"]["completion_tokens"] > 0
        with httpx.stream(
            "POST", running.url + CHAT, json={"model": "m", "messages": USER, "stream": True}
        ) as response:
            seen = response.read()
        assert seen.count(b"data: ") == 1 and b"[DONE]" not in seen


def test_break_after_zero_truncates_a_plain_body(shared: FakeProvider) -> None:
    """x-fake-break-after: 0 on a non-stream answer sends headers, then drops the body."""
    with pytest.raises(httpx.RemoteProtocolError):
        post(shared, "/v1/send", {}, **{"x-fake-break-after": "0"})


def test_break_after_flag_breaks_sdk_stream(tmp_path: Path) -> None:
    """--break-after makes the openai SDK's stream fail instead of ending cleanly."""
    with fake_provider(tmp_path / "r.jsonl", break_after=2) as running:
        stream = oai(running, max_retries=0).chat.completions.create(
            model="m", messages=USER, stream=True
        )
        with pytest.raises(openai.APIConnectionError):
            list(stream)


def test_error_status_header_shapes(provider: FakeProvider) -> None:
    """x-fake-status answers OpenAI- or Anthropic-shaped errors and still logs receipts."""
    with pytest.raises(openai.RateLimitError):
        oai(provider, max_retries=0).chat.completions.create(
            model="m", messages=USER, extra_headers={"x-fake-status": "429"}
        )
    with pytest.raises(anthropic.RateLimitError) as caught:
        ant(provider, max_retries=0).messages.create(
            model="c", max_tokens=1, messages=USER, extra_headers={"x-fake-status": "429"}
        )
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "fake provider answered 429"},
    }
    assert [r["status"] for r in provider.receipts()] == [429, 429]


def test_error_status_and_delay_flags(tmp_path: Path) -> None:
    """--error-status and --delay are defaults that a request header can override."""
    # A delay far above any loaded machine's answer time: the override is told apart
    # from the default by a margin of seconds, not a tenth.
    with fake_provider(tmp_path / "r.jsonl", error_status=503, delay=2.0) as running:
        started = time.monotonic()
        assert post(running, "/v1/send", {}).status_code == 503
        assert time.monotonic() - started >= 2.0
        started = time.monotonic()
        answer = post(running, "/v1/send", {}, **{"x-fake-status": "200", "x-fake-delay": "0"})
        assert answer.status_code == 200 and time.monotonic() - started < 2.0


# -- per-request behaviour (x-fake-behaviour) --------------------------------


def _read_stream(provider: FakeProvider, behaviour: str) -> tuple[bytes, str | None]:
    """Stream an Anthropic message with ``behaviour``; the bytes seen and any error's type."""
    body = {"model": "c", "max_tokens": 4, "stream": True}
    seen = b""
    headers = {"x-fake-behaviour": behaviour}
    try:
        with httpx.stream("POST", provider.url + "/v1/messages", json=body, headers=headers) as r:
            for chunk in r.iter_bytes():
                seen += chunk
    except httpx.HTTPError as exc:
        return seen, type(exc).__name__
    return seen, None


def test_behaviour_cut_ends_the_stream_cleanly_without_terminal_event(
    provider: FakeProvider,
) -> None:
    """cut=K sends K events and a clean end of body: no error, no message_stop."""
    seen, error = _read_stream(provider, "cut=2")
    assert error is None
    assert seen.count(b"event: ") == 2 and b"message_stop" not in seen
    assert provider.receipts()[0]["behaviour"] == "cut=2"


def test_behaviour_reset_and_drop_break_the_connection(provider: FakeProvider) -> None:
    """reset=K resets after K events; drop reads the request and hangs up with no answer."""
    seen, error = _read_stream(provider, "reset=1")
    assert error is not None and seen.count(b"event: ") == 1
    with pytest.raises(httpx.RemoteProtocolError):
        post(provider, CHAT, {"model": "m"}, **{"x-fake-behaviour": "drop", "x-fake-tag": "t1"})
    receipts = provider.receipts()
    assert [r["behaviour"] for r in receipts] == ["reset=1", "drop"]
    assert receipts[1]["tag"] == "t1"


def test_behaviour_times_applies_to_the_first_requests_of_an_id(provider: FakeProvider) -> None:
    """id=X;times=1;status=429 answers 429 once, then plain answers for the same id."""
    headers = {"x-fake-behaviour": "status=429;id=a;times=1"}
    statuses = [post(provider, CHAT, {"model": "m"}, **headers).status_code for _ in range(3)]
    assert statuses == [429, 200, 200]
    assert [r["behaviour"] for r in provider.receipts()] == ["status=429;id=a;times=1", "", ""]


def test_behaviour_moved_answers_a_redirect_with_an_absolute_location(
    provider: FakeProvider,
) -> None:
    """moved=T answers 307 (or ``status``) with ``Location`` T, a path made absolute on the
    fake's own origin; the request is receipted as any POST is."""
    moved = post(provider, CHAT, {"model": "m"}, **{"x-fake-behaviour": "moved=/v1/x?a=1"})
    assert moved.status_code == 307
    assert moved.headers["location"] == provider.url + "/v1/x?a=1"
    away = {"x-fake-behaviour": "status=302;moved=https://elsewhere.example/y"}
    elsewhere = post(provider, CHAT, {"model": "m"}, **away)
    assert elsewhere.status_code == 302
    assert elsewhere.headers["location"] == "https://elsewhere.example/y"
    receipts = provider.receipts()
    assert [r["status"] for r in receipts] == [307, 302]
    assert receipts[0]["behaviour"] == "moved=/v1/x?a=1"


def test_behaviour_trickle_sends_the_whole_answer_a_byte_at_a_time(
    provider: FakeProvider,
) -> None:
    """trickle=S: the headers at once, then every byte of the answer as its own write, S
    seconds apart; the answer is whole, and the receipt names the behaviour."""
    trickled = {"x-fake-behaviour": "trickle=0.001"}
    with httpx.stream("POST", provider.url + CHAT, json={"model": "m"}, headers=trickled) as r:
        assert r.status_code == 200
        reads = list(r.iter_raw())
    body = b"".join(reads)
    assert json.loads(body)["usage"]["total_tokens"] > 0
    assert len(reads) > len(body) // 4  # read as it trickled, never in one piece
    assert provider.receipts()[0]["behaviour"] == "trickle=0.001"


def test_behaviour_pad_makes_answers_larger_and_still_well_formed(provider: FakeProvider) -> None:
    """pad=N: a JSON body N bytes longer (trailing whitespace), a stream with its first event
    repeated; both still parse and still end with their usage."""
    plain = {"model": "m", "messages": USER}
    small = post(provider, CHAT, plain)
    big = post(provider, CHAT, plain, **{"x-fake-behaviour": "pad=100000"})
    assert len(big.content) == len(small.content) + 100_000
    assert big.json()["usage"] == small.json()["usage"]
    with httpx.stream(
        "POST",
        provider.url + CHAT,
        json={**plain, "stream": True, "stream_options": {"include_usage": True}},
        headers={"x-fake-behaviour": "pad=50000"},
    ) as response:
        text = response.read().decode()
    assert len(text) > 50_000 and text.endswith("data: [DONE]\n\n")
    assert sse_data(text)[-1]["usage"] is not None
    assert [r["behaviour"] for r in provider.receipts()] == ["", "pad=100000", "pad=50000"]


@pytest.mark.parametrize("stream", [False, True])
def test_behaviour_endless_never_ends_the_answer(provider: FakeProvider, stream: bool) -> None:
    """endless: the answer goes on (here, past 4 MiB) until the client hangs up; one receipt."""
    body = {"model": "m", "messages": USER, "stream": stream}
    seen = 0
    with httpx.stream(
        "POST", provider.url + CHAT, json=body, headers={"x-fake-behaviour": "endless"}
    ) as response:
        for chunk in response.iter_raw():
            seen += len(chunk)
            if seen > 4 << 20:
                break
    assert seen > 4 << 20
    assert [r["behaviour"] for r in provider.receipts()] == ["endless"]
    assert post(provider, CHAT, body).status_code == 200  # and it still serves others


def test_the_contract_names_every_receipt_field(shared: FakeProvider) -> None:
    """Contract §11.2's "A receipt line has ..." names each field a receipt line holds:
    the receipt log is the ground truth tests read, so a field it leaves out is one a
    reader cannot know of (``behaviour``, ``tag`` and ``op`` were)."""
    contract = (Path(__file__).resolve().parent.parent / "docs" / "contract.md").read_text()
    sentence = contract[contract.index("A receipt line has") :].split(". ", 1)[0]
    named = set(re.findall(r"`([a-z_0-9]+)`", sentence))
    before = len(shared.receipts())
    assert post(
        shared, "/v1/chat/completions", {"model": "gpt-4o-mini", "messages": USER}
    ).is_success
    (receipt,) = shared.receipts()[before:]
    assert set(receipt) == named, set(receipt) ^ named


def test_the_contract_lists_the_routes_that_write_receipts(shared: FakeProvider) -> None:
    """Contract §11.2 names the routes whose POSTs are receipted, and only those: a POST
    elsewhere is answered 404 and leaves the log as it was (no effect happened)."""
    from effectguard.testing.fakeanswers import ROUTES

    contract = (Path(__file__).resolve().parent.parent / "docs" / "contract.md").read_text()
    start = contract.index("Every POST to one of its effect routes")
    listed = set(re.findall(r"`(/v1/[a-z/]+)`", contract[start : contract.index(")", start)]))
    assert listed == set(ROUTES)
    before = len(shared.receipts())
    assert post(shared, "/v1/not-a-route", {"model": "gpt-4o-mini"}).status_code == 404
    assert len(shared.receipts()) == before


def test_receipts_leave_out_a_line_still_being_written(provider: FakeProvider) -> None:
    """A reader can see the first part of a line the provider is appending (a write
    crossing a page boundary lands a page at a time): that line is not a receipt yet."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(provider.url + CHAT, json=body, timeout=10).status_code == 200
    with provider.receipts_path.open("a") as log:
        log.write('{"seq": 2, "ta')  # what a concurrent reader saw in CI
    assert [r["seq"] for r in provider.receipts()] == [1]
