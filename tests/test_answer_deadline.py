"""An upstream that trickles its answer (a byte every fraction of a second) is cut off: a
plain answer must arrive whole within ``read_timeout_s`` of its headers, a stream within
``stream_timeout_s``.

``read_timeout_s`` bounds each wait for the next bytes. Before these bounds, an upstream
never silent for that long held its call in flight for as long as it kept sending: the
reservation, a front-door slot, an upstream connection and the client. Past the bound the
call ends as any read timeout after sending does (contract §3.4): the attempt interrupted,
effect unknown, the reservation held; a plain answer's client gets 504 ``effect_unknown``,
a stream's client an error, never a clean end.

The upstream is the fake provider, asked to trickle (``x-fake-behaviour: trickle=S``) by
some requests only, with good traffic alongside; its receipts count what was sent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx
from conftest import FAST
from leavekit import leave_a_stream
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
from effectguard.config.settings import GuardSettings, load_settings
from effectguard.errors import ConfigError
from effectguard.ledger import Ledger
from effectguard.ops.cli import main as cli_main
from effectguard.rules.events import AttemptInterrupted
from effectguard.testing import FakeProvider, fake_provider, running_proxy

CHAT = "/v1/chat/completions"
CALL_ID = "effectguard-call-id"


def chat(content: str = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": content}], **extra}


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeProvider]:
    with fake_provider(tmp_path / "receipts.jsonl") as running:
        yield running


async def _stream(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> str:
    """How a streamed call's read ended: ``cleanly``, or the error that ended it."""
    async with client.stream("POST", url, json=chat(stream=True), headers=headers) as r:
        assert r.status_code == 200
        return await how_it_ended(r, f"{r.headers[CALL_ID]} ")


async def _traffic(client: httpx.AsyncClient, url: str) -> tuple[list[httpx.Response], list[str]]:
    """Four plain calls and a stream, good; one plain call and one stream, trickled."""
    posts = [client.post(url, json=chat(f"good {i}")) for i in range(4)]
    posts.append(client.post(url, json=chat("slow"), headers=TRICKLE))
    streams = [_stream(client, url, {}), _stream(client, url, TRICKLE)]
    answers, ends = await asyncio.gather(asyncio.gather(*posts), asyncio.gather(*streams))
    return list(answers), list(ends)


def _check_answers(
    answers: list[httpx.Response], ends: list[str], explained: bool = True
) -> tuple[str, str]:
    """The good calls completed; the trickled ones ended as read timeouts do. Their ids."""
    assert [a.status_code for a in answers] == [200] * 4 + [504], answers[-1].text
    slow = answers[-1]
    error = slow.json()["error"]
    assert (error["type"], error["next_operation"]) == ("effect_unknown", "reconcile")
    assert "read_timeout_s" in error["message"], error["message"]
    assert slow.headers["x-should-retry"] == "false"
    assert ends[0] == "cleanly"
    assert ends[1] not in ("cleanly", OUTLASTED), ends[1]
    # A transport's caller is told why; the proxy's client has its connection cut.
    assert not explained or "stream_timeout_s" in ends[1], ends[1]
    return slow.headers[CALL_ID], ends[1].split(" ", 1)[0]


