"""The in-process transports against an upstream that plays HTTP/1.1 on a raw socket.

* A gzip-coded answer reaches the caller's client as it was sent: decoded once, raw
  bytes readable, on the sync and the async transport (the sync one decoded it twice
  and raised ``DecodingError``, which the OpenAI SDK retried: three paid calls).
* Bytes an upstream writes behind a complete answer (a second, forged answer in the
  same write) never answer the next call on that connection: the connection is
  dropped, and the next call gets its own answer and its own cost.
* A usage event an upstream sends after ``[DONE]`` is not charged (it was when it came
  in the same read as ``[DONE]``).
"""

from __future__ import annotations

import gzip
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from edgekit import read_request

from effectguard import AsyncGuardTransport, GuardTransport
from effectguard.ledger import Ledger

CHAT = "/v1/chat/completions"
BODY = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}


def _answer(call: str, prompt_tokens: int) -> bytes:
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 1, "total_tokens": 0}
    return json.dumps(
        {"id": call, "object": "chat.completion", "choices": [], "usage": usage}
    ).encode()


def _http(body: bytes, *fields: str) -> bytes:
    head = "".join(f"{f}\r\n" for f in fields)
    return (
        f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n{head}"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


#: A chat stream whose only usage event comes after ``[DONE]``, in the same write.
_LATE_USAGE_STREAM = (
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{"content":"hi"}}]}\n\ndata: [DONE]\n\n'
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[],'
    b'"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}\n\n'
)


class KeepAliveUpstream:
    """Answers each request on a connection kept open, by its ``x-answer``: ``gzip``
    (a gzip-coded answer), ``late-usage`` (a stream whose usage follows ``[DONE]``),
    ``short-length`` (a ``Content-Length`` 20 bytes short of the body it sends),
    ``smuggle`` (an answer and a forged one behind it, in one write) or anything else (a
    plain answer naming the request's ``x-call``)."""

    def __init__(self) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        self.received: list[str] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._server.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while (request := read_request(conn)) is not None:
                kind = request.fields.get(b"x-answer", b"").decode()
                call = request.fields.get(b"x-call", b"").decode()
                self.received.append(call)
                if kind == "gzip":
                    conn.sendall(_http(gzip.compress(_answer(call, 5)), "Content-Encoding: gzip"))
                elif kind == "late-usage":
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                        b"Content-Length: %d\r\n\r\n" % len(_LATE_USAGE_STREAM) + _LATE_USAGE_STREAM
                    )
                elif kind == "short-length":  # its Content-Length 20 bytes short
                    body = _answer(call, 5)
                    head = _http(body)[: -len(body)]
                    length = b"Content-Length: %d" % len(body)
                    conn.sendall(
                        head.replace(length, b"Content-Length: %d" % (len(body) - 20)) + body
                    )
                elif kind == "smuggle":
                    conn.sendall(_http(_answer(call, 5)) + _http(_answer("FORGED", 900_000)))
                else:
                    conn.sendall(_http(_answer(call, 5)))


@pytest.fixture
def upstream() -> Iterator[KeepAliveUpstream]:
    running = KeepAliveUpstream()
    yield running
    running.close()


def _headers(call: str, answer: str = "plain") -> dict[str, str]:
    return {"authorization": "Bearer sk-test", "x-call": call, "x-answer": answer}


async def _costs(ledger: Path) -> dict[str, int | None]:
    async with Ledger.open(str(ledger)) as opened:
        return {c.call_id: c.cost for c in await opened.calls(limit=10)}


def test_a_gzip_answer_is_decoded_once_on_the_sync_transport(
    upstream: KeepAliveUpstream, tmp_path: Path
) -> None:
    transport = GuardTransport(ledger=str(tmp_path / "l.db"), upstreams={"openai": upstream.url})
    with httpx.Client(transport=transport, base_url=upstream.url) as client:
        answer = client.post(CHAT, json=BODY, headers=_headers("c1", "gzip"))
        assert answer.json()["id"] == "c1"
        with client.stream("POST", CHAT, json=BODY, headers=_headers("c2", "gzip")) as raw:
            assert gzip.decompress(b"".join(raw.iter_raw()))  # the bytes as sent
        sdk = openai.OpenAI(base_url=upstream.url + "/v1", api_key="x", http_client=client)
        made = sdk.chat.completions.create(extra_headers=_headers("c3", "gzip"), **BODY)  # type: ignore[call-overload]
        assert made.id == "c3"
    assert upstream.received == ["c1", "c2", "c3"]  # no retry of a paid call


