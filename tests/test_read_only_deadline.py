"""A read-only request (passed through, nothing reserved or recorded) whose upstream
trickles its answer is cut off at the same bounds as a guarded call's: a plain answer must
arrive whole within ``read_timeout_s`` of its headers, a stream within ``stream_timeout_s``.

Without them, an upstream never silent for ``read_timeout_s`` held the request (a
front-door slot, an upstream connection, the client) for as long as it kept sending. Past
the bound a read-only request fails as its upstream failing after sending does (contract
§3.4, §10): a plain answer's client gets 504 ``upstream_failed`` with ``x-should-retry:
true`` (a read has no effect to repeat), a stream's client an error, never a clean end.

The upstream is the fake provider's ``GET /v1/models``, asked to trickle by some requests
(``x-fake-behaviour: trickle=S``; ``?stream=true`` makes it an event stream), with good
reads alongside.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import pytest
import respx
from conftest import FAST
from tricklekit import (
    BOUNDED,
    OUTLASTED,
    PATIENCE_S,
    READ_S,
    STREAM_S,
    TRICKLE,
    how_it_ended,
    how_it_ended_sync,
)

from effectguard import AsyncGuardTransport, GuardTransport
from effectguard.testing import FakeProvider, fake_provider, running_proxy

MODELS = "/v1/models"


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeProvider]:
    with fake_provider(tmp_path / "receipts.jsonl") as running:
        yield running


async def _stream(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> str:
    """How a streamed read ended: ``cleanly``, or the error that ended it."""
    async with client.stream("GET", url + "?stream=true", headers=headers) as r:
        assert r.status_code == 200
        return await how_it_ended(r)


async def _reads(client: httpx.AsyncClient, url: str) -> tuple[list[httpx.Response], list[str]]:
    """Two plain reads and a stream, good; one plain read and one stream, trickled."""
    gets = [client.get(url) for _ in range(2)]
    gets.append(client.get(url, headers=TRICKLE))
    streams = [_stream(client, url, {}), _stream(client, url, TRICKLE)]
    answers, ends = await asyncio.gather(asyncio.gather(*gets), asyncio.gather(*streams))
    return list(answers), list(ends)


def _check(answers: list[httpx.Response], ends: list[str], explained: bool = True) -> None:
    """The good reads came whole; the trickled plain read is a 504 upstream_failed a client
    may retry; the trickled stream ended with an error, in bounded time."""
    assert [a.status_code for a in answers] == [200, 200, 504], answers[-1].text
    assert answers[0].json()["data"][0]["id"] == "fake-model"
    slow = answers[-1]
    error = slow.json()["error"]
    assert error["type"] == "upstream_failed", error
    assert "read_timeout_s" in error["message"], error["message"]
    assert slow.headers["x-should-retry"] == "true"
    assert "effectguard-call-id" not in slow.headers
    assert ends[0] == "cleanly"
    assert ends[1] not in ("cleanly", OUTLASTED), ends[1]
    # A transport's caller is told why; the proxy's client has its connection cut.
    assert not explained or "stream_timeout_s" in ends[1], ends[1]


@pytest.mark.slow
def test_the_proxy_cuts_off_trickled_reads(tmp_path: Path, fake: FakeProvider) -> None:
    """Through the proxy; the trickled stream's cut is logged with its reason."""
    config = tmp_path / "c.toml"
    config.write_text(f"[upstream]\nread_timeout_s = {READ_S}\nstream_timeout_s = {STREAM_S}\n")

    async def run(url: str) -> tuple[list[httpx.Response], list[str]]:
        async with httpx.AsyncClient(timeout=PATIENCE_S) as client:
            return await _reads(client, url + "/openai" + MODELS)

    with running_proxy(
        tmp_path / "ledger.db", upstreams={"openai": fake.url}, args=["--config", str(config)]
    ) as proxy:
        answers, ends = asyncio.run(run(proxy.url))
        # A HEAD's answer has no body, yet is never held: no length of 0 is made up for it.
        head = httpx.head(proxy.url + "/openai" + MODELS, timeout=PATIENCE_S)
        log = proxy.log()
    assert head.status_code == 200
    assert head.headers.get("content-length") != "0", head.headers
    _check(answers, ends, explained=False)
    assert "stream cut off (call None)" in log and "stream_timeout_s" in log, log


