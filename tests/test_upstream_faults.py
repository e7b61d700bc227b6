"""Upstream faults through a real ``effectguard serve``: each answer the ledger must not
get wrong.

* an upstream that reads the whole request and then drops the connection (aiohttp's
  ``ServerDisconnectedError``): the effect is unknown, sent exactly once, never retried;
* an event stream that ends cleanly (close-delimited, a FIN) before its terminal event:
  a broken stream, never a completed call;
* a provider 5xx on a keyed call: resent or refused as the declaration says, never
  answered with a stored replay of the error.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from edgekit import RawRequest, SocketUpstream

from effectguard.ops.cli import main as cli_main
from effectguard.testing import FakeProvider, fake_provider, running_proxy

pytestmark = pytest.mark.slow

CHAT = "/openai/v1/chat/completions"
MESSAGES = "/anthropic/v1/messages"
CALL_ID = "effectguard-call-id"


def chat(content: str = "hello", **extra: Any) -> dict[str, Any]:
    """An OpenAI chat completion request body."""
    return {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        **extra,
    }


def message(content: str = "hello", **extra: Any) -> dict[str, Any]:
    """An Anthropic Messages request body."""
    return {
        "model": "claude-haiku-4-5",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": content}],
        **extra,
    }


def cli_json(capsys: pytest.CaptureFixture[str], ledger: Path, *args: str) -> Any:
    """``effectguard ARGS --json`` run in-process, parsed; the command must succeed."""
    capsys.readouterr()
    assert cli_main([*args, "--json", "--ledger", str(ledger)]) == 0
    return json.loads(capsys.readouterr().out)


def call_of(capsys: pytest.CaptureFixture[str], ledger: Path, call_id: str) -> dict[str, Any]:
    """One row of ``effectguard calls --json``."""
    rows = {row["call_id"]: row for row in cli_json(capsys, ledger, "calls")}
    return rows[call_id]


def verified(capsys: pytest.CaptureFixture[str], ledger: Path) -> bool:
    """Whether ``effectguard verify`` passes (hash chain, counters, projections)."""
    capsys.readouterr()
    return cli_main(["verify", "--ledger", str(ledger)]) == 0


# -- an upstream that hangs up after reading the request ------------------------------------


class HangUpUpstream(SocketUpstream):
    """A real HTTP upstream that reads each whole request, counts it, then closes the socket.

    No response byte is ever sent: to aiohttp (the proxy's upstream leg) this is
    ``ServerDisconnectedError``, raised *after* the request went out.
    """

    def __init__(self) -> None:
        super().__init__()
        self.received = 0

    def answer(self, conn: socket.socket, request: RawRequest) -> None:
        self.received += 1  # one serving thread: no lock needed


def test_upstream_hanging_up_after_the_request_is_effect_unknown_and_sent_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A disconnect after the whole request was read: 502 effect_unknown, one receipt, held."""
    ledger = tmp_path / "ledger.db"
    with (
        HangUpUpstream() as upstream,
        running_proxy(ledger, upstreams={"openai": upstream.url}) as proxy,
    ):
        answer = httpx.post(proxy.url + CHAT, json=chat(), timeout=30)
        received = upstream.received
    assert received == 1  # never retried: the provider may be working on it
    assert answer.status_code == 502
    error = answer.json()["error"]
    assert (error["type"], error["stage"], error["next_operation"]) == (
        "effect_unknown",
        "effect_unknown",
        "reconcile",
    )
    assert answer.headers["x-should-retry"] == "false"
    # The message names the real failure: a "ConnectTimeout" would tell the operator who
    # reconciles it that nothing was sent, the opposite of what it means.
    assert "ServerDisconnectedError: " in error["message"], error["message"]
    assert "Connect" not in error["message"], error["message"]
    call = call_of(capsys, ledger, answer.headers[CALL_ID])
    assert (call["stage"], call["attempts"]) == ("effect_unknown", 1)
    assert call["held_usd"] == call["reserved_usd"] != "0"
    assert verified(capsys, ledger)


# -- a stream that ends cleanly before its terminal event ------------------------------------


@pytest.fixture
def cutting(tmp_path: Path) -> Iterator[FakeProvider]:
    """A fake provider that cuts every stream cleanly after two events."""
    with fake_provider(tmp_path / "receipts.jsonl", cut_stream_clean=2) as fake:
        yield fake


@pytest.mark.parametrize(("path", "body"), [(CHAT, chat(stream=True)), (MESSAGES, message())])
def test_stream_closed_cleanly_before_its_terminal_event_is_broken(
    path: str,
    body: dict[str, Any],
    tmp_path: Path,
    cutting: FakeProvider,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An upstream FIN before [DONE]/message_stop: the client's stream errors, effect_unknown."""
    body = {**body, "stream": True}
    ledger = tmp_path / "ledger.db"
    seen = b""
    with running_proxy(ledger, upstreams={"openai": cutting.url, "anthropic": cutting.url}) as px:
        client = httpx.Client(base_url=px.url, timeout=30)
        with (
            pytest.raises(httpx.RemoteProtocolError),
            client.stream("POST", path, json=body) as response,
        ):
            call_id = response.headers[CALL_ID]
            for chunk in response.iter_raw():
                seen += chunk
        client.close()
        log = px.log()
    assert seen.count(b"data: ") == 2  # the two events before the cut were forwarded
    # Cut on purpose, logged as a warning: uvicorn used to add "ASGI callable returned
    # without completing response" at ERROR for every such stream.
    assert f"stream cut off (call {call_id})" in log and "ERROR" not in log, log
    assert b"[DONE]" not in seen and b"message_stop" not in seen
    assert len(cutting.effects()) == 1
    call = call_of(capsys, ledger, call_id)
    assert (call["stage"], call["effect"], call["cost_usd"]) == ("effect_unknown", "unknown", None)
    assert call["held_usd"] == call["reserved_usd"]
    assert verified(capsys, ledger)


def test_stream_that_ends_with_its_terminal_event_still_completes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A close-delimited stream that carries its terminal event is a completed call."""
    ledger = tmp_path / "ledger.db"
    with (
        fake_provider(tmp_path / "receipts.jsonl", cut_stream_clean=100) as fake,
        running_proxy(ledger, upstreams={"openai": fake.url}) as proxy,
        httpx.stream("POST", proxy.url + CHAT, json=chat(stream=True), timeout=30) as response,
    ):
        seen = response.read()
        call_id = response.headers[CALL_ID]
    assert seen.endswith(b"data: [DONE]\n\n")
    assert call_of(capsys, ledger, call_id)["stage"] == "completed"
    assert verified(capsys, ledger)


# -- provider 5xx on a keyed call -----------------------------------------------------------


def reconcile(
    capsys: pytest.CaptureFixture[str], ledger: Path, call_id: str, *decision: str
) -> int:
    """``effectguard reconcile CALL DECISION --note ...`` in-process; its exit code."""
    capsys.readouterr()
    argv = ["reconcile", call_id, *decision, "--note", "checked the provider's logs"]
    return cli_main([*argv, "--by", "test", "--ledger", str(ledger)])


def spent(capsys: pytest.CaptureFixture[str], ledger: Path, path: str = "default") -> str:
    """A budget node's ``spent_usd``."""
    return {row["path"]: row for row in cli_json(capsys, ledger, "budgets")}[path]["spent_usd"]


def test_keyed_resend_after_a_provider_500_is_refused_until_reconciled(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--error-status 500: effect_unknown and held; the keyed resend is 409, never the stored 500.

    Reconciled not applied, the key is free: the resend is a new attempt that completes.
    """
    ledger = tmp_path / "ledger.db"
    key = {"Idempotency-Key": "order-500"}
    with (
        fake_provider(tmp_path / "receipts.jsonl", error_status=500) as fake,
        running_proxy(ledger, upstreams={"openai": fake.url}) as proxy,
        httpx.Client(base_url=proxy.url, timeout=30) as client,
    ):
        first = client.post(CHAT, json=chat(), headers=key)
        assert first.status_code == 500  # the provider's own answer reaches the client
        call_id = first.headers[CALL_ID]
        call = call_of(capsys, ledger, call_id)
        assert (call["stage"], call["cost_usd"]) == ("effect_unknown", None)
        assert call["held_usd"] == call["reserved_usd"]
        again = client.post(CHAT, json=chat(), headers=key)
        assert again.status_code == 409
        assert again.json()["error"]["type"] == "effect_unknown"
        assert "effectguard-replayed" not in again.headers
        assert len(fake.effects()) == 1
        assert reconcile(capsys, ledger, call_id, "--not-applied") == 0
        resent = client.post(CHAT, json=chat(), headers={**key, "x-fake-status": "200"})
        assert resent.status_code == 200 and "effectguard-replayed" not in resent.headers
        assert resent.headers[CALL_ID] == call_id
        assert len(fake.effects()) == 2
    call = call_of(capsys, ledger, call_id)
    assert (call["stage"], call["attempts"], call["held_usd"]) == ("completed", 2, "0.000000000")
    assert verified(capsys, ledger)


def test_keyed_resend_after_a_provider_503_is_a_new_attempt(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--error-status 503 (declared no effect): released; the keyed resend goes out again."""
    ledger = tmp_path / "ledger.db"
    key = {"Idempotency-Key": "order-503"}
    with (
        fake_provider(tmp_path / "receipts.jsonl", error_status=503) as fake,
        running_proxy(ledger, upstreams={"openai": fake.url}) as proxy,
        httpx.Client(base_url=proxy.url, timeout=30) as client,
    ):
        first = client.post(CHAT, json=chat(), headers=key)
        assert first.status_code == 503
        again = client.post(CHAT, json=chat(), headers={**key, "x-fake-status": "200"})
        assert again.status_code == 200 and "effectguard-replayed" not in again.headers
        assert again.headers[CALL_ID] == first.headers[CALL_ID]
        assert len(fake.effects()) == 2
    assert call_of(capsys, ledger, first.headers[CALL_ID])["stage"] == "completed"
    assert verified(capsys, ledger)


def test_a_failed_call_can_be_reconciled_and_its_key_freed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An undeclared 502 is failed and replayed; reconcile corrects its charge both ways."""
    ledger = tmp_path / "ledger.db"
    with (
        fake_provider(tmp_path / "receipts.jsonl", error_status=502) as fake,
        running_proxy(ledger, upstreams={"openai": fake.url}) as proxy,
        httpx.Client(base_url=proxy.url, timeout=30) as client,
    ):
        freed = client.post(CHAT, json=chat("a"), headers={"Idempotency-Key": "a"})
        charged = client.post(CHAT, json=chat("b"), headers={"Idempotency-Key": "b"})
        assert (freed.status_code, charged.status_code) == (502, 502)
        replay = client.post(CHAT, json=chat("a"), headers={"Idempotency-Key": "a"})
        assert replay.headers["effectguard-replayed"] == "true"  # failed: applied, replayed
        a, b = freed.headers[CALL_ID], charged.headers[CALL_ID]
        assert [call_of(capsys, ledger, c)["stage"] for c in (a, b)] == ["failed", "failed"]
        assert reconcile(capsys, ledger, a, "--not-applied") == 0
        assert reconcile(capsys, ledger, b, "--applied", "--cost", "0.000001") == 0
        assert spent(capsys, ledger) == "0.000001000"  # a gave its charge back; b costs C
        resent = client.post(
            CHAT, json=chat("a"), headers={"Idempotency-Key": "a", "x-fake-status": "200"}
        )
        assert resent.status_code == 200 and resent.headers[CALL_ID] == a
        refused = client.post(CHAT, json=chat("b"), headers={"Idempotency-Key": "b"})
        assert refused.json()["error"]["type"] == "reconciled_applied"
        assert len(fake.effects()) == 3
    assert reconcile(capsys, ledger, a, "--applied") == 3  # completed now: nothing to correct
    assert verified(capsys, ledger)