async def test_a_gzip_answer_is_decoded_once_on_the_async_transport(
    upstream: KeepAliveUpstream, tmp_path: Path
) -> None:
    transport = AsyncGuardTransport(
        ledger=str(tmp_path / "l.db"), upstreams={"openai": upstream.url}
    )
    async with httpx.AsyncClient(transport=transport, base_url=upstream.url) as client:
        answer = await client.post(CHAT, json=BODY, headers=_headers("c1", "gzip"))
        assert answer.json()["id"] == "c1"
        async with client.stream("POST", CHAT, json=BODY, headers=_headers("c2", "gzip")) as raw:
            assert gzip.decompress(b"".join([c async for c in raw.aiter_raw()]))
    assert upstream.received == ["c1", "c2"]


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
async def test_bytes_behind_an_answer_never_answer_the_next_call(
    upstream: KeepAliveUpstream, tmp_path: Path, sync: bool
) -> None:
    """The forged answer (900,000 prompt tokens) sits behind the first one on its pooled
    connection; the next call must get its own answer, and be charged its own cost."""
    ledger = tmp_path / "l.db"
    if sync:
        with httpx.Client(
            transport=GuardTransport(ledger=str(ledger), upstreams={"openai": upstream.url}),
            base_url=upstream.url,
        ) as client:
            first = client.post(CHAT, json=BODY, headers=_headers("c1", "smuggle"))
            second = client.post(CHAT, json=BODY, headers=_headers("c2"))
    else:
        async with httpx.AsyncClient(
            transport=AsyncGuardTransport(ledger=str(ledger), upstreams={"openai": upstream.url}),
            base_url=upstream.url,
        ) as client:
            first = await client.post(CHAT, json=BODY, headers=_headers("c1", "smuggle"))
            second = await client.post(CHAT, json=BODY, headers=_headers("c2"))
    assert first.json()["id"] == "c1"
    assert second.json()["id"] == "c2"
    assert upstream.received == ["c1", "c2"]
    costs = await _costs(ledger)
    assert len(costs) == 2 and len(set(costs.values())) == 1  # both the same 5-token cost


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
async def test_a_usage_event_behind_done_is_not_charged(
    upstream: KeepAliveUpstream, tmp_path: Path, sync: bool
) -> None:
    """The usage after ``[DONE]`` is not read: the call is settled at its reservation,
    as one whose usage never came, not at the late event's cost (which it was when the
    event arrived in the same read as ``[DONE]``)."""
    ledger = tmp_path / "l.db"
    body = {**BODY, "stream": True}
    settings = {"ledger": str(ledger), "upstreams": {"openai": upstream.url}}
    if sync:
        with httpx.Client(transport=GuardTransport(**settings), base_url=upstream.url) as client:  # type: ignore[arg-type]
            answer = client.post(CHAT, json=body, headers=_headers("c1", "late-usage"))
    else:
        async with httpx.AsyncClient(
            transport=AsyncGuardTransport(**settings),  # type: ignore[arg-type]
            base_url=upstream.url,
        ) as client:
            answer = await client.post(CHAT, json=body, headers=_headers("c1", "late-usage"))
    assert answer.status_code == 200 and b"[DONE]" in answer.content
    assert upstream.received == ["c1"]
    async with Ledger.open(str(ledger)) as opened:
        (call,) = await opened.calls(limit=10)
    assert (call.stage, call.cost) == ("completed", call.reserved_at_admission)


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
async def test_an_answer_past_its_content_length_is_settled_at_the_reservation(
    upstream: KeepAliveUpstream, tmp_path: Path, sync: bool
) -> None:
    """``Content-Length`` 20 bytes short: the answer is its first ``Content-Length`` bytes
    (JSON cut short, so no usage: settled at the reservation), the rest is bytes behind it,
    and the next call on the connection gets its own answer and cost (contract.md §12)."""
    ledger = tmp_path / "l.db"
    settings = {"ledger": str(ledger), "upstreams": {"openai": upstream.url}}
    if sync:
        with httpx.Client(transport=GuardTransport(**settings), base_url=upstream.url) as client:  # type: ignore[arg-type]
            short = client.post(CHAT, json=BODY, headers=_headers("c1", "short-length"))
            after = client.post(CHAT, json=BODY, headers=_headers("c2"))
    else:
        async with httpx.AsyncClient(
            transport=AsyncGuardTransport(**settings),  # type: ignore[arg-type]
            base_url=upstream.url,
        ) as client:
            short = await client.post(CHAT, json=BODY, headers=_headers("c1", "short-length"))
            after = await client.post(CHAT, json=BODY, headers=_headers("c2"))
    assert short.status_code == 200 and short.content == _answer("c1", 5)[:-20]
    assert after.json()["id"] == "c2"
    assert upstream.received == ["c1", "c2"]
    async with Ledger.open(str(ledger)) as opened:
        calls = {c.call_id: c for c in await opened.calls(limit=10)}
    costs = sorted((c.cost == c.reserved_at_admission, c.stage) for c in calls.values())
    assert costs == [(False, "completed"), (True, "completed")]
