"""No overshoot under concurrency (contract.md §5); no secret ever in the ledger (§3)."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import respx

from effectguard import AsyncGuardTransport
from effectguard.ops.verify import verify_ledger
from effectguard.providers import load_providers
from effectguard.rules.usage import Usage, cost, estimate
from effectguard.telemetry.logs import JsonFormatter, LogObserver, TextFormatter

OPENAI = "https://api.openai.com"
ANTHROPIC = "https://api.anthropic.com"
TOOL = "http://tool.test"
MODEL = "gpt-4o-mini"
PRICE = load_providers([])["openai"].price_for(MODEL)
assert PRICE is not None

MakeTransport = Callable[..., AsyncGuardTransport]
Finish = Callable[[AsyncGuardTransport], Awaitable[None]]


# -- concurrency ------------------------------------------------------------------


async def test_concurrent_calls_never_overshoot_a_budget(
    make_transport: MakeTransport, finish: Finish
) -> None:
    """200 concurrent calls on a budget with room for exactly k: k dispatched, the rest 402."""
    n, k = 200, 37
    prompt, max_tokens = "how much is left?", 64
    request = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
    }
    assert PRICE is not None
    reserve = estimate(PRICE, request)
    # The upstream reports exactly the bounds, so settling never frees room: k is exact
    # whatever the interleaving of admissions and settlements.
    usage = {
        "prompt_tokens": len(prompt.encode()),
        "completion_tokens": max_tokens,
        "total_tokens": len(prompt.encode()) + max_tokens,
    }
    assert cost(PRICE, Usage(usage["prompt_tokens"], max_tokens)) == reserve
    limit = k * reserve + reserve // 2

    t = make_transport()
    await t.guard()
    await t.ledger.set_limit("team", limit)

    async def upstream(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(0.01)  # keep admitted calls in flight together
        return httpx.Response(200, json={"id": "c", "choices": [], "usage": usage})

    committed_samples: list[int] = []
    done = asyncio.Event()

    async def watch() -> None:
        while not done.is_set():
            for node in await t.ledger.budgets():
                if node.path == "team":
                    committed_samples.append(node.reserved + node.spent + node.held)
            await asyncio.sleep(0.005)

    with respx.mock(base_url=OPENAI) as mock:
        route = mock.post("/v1/chat/completions").mock(side_effect=upstream)
        client = httpx.AsyncClient(transport=t, headers={"Effectguard-Budget": "team/run-1"})
        watcher = asyncio.create_task(watch())
        responses = await asyncio.gather(
            *(client.post(OPENAI + "/v1/chat/completions", json=request) for _ in range(n))
        )
        done.set()
        await watcher

    statuses = [r.status_code for r in responses]
    assert statuses.count(200) == k
    assert statuses.count(402) == n - k
    assert {r.json()["error"]["type"] for r in responses if r.status_code == 402} == {
        "budget_exceeded"
    }
    assert route.call_count == k
    assert committed_samples and max(committed_samples) <= limit
    nodes = {node.path: node for node in await t.ledger.budgets()}
    for path in ("team", "team/run-1"):
        node = nodes[path]
        assert (node.reserved, node.spent, node.held) == (0, k * reserve, 0)
        assert node.reserved + node.spent + node.held <= limit
    calls = await t.ledger.calls()
    assert sorted(c.stage for c in calls) == sorted(["completed"] * k + ["refused"] * (n - k))
    await finish(t)


# -- secrets ----------------------------------------------------------------------

OPENAI_SECRET = "sk-canary-XYZ"
ANTHROPIC_SECRET = "canary-ABC"
TOOL_SECRET = "canary-MAIL-123"


def _chat_body() -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": MODEL,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }


async def _chat_stream() -> AsyncIterator[bytes]:
    yield (
        b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini",'
        b'"choices":[{"index":0,"delta":{"role":"assistant","content":"ok"}}]}\n\n'
    )
    yield (
        b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini",'
        b'"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}\n\n'
    )
    yield b"data: [DONE]\n\n"


async def _message_stream() -> AsyncIterator[bytes]:
    yield (
        b'event: message_start\ndata: {"type":"message_start","message":{"id":"m","type":'
        b'"message","role":"assistant","model":"claude-haiku-4-5","content":[],'
        b'"usage":{"input_tokens":3,"output_tokens":1}}}\n\n'
    )
    yield (
        b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":'
        b'"end_turn"},"usage":{"output_tokens":2}}\n\n'
    )
    yield b'event: message_stop\ndata: {"type":"message_stop"}\n\n'


def _sse(stream: Callable[[], AsyncIterator[bytes]]) -> Callable[[httpx.Request], httpx.Response]:
    def respond(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=stream())

    return respond


def _leaks(root: Path, db: Path) -> list[str]:
    """Every place under ``root`` (files and SQLite rows) where a canary appears."""
    found: list[str] = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        data = path.read_bytes().lower()
        if b"canary" in data:
            found.append(f"bytes of {path.name}")
    with sqlite3.connect(db) as conn:
        tables = [
            row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")
        ]
        for table in tables:
            for row in conn.execute(f'SELECT * FROM "{table}"'):
                if "canary" in repr(row).lower():
                    found.append(f"row of {table}: {row!r:.200}")
    conn.close()
    return found


async def test_no_secret_reaches_the_ledger(
    tmp_path: Path,
    ledger_path: str,
    make_transport: MakeTransport,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Authorization, x-api-key and the tool's key header appear nowhere in the ledger's
    files, nor in any log line (text or JSON) the calls produce."""
    caplog.set_level(logging.DEBUG)
    t = make_transport(upstreams={"send_email": TOOL}, observer=LogObserver())
    await t.guard()
    await t.ledger.set_limit("tiny", 1)
    http = httpx.AsyncClient(transport=t)
    sdk = openai.AsyncOpenAI(
        api_key=OPENAI_SECRET, base_url=OPENAI + "/v1", http_client=http, max_retries=0
    )
    messages = [{"role": "user", "content": "hi"}]
    anthropic_headers = {"x-api-key": ANTHROPIC_SECRET, "anthropic-version": "2023-06-01"}
    message = {"model": "claude-haiku-4-5", "max_tokens": 16, "messages": messages}
    tool_headers = {"Authorization": f"Bearer {TOOL_SECRET}"}
    email = {"to": "a@example.com", "text": "hi"}

    with respx.mock() as mock:
        chat = mock.post(OPENAI + "/v1/chat/completions")
        chat.side_effect = [
            httpx.Response(200, json=_chat_body(), headers={"x-request-id": "req-marker-77"}),
            httpx.ReadTimeout("slow"),
            _sse(_chat_stream)(httpx.Request("POST", OPENAI)),
        ]
        msgs = mock.post(ANTHROPIC + "/v1/messages")
        msgs.side_effect = [
            httpx.Response(
                200,
                json={
                    "id": "m",
                    "type": "message",
                    "content": [],
                    "usage": {"input_tokens": 3, "output_tokens": 1},
                },
            ),
            httpx.ReadTimeout("slow"),
            _sse(_message_stream)(httpx.Request("POST", ANTHROPIC)),
        ]
        send = mock.post(TOOL + "/v1/send")
        send.side_effect = [httpx.Response(200, json={"id": "e1"}), httpx.ReadTimeout("slow")]

        # openai: success, timeout, stream, refusal
        await sdk.chat.completions.create(model=MODEL, messages=messages)
        try:
            await sdk.chat.completions.create(model=MODEL, messages=messages)
        except openai.APIStatusError as exc:
            assert exc.status_code == 504
        stream = await sdk.chat.completions.create(model=MODEL, messages=messages, stream=True)
        assert [c async for c in stream]
        try:
            await sdk.chat.completions.create(
                model=MODEL, messages=messages, extra_headers={"Effectguard-Budget": "tiny"}
            )
        except openai.APIStatusError as exc:
            assert exc.status_code == 402

        # anthropic: success, timeout, stream, refusal
        url = ANTHROPIC + "/v1/messages"
        assert (await http.post(url, json=message, headers=anthropic_headers)).status_code == 200
        assert (await http.post(url, json=message, headers=anthropic_headers)).status_code == 504
        streamed = await http.post(url, json={**message, "stream": True}, headers=anthropic_headers)
        assert b"message_stop" in streamed.content
        refused = await http.post(
            url, json=message, headers={**anthropic_headers, "Effectguard-Budget": "tiny"}
        )
        assert refused.status_code == 402

        # send_email: success, timeout, refusal
        url = TOOL + "/v1/send"
        assert (await http.post(url, json=email, headers=tool_headers)).status_code == 200
        assert (await http.post(url, json=email, headers=tool_headers)).status_code == 504
        refused = await http.post(
            url, json=email, headers={**tool_headers, "Effectguard-Budget": "tiny"}
        )
        assert refused.status_code == 402

    # The secrets did reach the upstream (they pass through): their absence below means something.
    assert chat.calls[0].request.headers["authorization"] == f"Bearer {OPENAI_SECRET}"
    assert msgs.calls[0].request.headers["x-api-key"] == ANTHROPIC_SECRET
    assert send.calls[0].request.headers["authorization"] == f"Bearer {TOOL_SECRET}"
    stages = sorted(c.stage for c in await t.ledger.calls())
    assert stages.count("effect_unknown") == 3
    assert stages.count("refused") == 3
    assert stages.count("completed") == 5

    db = Path(ledger_path)
    # A control: stored response headers are visible to this scan, in the files and in rows.
    assert any(b"req-marker-77" in p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())
    assert _leaks(tmp_path, db) == []  # while open: the WAL holds the recent writes
    report = await verify_ledger(t.ledger)
    assert report.ok, report.problems
    await t.aclose()
    assert _leaks(tmp_path, db) == []
    lines = [f.format(r) for r in caplog.records for f in (JsonFormatter(), TextFormatter())]
    assert sum('"event": "access"' in line for line in lines) == 11
    assert not [line for line in lines if "canary" in line.lower()]
