"""A declared retry that joined a call (contract.md §4: a key-less SDK retry,
``x-stainless-retry-count: 1``, of a call in flight waits for its result) when a shutdown
ends while the call waits to retry the provider's 429 (contract.md §3.5).

The provider takes a while, then answers 429 (declared not processed); the client's retry
comes meanwhile and joins the call; the guard then backs off ``retry_wait_s`` (60 s, far
longer than the shutdown's wait) before its own retry. The shutdown (``serve``'s SIGTERM
drain, a transport's ``aclose()`` or ``close()``) ends during that back-off: the call's
own caller gets the provider's 429 (tests/test_drain_retry.py). Until 2026-12-05 the
joined retry got 503 ``shutting_down`` instead: every waiter on one call is to get that
call's answer. Effects are counted with the fake provider's receipts.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from observing import cli_json, ledger_events, wait_for
from shutdownkit import (
    PATIENCE_S,
    chat,
    request_under_way,
    retry_held_until_the_cut,
    whole_answer_on,
)

import effectguard
import effectguard.config.defaults
from effectguard.config.settings import GuardSettings
from effectguard.testing import FakeProvider, Proxy, fake_provider, running_proxy

pytestmark = pytest.mark.slow

#: The provider answers 429 after a while: long enough for the retry to join the call
#: while it is in flight (a retry of a call resting at not_processed, its caller still
#: waiting, is new work).
SLOW_429 = "status=429;delay=3"
BACK_OFF_S = 60
RETRY = {"x-stainless-retry-count": "1"}


@pytest.fixture
def provider(tmp_path: Path) -> Iterator[FakeProvider]:
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        yield fake


def _observed(ledger: str) -> bool:
    """Whether the ledger has recorded an answer (read-only: no lock the guard needs)."""
    try:
        return any(e["kind"] == "attempt.observed" for e in ledger_events(Path(ledger)))
    except sqlite3.Error:  # not created yet
        return False


def _both_got_the_429(answers: list[tuple[int, str, str]], ledger: str) -> None:
    """Each waiter (the call's caller, its joined retry) got the provider's 429 naming the
    one call, which rests not processed after its one attempt."""
    (call,) = cli_json("calls", "--ledger", ledger)  # the retry joined: no second call
    assert (call["stage"], call["attempts"], call["status"]) == ("not_processed", 1, 429), call
    expected = (429, "rate_limit_error", call["call_id"])
    assert answers == [expected, expected], answers
    assert cli_json("verify", "--ledger", ledger)["ok"] is True


def _told(answer: httpx.Response) -> tuple[int, str, str]:
    return (
        answer.status_code,
        answer.json()["error"]["type"],
        answer.headers.get("effectguard-call-id", ""),
    )


#: The header line an SDK's retry of a request carries.
RETRY_COUNT = "x-stainless-retry-count: 1\r\n"


@contextlib.contextmanager
def _draining(
    ledger: str, tmp_path: Path, provider: FakeProvider, settings: str = ""
) -> Iterator[Proxy]:
    """A ``serve`` on ``ledger`` whose drain lasts 1 s (``settings``: more of its config)."""
    config = tmp_path / "c.toml"
    config.write_text("[server]\ndrain_timeout_s = 1\n" + settings)
    with running_proxy(
        ledger,
        upstreams={"openai": provider.url},
        args=["--config", str(config)],
        log_path=tmp_path / "p.log",
    ) as proxy:
        yield proxy


def _call_and_joined_retry(
    proxy: Proxy, provider: FakeProvider, behaviour: str
) -> tuple[socket.socket, socket.socket]:
    """A call under way (the provider has it) and an SDK's retry of it, joining it."""
    first = request_under_way(proxy, "joined", behaviour)
    wait_for(lambda: provider.receipts(), PATIENCE_S, "the first attempt's receipt")
    return first, request_under_way(proxy, "joined", behaviour + RETRY_COUNT)


def _terminated(proxy: Proxy, *under_way: socket.socket) -> tuple[list[tuple[int, str, str]], str]:
    """SIGTERM ``proxy``: what each request ``under_way`` was answered, once it exited 0,
    and its log."""
    proxy.kill(signal.SIGTERM)
    answers = [_raw(sock) for sock in under_way]
    assert proxy.process.wait(PATIENCE_S) == 0
    return answers, proxy.log()


def test_a_drain_ending_during_the_back_off_answers_the_joined_retry_the_429(
    tmp_path: Path, provider: FakeProvider
) -> None:
    """SIGTERM while the guard waits to retry the 429, the drain (1 s) ending first: the
    joined retry gets the 429 its call's caller gets, not 503 ``shutting_down``."""
    ledger = str(tmp_path / "l.db")
    settings = f"[guard]\nretry_wait_s = {BACK_OFF_S}\nmax_retries = 2\n"
    with _draining(ledger, tmp_path, provider, settings) as proxy:
        under_way = _call_and_joined_retry(proxy, provider, f"x-fake-behaviour: {SLOW_429}\r\n")
        wait_for(lambda: _observed(ledger), PATIENCE_S, "the 429 recorded: the guard waits")
        answers, log = _terminated(proxy, *under_way)
    assert [r["status"] for r in provider.receipts()] == [429], log  # no retry went out
    _both_got_the_429(answers, ledger)


def test_a_drain_ending_on_a_joined_call_in_flight_answers_both_504(
    tmp_path: Path, provider: FakeProvider
) -> None:
    """SIGTERM while the joined call still waits for its provider's answer: the drain's end
    cuts it off, effect unknown, and its caller and the joined retry both get 504
    ``effect_unknown`` naming it. (Serve had this right already, its caller cut off
    first; held here, as the joined retry now waits for that cut-off.)"""
    ledger = str(tmp_path / "l.db")
    with _draining(ledger, tmp_path, provider) as proxy:
        under_way = _call_and_joined_retry(proxy, provider, "x-fake-behaviour: delay=60\r\n")
        answers, log = _terminated(proxy, *under_way)
    assert len(provider.receipts()) == 1, log
    (call,) = cli_json("calls", "--ledger", ledger)  # the retry joined: no second call
    assert call["stage"] == "effect_unknown", call
    expected = (504, "effect_unknown", call["call_id"])
    assert answers == [expected, expected], (answers, log)
    assert cli_json("verify", "--ledger", ledger)["ok"] is True


def test_a_drain_ending_answers_the_429_to_the_retry_of_a_call_its_caller_left(
    tmp_path: Path, provider: FakeProvider
) -> None:
    """The call's caller leaves during the back-off after the provider's 429 (its SDK's
    timeout), and its SDK's retry joins the call (contract.md §4). SIGTERM: at the drain's
    end the retry is the call's only waiter. It gets the 429, and the call sends no retry
    in the drain's background phase: it got 503 ``shutting_down`` ("retry once the call
    has ended") while the call's own retry could still go out, answered to nobody."""
    ledger = str(tmp_path / "l.db")
    behaviour = "x-fake-behaviour: status=429;id=left;times=1\r\n"
    with _draining(
        ledger, tmp_path, provider, "[guard]\nretry_wait_s = 1.5\nmax_retries = 2\n"
    ) as proxy:
        first = request_under_way(proxy, "left", behaviour)
        wait_for(lambda: _observed(ledger), PATIENCE_S, "the 429 recorded: the guard waits")
        first.close()  # its caller leaves
        time.sleep(0.3)  # the proxy learns it (as test_retry_backoff's client leaves)
        retry = request_under_way(proxy, "left", behaviour + RETRY_COUNT)
        (answer,), log = _terminated(proxy, retry)
    assert [r["status"] for r in provider.receipts()] == [429], log  # no retry went out
    (call,) = cli_json("calls", "--ledger", ledger)  # the retry joined: no second call
    assert (call["stage"], call["attempts"]) == ("not_processed", 1), call
    assert answer == (429, "rate_limit_error", call["call_id"]), (answer, log)
    assert cli_json("verify", "--ledger", ledger)["ok"] is True


def _raw(sock: socket.socket) -> tuple[int, str, str]:
    answer = whole_answer_on(sock)
    assert answer is not None, "the proxy closed the connection without an answer"
    return answer.status, answer.json()["error"]["type"], answer.headers["effectguard-call-id"]


async def _posted_and_joined(
    client: httpx.AsyncClient, provider: FakeProvider, url: str, headers: dict[str, str]
) -> tuple[asyncio.Future[httpx.Response], asyncio.Future[httpx.Response]]:
    """A call posted through ``client`` (the provider has it), and an SDK's retry of it
    posted after it, joining it: both under way."""
    first = asyncio.ensure_future(client.post(url, content=chat("j"), headers=headers))
    while not provider.receipts():
        await asyncio.sleep(0.02)
    retried = {**headers, **RETRY}
    return first, asyncio.ensure_future(client.post(url, content=chat("j"), headers=retried))


def test_an_async_transport_closing_during_the_back_off_answers_the_joined_retry_the_429(
    tmp_path: Path, provider: FakeProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``aclose()`` while the guard waits to retry the 429 (its wait for the calls under way
    made 1 s): the joined retry gets the 429 too."""
    monkeypatch.setattr(effectguard.config.defaults, "DRAIN_TIMEOUT_S", 1.0)
    ledger = str(tmp_path / "l.db")
    url = provider.url + "/v1/chat/completions"
    headers = {"content-type": "application/json", "x-fake-behaviour": SLOW_429}

    async def scenario() -> list[httpx.Response]:
        transport = effectguard.AsyncGuardTransport(
            ledger=ledger,
            upstreams={"openai": provider.url},
            settings=GuardSettings(retry_wait_s=BACK_OFF_S),
        )
        client = httpx.AsyncClient(transport=transport, timeout=PATIENCE_S)
        first, retry = await _posted_and_joined(client, provider, url, headers)
        while not _observed(ledger):
            await asyncio.sleep(0.02)
        await asyncio.wait_for(transport.aclose(), PATIENCE_S * 3)
        return [await asyncio.wait_for(c, PATIENCE_S) for c in (first, retry)]

    answers = asyncio.run(scenario())
    assert [r["status"] for r in provider.receipts()] == [429]
    _both_got_the_429([_told(a) for a in answers], ledger)


def test_a_sync_transport_closing_during_the_back_off_answers_the_joined_retry_the_429(
    tmp_path: Path, provider: FakeProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same through the sync transport, each caller in a thread of its own."""
    monkeypatch.setattr(effectguard.config.defaults, "DRAIN_TIMEOUT_S", 1.0)
    ledger = str(tmp_path / "l.db")
    url = provider.url + "/v1/chat/completions"
    transport = effectguard.GuardTransport(
        ledger=ledger,
        upstreams={"openai": provider.url},
        settings=GuardSettings(retry_wait_s=BACK_OFF_S),
    )
    client = httpx.Client(transport=transport, timeout=PATIENCE_S)
    told: dict[str, object] = {}

    def call(name: str, extra: dict[str, str]) -> None:
        headers = {"content-type": "application/json", "x-fake-behaviour": SLOW_429, **extra}
        try:
            told[name] = client.post(url, content=chat("j"), headers=headers)
        except Exception as exc:  # what its caller is told, whatever it is
            told[name] = exc

    first = threading.Thread(target=call, args=("first", {}), daemon=True)
    first.start()
    wait_for(lambda: provider.receipts(), PATIENCE_S, "the first attempt's receipt")
    retry = threading.Thread(target=call, args=("retry", RETRY), daemon=True)
    retry.start()
    wait_for(lambda: _observed(ledger), PATIENCE_S, "the 429 recorded: the guard waits")
    transport.close()
    for caller in (first, retry):
        caller.join(PATIENCE_S)
        assert not caller.is_alive(), "a caller still waits on a closed transport"
    answers = [told["first"], told["retry"]]
    assert all(isinstance(a, httpx.Response) for a in answers), answers
    assert [r["status"] for r in provider.receipts()] == [429]
    _both_got_the_429([_told(a) for a in answers if isinstance(a, httpx.Response)], ledger)


def test_a_transport_closing_on_a_joined_call_in_flight_answers_both_504(
    tmp_path: Path, provider: FakeProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``aclose()`` while the joined call still waits for its provider's answer: the close
    cuts it off, effect unknown, and its caller and the joined retry both get 504
    ``effect_unknown`` naming it (the retry got 503 ``shutting_down`` until 2026-12-05)."""
    monkeypatch.setattr(effectguard.config.defaults, "DRAIN_TIMEOUT_S", 1.0)
    ledger = str(tmp_path / "l.db")
    url = provider.url + "/v1/chat/completions"
    headers = {"content-type": "application/json", "x-fake-behaviour": "delay=60"}

    async def scenario() -> list[httpx.Response]:
        transport = effectguard.AsyncGuardTransport(
            ledger=ledger, upstreams={"openai": provider.url}
        )
        client = httpx.AsyncClient(transport=transport, timeout=PATIENCE_S * 3)
        first, retry = await _posted_and_joined(client, provider, url, headers)
        await asyncio.wait_for(transport.aclose(), PATIENCE_S * 3)
        return [await asyncio.wait_for(c, PATIENCE_S) for c in (first, retry)]

    answers = asyncio.run(scenario())
    assert len(provider.receipts()) == 1
    (call,) = cli_json("calls", "--ledger", ledger)  # the retry joined: no second call
    assert call["stage"] == "effect_unknown", call
    expected = (504, "effect_unknown", call["call_id"])
    assert [_told(a) for a in answers] == [expected, expected], [a.text for a in answers]
    assert cli_json("verify", "--ledger", ledger)["ok"] is True


def test_a_joined_retry_of_a_retry_starting_as_a_close_cuts_it_off_gets_the_429(
    tmp_path: Path, provider: FakeProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The close stops waiting just as the guard's own retry is being started: that retry
    is recorded ``not_sent`` (the call ``not_sent``), and the joined retry gets the 429
    before it, as the call's caller does. The retry's start is held until the close cuts
    the call off, then let commit."""
    starting, _ = retry_held_until_the_cut(monkeypatch)
    ledger = str(tmp_path / "l.db")
    url = provider.url + "/v1/chat/completions"
    headers = {"content-type": "application/json", "x-fake-behaviour": SLOW_429}

    async def scenario() -> list[httpx.Response]:
        transport = effectguard.AsyncGuardTransport(
            ledger=ledger, upstreams={"openai": provider.url}
        )
        client = httpx.AsyncClient(transport=transport, timeout=PATIENCE_S)
        first, retry = await _posted_and_joined(client, provider, url, headers)
        assert await asyncio.to_thread(starting.wait, PATIENCE_S), "the retry's start"
        await asyncio.wait_for(transport.aclose(), PATIENCE_S * 3)
        return [await asyncio.wait_for(c, PATIENCE_S) for c in (first, retry)]

    answers = asyncio.run(scenario())
    assert [r["status"] for r in provider.receipts()] == [429]
    (call,) = cli_json("calls", "--ledger", ledger)  # the retry joined: no second call
    assert (call["stage"], call["attempts"]) == ("not_sent", 2), call
    expected = (429, "rate_limit_error", call["call_id"])
    assert [_told(a) for a in answers] == [expected, expected], [a.text for a in answers]
    assert cli_json("verify", "--ledger", ledger)["ok"] is True