@pytest.mark.slow
def test_the_async_transport_cuts_off_trickled_reads(tmp_path: Path, fake: FakeProvider) -> None:
    async def run() -> tuple[list[httpx.Response], list[str]]:
        transport = AsyncGuardTransport(
            ledger=str(tmp_path / "ledger.db"), settings=BOUNDED, upstreams={"openai": fake.url}
        )
        async with httpx.AsyncClient(transport=transport, timeout=PATIENCE_S) as client:
            return await _reads(client, fake.url + MODELS)

    answers, ends = asyncio.run(run())
    _check(answers, ends)


@pytest.mark.slow
def test_the_sync_transport_cuts_off_trickled_reads(tmp_path: Path, fake: FakeProvider) -> None:
    url = fake.url + MODELS
    transport = GuardTransport(
        ledger=str(tmp_path / "ledger.db"), settings=BOUNDED, upstreams={"openai": fake.url}
    )
    with httpx.Client(transport=transport, timeout=PATIENCE_S) as client:
        answers = [client.get(url), client.get(url), client.get(url, headers=TRICKLE)]
        ends = [_sync_stream(client, url, {}), _sync_stream(client, url, TRICKLE)]
    _check(answers, ends)


def _sync_stream(client: httpx.Client, url: str, headers: dict[str, str]) -> str:
    with client.stream("GET", url + "?stream=true", headers=headers) as r:
        assert r.status_code == 200
        return how_it_ended_sync(r)


# -- in process: a read-only answer too large to hold --------------------------------------

MODELS_URL = "https://api.openai.com/v1/models"
MIB = 1 << 20


class Slow(httpx.AsyncByteStream):
    """``count`` chunks of ``size`` bytes, ``pause`` seconds apart."""

    def __init__(self, size: int, count: int, pause: float) -> None:
        self.size, self.count, self.pause = size, count, pause

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for _ in range(self.count):
            await asyncio.sleep(self.pause)
            yield b" " * self.size


async def test_a_large_read_only_answer_is_forwarded_as_it_comes_within_its_bound(
    make_transport: Callable[..., AsyncGuardTransport],
    finish: Callable[[AsyncGuardTransport], Awaitable[None]],
) -> None:
    """A plain read-only answer past 1 MiB is forwarded as it comes, not held: one that
    comes in time arrives whole; one still coming at ``read_timeout_s`` is cut off with
    ``httpx.ReadTimeout`` naming the setting, its 200 already given."""
    transport = make_transport(settings=dataclasses.replace(FAST, upstream_read_timeout_s=0.5))
    client = httpx.AsyncClient(transport=transport)
    with respx.mock(assert_all_called=True) as mock:
        route = mock.get(MODELS_URL)
        route.respond(200, stream=Slow(MIB, 3, 0), headers={"content-type": "application/json"})
        whole = await client.get(MODELS_URL)
        assert (whole.status_code, len(whole.content)) == (200, 3 * MIB)
        route.respond(200, stream=Slow(MIB, 20, 0.1), headers={"content-type": "application/json"})
        async with client.stream("GET", MODELS_URL) as response:
            assert response.status_code == 200
            with pytest.raises(httpx.ReadTimeout, match=r"read_timeout_s \(0\.5 s\)"):
                async for _ in response.aiter_raw():
                    pass
    await finish(transport)


async def test_a_read_only_stream_outlasting_the_read_timeout_completes_with_no_stream_bound(
    make_transport: Callable[..., AsyncGuardTransport],
    finish: Callable[[AsyncGuardTransport], Awaitable[None]],
) -> None:
    """``read_timeout_s`` bounds a plain read-only answer, never a stream's whole; and
    ``stream_timeout_s = 0`` is no bound: six events 0.1 s apart, under a 0.2 s read
    timeout, are forwarded whole."""
    settings = dataclasses.replace(FAST, upstream_read_timeout_s=0.2, upstream_stream_timeout_s=0)
    transport = make_transport(settings=settings)
    client = httpx.AsyncClient(transport=transport)
    with respx.mock(assert_all_called=True) as mock:
        events = Slow(8, 6, 0.1)
        mock.get(MODELS_URL).respond(
            200, stream=events, headers={"content-type": "text/event-stream"}
        )
        async with client.stream("GET", MODELS_URL) as response:
            body = b"".join([chunk async for chunk in response.aiter_raw()])
    assert body == b" " * 48
    await finish(transport)
