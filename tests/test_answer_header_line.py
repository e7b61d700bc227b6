"""An upstream answer with a long header line, through the proxy and the transports.

The transports (httpx over h11) bound only an answer's whole head, at 100 KiB; the
proxy's upstream leg (aiohttp) refused any header line over 8,190 bytes, so an answer one
way took was ``effect_unknown`` the other. Both now take a head of up to 100 KiB, however
its lines are cut, and refuse a longer one alike. Beside each odd answer ten plain calls
to the same upstream go through, each sent once.
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
#: The transports' bound on an answer's head (httpcore's h11 max_incomplete_event_size).
HEAD_BOUND = 100 * 1024


def _answer(value_length: int, lines: int) -> bytes:
    extra = b"".join(b"X-Long-%d: %s\r\n" % (n, b"v" * value_length) for n in range(lines))
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n"
        b"Connection: close\r\n\r\n%s" % (extra, len(BODY), BODY)
    )


class LongLineUpstream(SocketUpstream):
    """Answers each request with ``x-lines`` fields ``X-Long-N``, each value as long as
    its ``x-long`` asks."""

    concurrent = True

    def __init__(self) -> None:
        super().__init__()
        self.received: list[str] = []

    def answer(self, conn: socket.socket, request: RawRequest) -> None:
        tag = request.fields[b"x-tag"].decode()
        self.received.append(tag)
        lines = int(request.fields[b"x-lines"])
        conn.sendall(_answer(int(request.fields[b"x-long"]), lines))


@pytest.fixture
def upstream() -> Iterator[LongLineUpstream]:
    with LongLineUpstream() as long_lines:
        yield long_lines


def _chat() -> dict[str, object]:
    return {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}


def _beside_plain(
    client: httpx.Client, length: int, lines: int
) -> tuple[httpx.Response, list[int]]:
    """The answer to a call whose answer has ``lines`` fields of ``length`` bytes, and the
    statuses of ten plain calls sent alongside it."""

    def call(tag: str, count: int) -> httpx.Response:
        headers = {"x-tag": tag, "x-long": str(length), "x-lines": str(count)}
        return client.post(CHAT, json=_chat(), headers=headers)

    with ThreadPoolExecutor(4) as pool:
        odd = pool.submit(call, f"odd-{length}", lines)
        plain = [pool.submit(call, f"plain-{length}-{n}", 0) for n in range(10)]
        return odd.result(), [p.result().status_code for p in plain]


def _both_ways(
    upstream: LongLineUpstream, tmp_path: Path, length: int, lines: int = 1
) -> tuple[httpx.Response, httpx.Response]:
    """The odd answer through the proxy and through a GuardTransport, the plain calls
    beside each all 200."""
    with (
        running_proxy(tmp_path / "ledger.db", upstreams={"openai": upstream.url}) as proxy,
        httpx.Client(base_url=proxy.url + "/openai", timeout=30) as client,
    ):
        proxied, plain = _beside_plain(client, length, lines)
    assert plain == [200] * 10
    transport = GuardTransport(ledger=str(tmp_path / "t.db"), upstreams={"openai": upstream.url})
    with httpx.Client(transport=transport, base_url=upstream.url, timeout=30) as client:
        direct, plain = _beside_plain(client, length, lines)
    assert plain == [200] * 10
    assert upstream.received.count(f"odd-{length}") == 2  # once each way
    assert len(upstream.received) == 22
    return proxied, direct


@pytest.mark.parametrize(
    ("length", "lines"), [(8_191, 1), (60_000, 1), (HEAD_BOUND - 200, 1), (1_000, 90)]
)
def test_a_long_header_line_passes_the_proxy_as_the_transports(
    length: int, lines: int, upstream: LongLineUpstream, tmp_path: Path
) -> None:
    proxied, direct = _both_ways(upstream, tmp_path, length, lines)
    for answer in (proxied, direct):
        assert answer.status_code == 200, answer.text[:300]
        assert len(answer.headers[f"x-long-{lines - 1}"]) == length


@pytest.mark.parametrize(("length", "lines"), [(2 * HEAD_BOUND, 1), (1_000, 200)])
def test_a_head_past_the_bound_is_effect_unknown_both_ways(
    length: int, lines: int, upstream: LongLineUpstream, tmp_path: Path
) -> None:
    # One line past the bound, or 200 short lines: the head is bounded whole both ways.
    proxied, direct = _both_ways(upstream, tmp_path, length, lines)
    for answer in (proxied, direct):
        assert answer.status_code == 502, answer.text[:300]
        assert answer.json()["error"]["type"] == "effect_unknown"
    assert "more than 102400 bytes" in proxied.json()["error"]["message"]
