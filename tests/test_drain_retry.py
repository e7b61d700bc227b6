"""A shutdown that ends while the guard waits to retry a declared not-processed status
(contract.md §3.5): the provider was reached and answered, so the client gets that
answer, never 503 ``shutting_down`` ("nothing was sent").

The provider answers 429 (declared not processed, a retry status); the guard backs off
``retry_wait_s`` (60 s here, far longer than the drain) before its retry. The shutdown
(``serve``'s SIGTERM drain, a transport's ``aclose()`` or ``close()``) ends while it
waits. Until 2026-12-05 the client got 503 ``shutting_down`` saying the call had not been
processed, and its SDK sent the work again. A retry started just as the shutdown cuts the
call off, or refused by a second signal before it is sent, is recorded ``not_sent`` and
answers the 429 too. Effects are counted with the fake provider's receipts.
"""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import threading
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
from effectguard.callpath.runtime import Runtime, RuntimeConfig
from effectguard.config.settings import GuardSettings
from effectguard.ingress.transport import CLOSED_MID_CALL
from effectguard.providers import load_providers
from effectguard.testing import FakeProvider, fake_provider, running_proxy

pytestmark = pytest.mark.slow

LIMITED = "status=429"
#: Far longer than any drain here: the shutdown always ends during the back-off.
BACK_OFF_S = 60


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


def _resting_after_the_429(ledger: str, call_id: str) -> None:
    """The call as the 429 left it: not processed, one attempt, its reservation released;
    ``show`` says so and tells to resend."""
    (call,) = cli_json("calls", "--ledger", ledger)
    assert call["call_id"] == call_id, call
    assert (call["stage"], call["attempts"], call["status"]) == ("not_processed", 1, 429), call
    assert call["held_usd"] == "0.000000000", call
    shown = cli_json("show", call_id, "--ledger", ledger)
    assert shown["next_operation"] == "resend", shown
    kinds = [e["kind"] for e in shown["events"]]
    assert kinds[-3:] == ["attempt.observed", "budget.released", "call.completed"], kinds
    (node,) = [b for b in cli_json("budgets", "--ledger", ledger) if b["path"] == "default"]
    assert node["reserved_usd"] == "0.000000000", node
    assert cli_json("verify", "--ledger", ledger)["ok"] is True


def test_a_drain_ending_during_the_back_off_answers_the_providers_429(
    tmp_path: Path, provider: FakeProvider
) -> None:
    """SIGTERM while the guard waits to retry the provider's 429, the drain (1 s) ending
    first: the client gets that 429 as the provider sent it, with the call id."""
    ledger = str(tmp_path / "l.db")
    config = tmp_path / "c.toml"
    config.write_text(
        f"[server]\ndrain_timeout_s = 1\n[guard]\nretry_wait_s = {BACK_OFF_S}\nmax_retries = 2\n"
    )
    args = ["--config", str(config)]
    with running_proxy(
        ledger, upstreams={"openai": provider.url}, args=args, log_path=tmp_path / "p.log"
    ) as proxy:
        waiting = request_under_way(proxy, "limited", f"x-fake-behaviour: {LIMITED}\r\n")
        wait_for(lambda: provider.receipts(), PATIENCE_S, "the 429's receipt")
        (call,) = wait_for(
            lambda: [c for c in cli_json("calls", "--ledger", ledger) if c["status"] == 429],
            PATIENCE_S,
            "the 429 recorded: the guard waits to retry",
        )
        proxy.kill(signal.SIGTERM)
        answer = whole_answer_on(waiting)
        assert proxy.process.wait(PATIENCE_S) == 0
        log = proxy.log()
    assert answer is not None, log
    assert answer.status == 429, (answer, log)
    assert answer.json()["error"]["type"] == "rate_limit_error", answer
    assert answer.headers["effectguard-call-id"] == call["call_id"], answer.headers
    assert " 429 event=access" in log, log  # its access line says what the client got
    assert [r["status"] for r in provider.receipts()] == [429]  # no retry went out
    _resting_after_the_429(ledger, call["call_id"])


