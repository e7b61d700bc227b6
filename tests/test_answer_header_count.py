"""An upstream answer with many header fields, through the proxy and the transports.

The transports (httpx over h11) take any number of header fields within a 100 KiB head;
the proxy's upstream leg (aiohttp) refused more than 128 by default, so an answer one
way took was ``effect_unknown`` the other. Beside each odd answer a plain call to the
same upstream goes through, each sent once.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from edgekit import RawRequest, SocketUpstream

from effectguard import GuardTransport
from effectguard.testing import running_proxy

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
BODY = b'{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}'
#: The leg's bound on an answer's header fields (aioleg.MAX_ANSWER_FIELDS).
BOUND = 4096


def _answer(fields: int) -> bytes:
    extra = b"".join(b"X-H%d: v\r\n" % n for n in range(fields))
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n"
        b"Connection: close\r\n\r\n%s" % (extra, len(BODY), BODY)
    )


class CountingUpstream(SocketUpstream):
    """Answers each request with as many extra header fields as its ``x-fields`` asks."""

    concurrent = True

    def __init__(self) -> None:
        super().__init__()
        self.received: list[str] = []

    def answer(self, conn: socket.socket, request: RawRequest) -> None:
        tag = request.fields[b"x-tag"].decode()
        self.received.append(tag)
        conn.sendall(_answer(int(request.fields[b"x-fields"])))


@pytest.fixture
def upstream() -> Iterator[CountingUpstream]:
    with CountingUpstream() as counting:
        yield counting


def _chat() -> dict[str, object]:
    return {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}


def _beside_plain(client: httpx.Client, fields: int) -> tuple[httpx.Response, list[int]]:
    """The answer to a call whose answer has ``fields`` extra fields, and the statuses of
    ten plain calls sent alongside it."""

    def call(tag: str, count: int) -> httpx.Response:
        return client.post(CHAT, json=_chat(), headers={"x-tag": tag, "x-fields": str(count)})

    with ThreadPoolExecutor(4) as pool:
        odd = pool.submit(call, f"odd-{fields}", fields)
        plain = [pool.submit(call, f"plain-{fields}-{n}", 0) for n in range(10)]
        return odd.result(), [p.result().status_code for p in plain]


def _through_proxy(
    upstream: CountingUpstream, tmp_path: Path, fields: int
) -> tuple[httpx.Response, list[int]]:
    with (
        running_proxy(tmp_path / "ledger.db", upstreams={"openai": upstream.url}) as proxy,
        httpx.Client(base_url=proxy.url + "/openai", timeout=30) as client,
    ):
        return _beside_plain(client, fields)


@pytest.mark.parametrize("fields", [130, 1000, BOUND - 10])
def test_an_answer_with_many_header_fields_passes_the_proxy_as_the_transports(
    fields: int, upstream: CountingUpstream, tmp_path: Path
) -> None:
    answer, plain = _through_proxy(upstream, tmp_path, fields)
    assert answer.status_code == 200, answer.text
    assert answer.headers[f"x-h{fields - 1}"] == "v"
    assert plain == [200] * 10
    transport = GuardTransport(ledger=str(tmp_path / "t.db"), upstreams={"openai": upstream.url})
    with httpx.Client(transport=transport, base_url=upstream.url, timeout=30) as client:
        direct, _ = _beside_plain(client, fields)
    assert direct.status_code == 200
    assert direct.headers[f"x-h{fields - 1}"] == "v"
    assert sorted(upstream.received).count(f"odd-{fields}") == 2  # once each way
    assert len(upstream.received) == 22


def test_an_answer_past_the_bound_is_effect_unknown_and_others_go_on(
    upstream: CountingUpstream, tmp_path: Path
) -> None:
    answer, plain = _through_proxy(upstream, tmp_path, BOUND + 1)
    assert answer.status_code == 502, answer.text
    assert answer.json()["error"]["type"] == "effect_unknown"
    assert "Too many headers received" in answer.json()["error"]["message"]
    assert plain == [200] * 10
    assert upstream.received.count(f"odd-{BOUND + 1}") == 1
    assert len(upstream.received) == 11