def _show(ledger: Path, call_id: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    capsys.readouterr()
    assert cli_main(["show", call_id, "--json", "--ledger", str(ledger)]) == 0
    shown: dict[str, Any] = json.loads(capsys.readouterr().out)
    return shown


def _check_ledger(ledger: Path, ids: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    """Each trickled call is effect_unknown, its reservation held, its attempt interrupted
    for the bound it ran past."""
    for call_id, setting in zip(ids, ("read_timeout_s", "stream_timeout_s"), strict=True):
        shown = _show(ledger, call_id, capsys)
        assert (shown["stage"], shown["held_usd"]) == ("effect_unknown", shown["reserved_usd"])
        reasons = [
            e["data"]["reason"] for e in shown["events"] if e["kind"] == "attempt.interrupted"
        ]
        assert len(reasons) == 1 and setting in reasons[0], reasons
    capsys.readouterr()
    assert cli_main(["calls", "--json", "--ledger", str(ledger)]) == 0
    stages = sorted(c["stage"] for c in json.loads(capsys.readouterr().out))
    assert stages == ["completed"] * 5 + ["effect_unknown"] * 2


def _check_receipts(fake: FakeProvider) -> None:
    """Seven calls, each sent once: nothing re-sent on a guess."""
    receipts = fake.receipts()
    assert len(receipts) == 7
    assert sum(r["behaviour"] == "trickle=0.2" for r in receipts) == 2


# -- the proxy -----------------------------------------------------------------------------


@pytest.mark.slow
def test_the_proxy_cuts_off_trickled_answers_while_good_calls_complete(
    tmp_path: Path, fake: FakeProvider, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through the proxy: the trickled plain call is answered 504 effect_unknown, the
    trickled stream's connection is cut (the log says why), each call was sent once, and
    five good calls alongside complete."""
    config = tmp_path / "c.toml"
    config.write_text(f"[upstream]\nread_timeout_s = {READ_S}\nstream_timeout_s = {STREAM_S}\n")
    ledger = tmp_path / "ledger.db"

    async def run(url: str) -> tuple[list[httpx.Response], list[str]]:
        async with httpx.AsyncClient(timeout=PATIENCE_S) as client:
            return await _traffic(client, url + "/openai" + CHAT)

    with running_proxy(
        ledger, upstreams={"openai": fake.url}, args=["--config", str(config)]
    ) as proxy:
        answers, ends = asyncio.run(run(proxy.url))
        log = proxy.log()
    ids = _check_answers(answers, ends, explained=False)
    assert f"stream cut off (call {ids[1]})" in log and "stream_timeout_s" in log, log
    _check_receipts(fake)
    _check_ledger(ledger, ids, capsys)


# -- the transports ------------------------------------------------------------------------


@pytest.mark.slow
def test_the_async_transport_cuts_off_trickled_answers(
    tmp_path: Path, fake: FakeProvider, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same through AsyncGuardTransport, whose stream's caller is told why."""
    ledger = tmp_path / "ledger.db"

    async def run() -> tuple[list[httpx.Response], list[str]]:
        transport = AsyncGuardTransport(
            ledger=str(ledger), settings=BOUNDED, upstreams={"openai": fake.url}
        )
        async with httpx.AsyncClient(transport=transport, timeout=PATIENCE_S) as client:
            return await _traffic(client, fake.url + CHAT)

    answers, ends = asyncio.run(run())
    ids = _check_answers(answers, ends)
    _check_receipts(fake)
    _check_ledger(ledger, ids, capsys)


@pytest.mark.slow
def test_the_sync_transport_cuts_off_trickled_answers(
    tmp_path: Path, fake: FakeProvider, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same through GuardTransport (its upstream read on worker threads)."""
    ledger = tmp_path / "ledger.db"
    url = fake.url + CHAT
    transport = GuardTransport(ledger=str(ledger), settings=BOUNDED, upstreams={"openai": fake.url})
    with httpx.Client(transport=transport, timeout=PATIENCE_S) as client:
        answers = [client.post(url, json=chat(f"good {i}")) for i in range(4)]
        answers.append(client.post(url, json=chat("slow"), headers=TRICKLE))
        ends = [_sync_stream(client, url, {}), _sync_stream(client, url, TRICKLE)]
    ids = _check_answers(answers, ends)
    _check_receipts(fake)
    _check_ledger(ledger, ids, capsys)


def _sync_stream(client: httpx.Client, url: str, headers: dict[str, str]) -> str:
    with client.stream("POST", url, json=chat(stream=True), headers=headers) as r:
        assert r.status_code == 200
        return how_it_ended_sync(r, f"{r.headers[CALL_ID]} ")


# -- the setting ---------------------------------------------------------------------------


def test_stream_timeout_is_read_from_the_upstream_table(tmp_path: Path) -> None:
    """``[upstream] stream_timeout_s``: an hour by default, 0 for none, never negative; the
    proxy's guard takes it and ``read_timeout_s`` as the transports' settings name them."""
    assert load_settings().guard.upstream_stream_timeout_s == 3600
    assert GuardSettings().upstream_stream_timeout_s == 3600
    config = tmp_path / "c.toml"
    config.write_text("[upstream]\nread_timeout_s = 7\nstream_timeout_s = 0\n")
    guard = load_settings(config=config).guard
    assert (guard.upstream_read_timeout_s, guard.upstream_stream_timeout_s) == (7, 0)
    for bad in ("-1", '"long"', "inf"):
        config.write_text(f"[upstream]\nstream_timeout_s = {bad}\n")
        with pytest.raises(ConfigError, match=r"upstream\.stream_timeout_s"):
            load_settings(config=config)


# -- in process: what the bounds leave alone, and a stream nobody reads -------------------

OPENAI = "https://api.openai.com/v1/chat/completions"
USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"y"}}]}\n\n'
END = b'data: {"choices":[],"usage":' + json.dumps(USAGE).encode() + b"}\n\ndata: [DONE]\n\n"


class Paced(httpx.AsyncByteStream):
    """An event stream sent an event every ``pause`` seconds: ``events`` of them and its
    end, or without end (``events`` None); counts what it was asked for."""

    def __init__(self, pause: float, events: int | None) -> None:
        self.pause, self.events, self.sent = pause, events, 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while self.events is None or self.sent < self.events:
            await asyncio.sleep(self.pause)
            self.sent += 1
            yield EVENT
        yield END


async def _interrupted(ledger: Ledger, call_id: str) -> list[str]:
    return [
        e.event.reason
        for e in await ledger.events(call_id)
        if isinstance(e.event, AttemptInterrupted)
    ]


async def test_a_stream_outlasting_the_read_timeout_completes_with_no_stream_bound(
    make_transport: Callable[..., AsyncGuardTransport],
    finish: Callable[[AsyncGuardTransport], Awaitable[None]],
) -> None:
    """``read_timeout_s`` bounds a plain answer's body, never a stream's; and
    ``stream_timeout_s = 0`` is no bound: a stream of six events 0.1 s apart, under a
    0.2 s read timeout, is forwarded whole and the call completes."""
    settings = dataclasses.replace(FAST, upstream_read_timeout_s=0.2, upstream_stream_timeout_s=0)
    transport = make_transport(settings=settings)
    client = httpx.AsyncClient(transport=transport)
    with respx.mock(assert_all_called=True) as mock:
        stream = Paced(0.1, events=6)
        mock.post(OPENAI).respond(200, stream=stream, headers={"content-type": "text/event-stream"})
        async with client.stream("POST", OPENAI, json=chat(stream=True)) as response:
            body = b"".join([chunk async for chunk in response.aiter_raw()])
    assert body.endswith(b"data: [DONE]\n\n")
    call = await transport.ledger.call(response.headers[CALL_ID])
    assert (call.stage, call.held) == ("completed", 0)
    await finish(transport)


async def test_a_stream_its_client_left_is_cut_off_at_its_bound(
    make_transport: Callable[..., AsyncGuardTransport],
    finish: Callable[[AsyncGuardTransport], Awaitable[None]],
) -> None:
    """A stream whose client went away is read in the background (contract §3.8); one that
    never ends is cut off at ``stream_timeout_s`` there too, and no longer read."""
    settings = dataclasses.replace(FAST, upstream_stream_timeout_s=0.5)
    transport = make_transport(settings=settings)
    client = httpx.AsyncClient(transport=transport)
    with respx.mock(assert_all_called=True) as mock:
        endless = Paced(0.02, events=None)
        mock.post(OPENAI).respond(
            200, stream=endless, headers={"content-type": "text/event-stream"}
        )
        call_id = await leave_a_stream(client, transport, OPENAI, chat(stream=True))
        call = await transport.ledger.call(call_id)
        assert (call.stage, call.held) == ("effect_unknown", call.reserved_at_admission)
        reasons = await _interrupted(transport.ledger, call_id)
        assert len(reasons) == 1 and "stream_timeout_s (0.5 s)" in reasons[0], reasons
        sent = endless.sent
        await asyncio.sleep(0.2)
        assert endless.sent <= sent + 1  # no longer read (but for a read under way)
    await finish(transport)