def test_a_transport_closing_during_the_back_off_answers_the_providers_429(
    tmp_path: Path, provider: FakeProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``aclose()`` while the guard waits to retry the provider's 429, its wait for the
    calls under way (made 1 s) ending first: the caller gets that 429."""
    monkeypatch.setattr(effectguard.config.defaults, "DRAIN_TIMEOUT_S", 1.0)
    ledger = str(tmp_path / "l.db")
    url = provider.url + "/v1/chat/completions"

    async def scenario() -> httpx.Response:
        transport = effectguard.AsyncGuardTransport(
            ledger=ledger,
            upstreams={"openai": provider.url},
            settings=GuardSettings(retry_wait_s=BACK_OFF_S),
        )
        client = httpx.AsyncClient(transport=transport, timeout=PATIENCE_S)
        headers = {"content-type": "application/json", "x-fake-behaviour": LIMITED}
        call = asyncio.ensure_future(client.post(url, content=chat("limited"), headers=headers))
        while not _observed(ledger):  # the 429 is recorded: the guard waits to retry
            await asyncio.sleep(0.02)
        await asyncio.wait_for(transport.aclose(), PATIENCE_S * 3)
        return await asyncio.wait_for(call, PATIENCE_S)

    answer = asyncio.run(scenario())
    assert answer.status_code == 429, answer.text
    assert answer.json()["error"]["type"] == "rate_limit_error", answer.text
    assert [r["status"] for r in provider.receipts()] == [429]
    _resting_after_the_429(ledger, answer.headers["effectguard-call-id"])


def test_a_sync_transport_closing_during_the_back_off_answers_the_providers_429(
    tmp_path: Path, provider: FakeProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same through the sync transport, its caller in a thread of its own."""
    monkeypatch.setattr(effectguard.config.defaults, "DRAIN_TIMEOUT_S", 1.0)
    ledger = str(tmp_path / "l.db")
    url = provider.url + "/v1/chat/completions"
    transport = effectguard.GuardTransport(
        ledger=ledger,
        upstreams={"openai": provider.url},
        settings=GuardSettings(retry_wait_s=BACK_OFF_S),
    )
    client = httpx.Client(transport=transport, timeout=PATIENCE_S)
    told: list[object] = []

    def call() -> None:
        headers = {"content-type": "application/json", "x-fake-behaviour": LIMITED}
        try:
            told.append(client.post(url, content=chat("limited"), headers=headers))
        except Exception as exc:  # what its caller is told, whatever it is
            told.append(exc)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    wait_for(lambda: _observed(ledger), PATIENCE_S, "the 429 recorded: the guard waits")
    transport.close()
    caller.join(PATIENCE_S)
    assert not caller.is_alive(), "its caller still waits on a closed transport"
    (answer,) = told
    assert isinstance(answer, httpx.Response), answer
    assert answer.status_code == 429, answer.text
    assert [r["status"] for r in provider.receipts()] == [429]
    _resting_after_the_429(ledger, answer.headers["effectguard-call-id"])


def _the_retry_not_sent(ledger: str, call_id: str, reason: str) -> None:
    """The call as a retry started but never sent leaves it: ``not_sent`` after two
    attempts, the second recorded ``attempt.not_sent`` for ``reason``."""
    (call,) = cli_json("calls", "--ledger", ledger)
    assert call["call_id"] == call_id, call
    assert (call["stage"], call["attempts"], call["held_usd"]) == ("not_sent", 2, "0.000000000")
    shown = cli_json("show", call_id, "--ledger", ledger)
    events = shown["events"]
    assert [e["kind"] for e in events][-2:] == ["attempt.not_sent", "budget.released"], events
    assert events[-2]["data"]["reason"] == f"admitted as the process stopped: {reason}", events
    assert cli_json("verify", "--ledger", ledger)["ok"] is True


def test_a_retry_starting_as_a_close_cuts_it_off_is_not_sent_and_answers_the_429(
    tmp_path: Path, provider: FakeProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The close stops waiting just as the guard's retry is being recorded: the retry is
    recorded ``not_sent`` (it was never sent), not left in flight for the cut-off to mark
    effect unknown, and the caller gets the provider's 429. The retry's start is held
    until the close cuts the call off, then let commit."""
    starting, cutting = retry_held_until_the_cut(monkeypatch)
    ledger = str(tmp_path / "l.db")
    url = provider.url + "/v1/chat/completions"

    async def scenario() -> httpx.Response:
        transport = effectguard.AsyncGuardTransport(
            ledger=ledger, upstreams={"openai": provider.url}
        )
        client = httpx.AsyncClient(transport=transport, timeout=PATIENCE_S)
        headers = {"content-type": "application/json", "x-fake-behaviour": LIMITED}
        call = asyncio.ensure_future(client.post(url, content=chat("limited"), headers=headers))
        assert await asyncio.to_thread(starting.wait, PATIENCE_S), "the retry's start"
        await asyncio.wait_for(transport.aclose(), PATIENCE_S * 3)
        assert cutting.is_set()
        return await asyncio.wait_for(call, PATIENCE_S)

    answer = asyncio.run(scenario())
    assert answer.status_code == 429, answer.text
    assert answer.json()["error"]["type"] == "rate_limit_error", answer.text
    assert [r["status"] for r in provider.receipts()] == [429]
    _the_retry_not_sent(ledger, answer.headers["effectguard-call-id"], CLOSED_MID_CALL)


def test_a_retry_a_second_signal_stops_before_it_is_sent_answers_the_429(
    tmp_path: Path,
) -> None:
    """A second signal (``stop_at_once``: nothing is sent from then on) as the provider
    answers 429: the guard's retry is started after its back-off, refused by the stop and
    recorded ``not_sent``; its caller gets the provider's 429, not 503 ``shutting_down``."""
    upstream = "http://upstream.test"
    ledger = str(tmp_path / "l.db")
    reason = "a second signal stopped the proxy without draining"
    sent: list[httpx.Request] = []

    async def scenario() -> httpx.Response:
        config = RuntimeConfig(
            ledger_url=ledger,
            providers=load_providers([], {"openai": upstream}),
            guard=GuardSettings(retry_wait_s=0.01),
        )
        runtime = Runtime(config)
        guard = await runtime.start()

        async def send(request: httpx.Request) -> httpx.Response:
            sent.append(request)
            guard.stop_at_once(reason)  # as the provider answers
            body = b'{"error": {"type": "rate_limit_error", "message": "slow down"}}'
            return httpx.Response(
                429, headers={"content-type": "application/json"}, stream=httpx.ByteStream(body)
            )

        request = httpx.Request("POST", upstream + "/v1/chat/completions", content=chat("x"))
        try:
            answer = await guard.handle(guard.providers["openai"], request, send)
            await answer.aread()
        finally:
            await runtime.stop()
        return answer

    answer = asyncio.run(scenario())
    assert answer.status_code == 429, answer.text
    assert answer.json()["error"]["type"] == "rate_limit_error", answer.text
    assert len(sent) == 1
    _the_retry_not_sent(ledger, answer.headers["effectguard-call-id"], reason)
