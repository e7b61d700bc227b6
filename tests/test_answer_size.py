"""An upstream that answers more than any real answer: the call is effect unknown, and no
other call is hurt.

A billable answer is kept whole for the ledger, so before ``max_answer_bytes`` existed a
300 MB answer took the proxy to 1.5 GB of memory (and 300 MB into the ledger), and an
endless event stream was read until the process died, with every call in flight. Past
the limit the attempt is now interrupted: effect unknown, its reservation held, never
re-sent (docs/contract.md §3.4).

The in-process tests mock the upstream with respx; the proxy test runs the fake provider,
asked to answer without end (``x-fake-behaviour: endless``) by some requests only, with
good traffic alongside, and counts what was sent with its receipts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx
from conftest import FAST
from leavekit import leave_a_stream

from effectguard import AsyncGuardTransport
from effectguard.config.settings import GuardSettings, load_settings
from effectguard.errors import ConfigError
from effectguard.ledger import Ledger
from effectguard.ops.verify import verify_ledger
from effectguard.rules.events import AttemptInterrupted
from effectguard.testing import fake_provider, running_proxy

URL = "https://api.openai.com/v1/chat/completions"
CHAT = "/openai/v1/chat/completions"
CALL_ID = "effectguard-call-id"
LIMIT = 64 * 1024
USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def chat(content: str = "hi", **extra: Any) -> dict[str, Any]:
    """An OpenAI chat completion request body."""
    return {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        **extra,
    }


def completion(text_bytes: int) -> bytes:
    """A chat completion whose whole JSON body is ``text_bytes`` long (padded content)."""
    shell = {"id": "c", "object": "chat.completion", "model": "gpt-4o-mini", "usage": USAGE}
    empty = {**shell, "choices": [{"index": 0, "message": {"content": ""}}]}
    pad = text_bytes - len(json.dumps(empty).encode())
    assert pad >= 0
    full = {**shell, "choices": [{"index": 0, "message": {"content": "x" * pad}}]}
    body = json.dumps(full).encode()
    assert len(body) == text_bytes
    return body


DELTA = b'data: {"choices":[{"index":0,"delta":{"content":"' + b"y" * 1000 + b'"}}]}\n\n'


class Endless(httpx.AsyncByteStream):
    """An event stream that never ends; counts what it was asked for."""

    def __init__(self) -> None:
        self.sent = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while True:
            self.sent += len(DELTA)
            yield DELTA
            await asyncio.sleep(0)


def small(limit: int = LIMIT) -> GuardSettings:
    return dataclasses.replace(FAST, max_answer_bytes=limit)


async def interrupted_reason(ledger: Ledger, call_id: str) -> str:
    events = [e.event for e in await ledger.events(call_id)]
    (interrupted,) = [e for e in events if isinstance(e, AttemptInterrupted)]
    return interrupted.reason


# -- in process ----------------------------------------------------------------------------


async def test_an_answer_over_the_limit_is_effect_unknown_and_held(
    make_transport: Callable[..., AsyncGuardTransport],
    finish: Callable[[AsyncGuardTransport], Awaitable[None]],
) -> None:
    transport = make_transport(settings=small())
    client = httpx.AsyncClient(transport=transport)
    with respx.mock(assert_all_called=True) as mock:
        route = mock.post(URL).respond(200, content=completion(LIMIT + 1))
        answer = await client.post(URL, json=chat())
    assert route.call_count == 1
    assert answer.status_code == 502
    error = answer.json()["error"]
    assert (error["type"], error["next_operation"]) == ("effect_unknown", "reconcile")
    assert "max_answer_bytes" in error["message"]
    call_id = answer.headers[CALL_ID]
    state = await transport.ledger.call(call_id)
    assert (state.stage, state.attempts, state.cost) == ("effect_unknown", 1, None)
    assert state.held == state.reserved_at_admission > 0
    reason = await interrupted_reason(transport.ledger, call_id)
    assert reason == f"the provider's 200 answer grew past max_answer_bytes ({LIMIT} bytes) " + (
        "and was not read further"
    )
    await finish(transport)


async def test_an_answer_of_exactly_the_limit_completes(
    make_transport: Callable[..., AsyncGuardTransport],
    finish: Callable[[AsyncGuardTransport], Awaitable[None]],
) -> None:
    transport = make_transport(settings=small())
    client = httpx.AsyncClient(transport=transport)
    body = completion(LIMIT)
    with respx.mock(assert_all_called=True) as mock:
        mock.post(URL).respond(200, content=body, headers={"content-type": "application/json"})
        answer = await client.post(URL, json=chat())
    assert answer.status_code == 200 and answer.content == body
    state = await transport.ledger.call(answer.headers[CALL_ID])
    assert state.stage == "completed" and state.cost is not None and state.held == 0
    await finish(transport)


async def test_an_endless_stream_is_broken_off_at_the_limit(
    make_transport: Callable[..., AsyncGuardTransport],
    finish: Callable[[AsyncGuardTransport], Awaitable[None]],
) -> None:
    transport = make_transport(settings=small())
    client = httpx.AsyncClient(transport=transport)
    endless = Endless()
    forwarded = 0
    with respx.mock(assert_all_called=True) as mock:
        mock.post(URL).respond(200, stream=endless, headers={"content-type": "text/event-stream"})
        async with client.stream("POST", URL, json=chat(stream=True)) as response:
            call_id = response.headers[CALL_ID]
            with pytest.raises(httpx.RemoteProtocolError, match="max_answer_bytes"):
                async for chunk in response.aiter_raw():
                    forwarded += len(chunk)
    assert forwarded <= LIMIT < endless.sent <= LIMIT + len(DELTA)
    state = await transport.ledger.call(call_id)
    assert (state.stage, state.cost) == ("effect_unknown", None)
    assert state.held == state.reserved_at_admission
    assert "max_answer_bytes" in await interrupted_reason(transport.ledger, call_id)
    await finish(transport)


async def test_an_endless_stream_its_client_left_is_not_read_forever(
    make_transport: Callable[..., AsyncGuardTransport],
    finish: Callable[[AsyncGuardTransport], Awaitable[None]],
) -> None:
    """A client that goes away leaves the stream to be read to its end and settled in the
    background (contract §3.8); an endless one ends at the limit, as effect unknown."""
    transport = make_transport(settings=small())
    client = httpx.AsyncClient(transport=transport)
    endless = Endless()
    with respx.mock(assert_all_called=True) as mock:
        mock.post(URL).respond(200, stream=endless, headers={"content-type": "text/event-stream"})
        call_id = await leave_a_stream(client, transport, URL, chat(stream=True))
    assert (await transport.ledger.call(call_id)).stage == "effect_unknown"
    assert LIMIT < endless.sent <= LIMIT + len(DELTA)
    await finish(transport)


def test_the_limit_is_read_from_the_guard_table(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text("[guard]\nmax_answer_bytes = 1048576\n")
    assert load_settings(config=config).guard.max_answer_bytes == 1 << 20
    assert load_settings().guard.max_answer_bytes == 64 * 1024 * 1024
    for bad in ("0", "-1", '"big"'):
        config.write_text(f"[guard]\nmax_answer_bytes = {bad}\n")
        with pytest.raises(ConfigError, match=r"guard\.max_answer_bytes"):
            load_settings(config=config)


# -- through a real proxy, with good traffic alongside --------------------------------------

ENDLESS = {"x-fake-behaviour": "endless"}


@pytest.mark.slow
def test_endless_answers_are_cut_off_while_good_calls_complete(tmp_path: Path) -> None:
    """The fake provider answers some calls without end: those are 502 effect_unknown (or
    a stream cut off with an error), each sent once; 40 ordinary calls and two answers
    padded to half the limit, all alongside, complete."""
    config = tmp_path / "c.toml"
    config.write_text(f"[guard]\nmax_answer_bytes = {LIMIT}\n")
    ledger = tmp_path / "ledger.db"

    async def run(url: str) -> tuple[list[httpx.Response], list[str]]:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:

            async def endless_stream() -> str:
                body = chat("big", stream=True)
                async with client.stream("POST", CHAT, json=body, headers=ENDLESS) as r:
                    try:
                        async for _ in r.aiter_raw():
                            pass
                    except httpx.RemoteProtocolError as exc:
                        return str(exc)
                    return "ended cleanly"

            half = {"x-fake-behaviour": f"pad={LIMIT // 2}"}
            answers = [client.post(CHAT, json=chat(f"good {i}")) for i in range(40)]
            answers += [client.post(CHAT, json=chat("half"), headers=half) for _ in range(2)]
            answers += [client.post(CHAT, json=chat("big"), headers=ENDLESS) for _ in range(3)]
            streams = [endless_stream() for _ in range(3)]
            results = await asyncio.gather(asyncio.gather(*answers), asyncio.gather(*streams))
            return results[0], results[1]

    with (
        fake_provider(tmp_path / "receipts.jsonl") as fake,
        running_proxy(
            ledger, upstreams={"openai": fake.url}, args=["--config", str(config)]
        ) as proxy,
    ):
        answers, streams = asyncio.run(run(proxy.url))
        receipts = fake.receipts()
    assert [a.status_code for a in answers] == [200] * 42 + [502] * 3
    assert all(a.json()["error"]["type"] == "effect_unknown" for a in answers[42:])
    assert "ended cleanly" not in streams
    assert len(receipts) == 48  # each sent once: nothing re-sent on a guess
    assert sum(r["behaviour"] == "endless" for r in receipts) == 6

    async def stages() -> dict[str, int]:
        async with Ledger.open(str(ledger)) as opened:
            counts: dict[str, int] = {}
            for call in await opened.calls():
                counts[call.stage] = counts.get(call.stage, 0) + 1
            assert (await verify_ledger(opened)).ok
            return counts

    assert asyncio.run(stages()) == {"completed": 42, "effect_unknown": 6}
