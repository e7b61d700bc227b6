"""The proxy's logs, read from a real ``effectguard serve``: one access line per request
(JSON lines with ``--log-format json``), incidents logged once naming the call, levels
honoured, and nothing secret or from a body in any line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from leavekit import leave_with_reset
from observing import wait_for

from effectguard.testing import FakeProvider, fake_provider, running_proxy

pytestmark = pytest.mark.slow

OPENAI_CHAT = "/openai/v1/chat/completions"
CALL_ID = "effectguard-call-id"
ACCESS_FIELDS = {
    "time",
    "level",
    "provider",
    "endpoint",
    "model",
    "budget",
    "status",
    "stage",
    "attempts",
    "upstream_s",
    "overhead_s",
}
PROMPT_CANARY = "canary-prompt-7f3a"
KEY_CANARY = "sk-canary-log-client"


@pytest.fixture
def provider(tmp_path: Path) -> Iterator[FakeProvider]:
    """A fake provider process for one test."""
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        yield fake


def chat(content: str = "hello", **extra: Any) -> dict[str, Any]:
    """An OpenAI chat completion request body."""
    return {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        **extra,
    }


def json_lines(log: str) -> list[dict[str, Any]]:
    """Every log line that is a JSON object (the start line is plain text), parsed."""
    return [json.loads(line) for line in log.splitlines() if line.startswith("{")]


def _config(tmp_path: Path, extra: str = "") -> list[str]:
    path = tmp_path / "config.toml"
    path.write_text(f'[upstream]\nread_timeout_s = 0.5\n[budgets]\n"poor" = "0.000000001"\n{extra}')
    return ["--config", str(path)]


def test_json_access_lines_name_every_call_and_hold_no_secret(
    tmp_path: Path, provider: FakeProvider
) -> None:
    """Each request gets one valid JSON access line with every field (call_id and cost_usd
    absent, not null, where there is none); a 504 is a warning that names the call, its
    interrupt is logged once, and no key or prompt is logged."""
    args = [*_config(tmp_path), "--log-format", "json"]
    ledger = tmp_path / "ledger.db"
    upstreams = {"openai": provider.url}
    headers = {"Authorization": f"Bearer {KEY_CANARY}"}
    with running_proxy(ledger, upstreams=upstreams, args=args) as proxy:
        client = httpx.Client(base_url=proxy.url, headers=headers, timeout=10)
        done = client.post(OPENAI_CHAT, json=chat(PROMPT_CANARY))
        with client.stream("POST", OPENAI_CHAT, json=chat(stream=True)) as streamed:
            streamed.read()
        poor = client.post(OPENAI_CHAT, json=chat(), headers={"Effectguard-Budget": "poor"})
        slow = client.post(OPENAI_CHAT, json=chat("slow"), headers={"x-fake-delay": "1.5"})
        models = client.get("/openai/v1/models")
        client.close()
    assert (done.status_code, poor.status_code, slow.status_code) == (200, 402, 504)
    assert models.status_code == 200
    lines = json_lines(proxy.log())
    access = [line for line in lines if line.get("event") == "access"]
    assert len(access) == 5, [(a["status"], a["endpoint"]) for a in access]
    for line in access:
        assert line.keys() >= ACCESS_FIELDS, line
    by_status = {line["status"]: line for line in access}
    completed = [line for line in access if line["stage"] == "completed"]
    assert {line["call_id"] for line in completed} == {
        done.headers[CALL_ID],
        streamed.headers[CALL_ID],
    }
    assert all(line["cost_usd"] and line["attempts"] == 1 for line in completed)
    assert by_status[402]["stage"] == "refused" and by_status[402]["error"] == "budget_exceeded"
    timeout = by_status[504]
    assert timeout["call_id"] == slow.headers[CALL_ID]
    assert (timeout["level"], timeout["stage"], timeout["error"]) == (
        "warning",
        "effect_unknown",
        "effect_unknown",
    )
    # The read timeout (0.5 s) is timed by aiohttp from its own start, a little before the
    # guard stamps the send; the log must show that wait, not when it began to the microsecond.
    assert timeout["upstream_s"] >= 0.45
    assert [line["stage"] for line in access if line["endpoint"] == "/v1/models"] == ["read_only"]
    # Nothing settled, no call made: the field is absent, never null (logs-and-traces.md).
    assert "cost_usd" not in by_status[402] and "cost_usd" not in by_status[504]
    assert not [
        line for line in access if None in (line.get("call_id", 0), line.get("cost_usd", 0))
    ]
    interrupts = [line for line in lines if line.get("event") == "interrupted"]
    assert [line["call_id"] for line in interrupts] == [slow.headers[CALL_ID]]
    assert KEY_CANARY not in proxy.log() and PROMPT_CANARY not in proxy.log()


def test_a_client_that_left_before_its_answer_is_logged_499(
    tmp_path: Path, provider: FakeProvider
) -> None:
    """A client that gives up after 0.3 s on an answer that takes 1 s, its connection reset
    (a plain close is answered as a half-close, contract §3.8): its access line says
    499 (the call is completed, and logged so), once the answer would have been written.
    A client that stayed gets 200 in its line. The line used to be written before the
    answer was, and said 200 for a client that had left."""
    path = tmp_path / "config.toml"
    path.write_text("[upstream]\nread_timeout_s = 30\n")
    args = ["--config", str(path), "--log-format", "json"]
    upstreams = {"openai": provider.url}
    with running_proxy(tmp_path / "ledger.db", upstreams=upstreams, args=args) as proxy:
        slow = {"x-fake-delay": "1"}
        url = proxy.url + OPENAI_CHAT
        leave_with_reset(proxy.url, OPENAI_CHAT, chat("left"), slow, 0.3)
        stayed = httpx.post(url, json=chat("stayed"), headers=slow, timeout=10)
        assert stayed.status_code == 200

        def both() -> list[dict[str, Any]]:
            lines = [x for x in json_lines(proxy.log()) if x.get("event") == "access"]
            return lines if len(lines) == 2 else []

        access = wait_for(both, 10, "two access lines")
    by_call = {line["call_id"]: line for line in access}
    assert by_call[stayed.headers[CALL_ID]]["status"] == 200
    (left,) = [line for call, line in by_call.items() if call != stayed.headers[CALL_ID]]
    assert (left["status"], left["stage"], left["outcome"]) == (499, "completed", "completed")


def test_a_stream_whose_client_left_is_logged_499_when_it_settles(
    tmp_path: Path, provider: FakeProvider
) -> None:
    """A streaming client that gives up before the stream's first byte, its connection
    reset (a plain close is answered as a half-close, contract §3.8): the proxy stops
    forwarding, reads the stream to its end itself, and the access line (written when
    the call settles) says 499 and completed. It used to say 200."""
    path = tmp_path / "config.toml"
    path.write_text("[upstream]\nread_timeout_s = 30\n")
    args = ["--config", str(path), "--log-format", "json"]
    upstreams = {"openai": provider.url}
    with running_proxy(tmp_path / "ledger.db", upstreams=upstreams, args=args) as proxy:
        leave_with_reset(proxy.url, OPENAI_CHAT, chat(stream=True), {"x-fake-delay": "1"}, 0.3)

        def settled() -> list[dict[str, Any]]:
            return [x for x in json_lines(proxy.log()) if x.get("event") == "access"]

        (line,) = wait_for(settled, 10, "the stream's access line")
    assert (line["status"], line["stage"], line["outcome"]) == (499, "completed", "completed")
    assert line["output_tokens"] == 8 and line["cost_usd"]


def test_text_format_from_config_and_level_warning_keeps_only_incidents(
    tmp_path: Path, provider: FakeProvider
) -> None:
    """``[server] log_format``/``log_level`` apply: text lines, and at warning level a
    success writes no access line while a 504 still does."""
    args = _config(tmp_path, '[server]\nlog_format = "text"\nlog_level = "warning"\n')
    with running_proxy(tmp_path / "l.db", upstreams={"openai": provider.url}, args=args) as proxy:
        ok = httpx.post(proxy.url + OPENAI_CHAT, json=chat(), timeout=10)
        slow = httpx.post(
            proxy.url + OPENAI_CHAT, json=chat(), headers={"x-fake-delay": "1.5"}, timeout=10
        )
    log = proxy.log()
    assert ok.status_code == 200 and slow.status_code == 504
    assert not json_lines(log)
    access = [line for line in log.splitlines() if "effectguard.access" in line]
    assert len(access) == 1
    assert f"call_id={slow.headers[CALL_ID]}" in access[0] and "WARNING" in access[0]
    assert ok.headers[CALL_ID] not in log


def test_sdk_conflict_error_names_the_call_and_the_command(
    tmp_path: Path, provider: FakeProvider
) -> None:
    """Through the openai SDK, the 409 effect_unknown's text names the call id and the
    ``effectguard reconcile`` command; the refusal's access line names the call too."""
    args = [*_config(tmp_path), "--log-format", "json"]
    with running_proxy(tmp_path / "l.db", upstreams={"openai": provider.url}, args=args) as proxy:
        sdk = openai.OpenAI(base_url=proxy.url + "/openai/v1", api_key="sk-x", max_retries=0)
        key = {"Idempotency-Key": "order-1"}
        with pytest.raises(openai.APIStatusError):
            sdk.chat.completions.create(**chat(), extra_headers={**key, "x-fake-delay": "1.5"})
        with pytest.raises(openai.ConflictError) as conflict:
            sdk.chat.completions.create(**chat(), extra_headers=key)
    call_id = conflict.value.response.headers[CALL_ID]
    text = str(conflict.value)
    assert call_id in text
    assert f"effectguard reconcile {call_id}" in text
    assert f"effectguard show {call_id}" in text
    refused = [line for line in json_lines(proxy.log()) if line.get("status") == 409]
    assert [(r["call_id"], r["error"]) for r in refused] == [(call_id, "effect_unknown")]


def test_a_model_not_priced_refusal_logs_the_model_it_named(
    tmp_path: Path, provider: FakeProvider
) -> None:
    """The access line of a 400 model_not_priced names the model the request named (cut
    to 300 characters, as other client-chosen fields are), not null; nothing is sent."""
    args = [*_config(tmp_path), "--log-format", "json"]
    long_name = "gpt-unpriced-" + "x" * 400
    upstreams = {"openai": provider.url}
    with running_proxy(tmp_path / "ledger.db", upstreams=upstreams, args=args) as proxy:
        short = httpx.post(proxy.url + OPENAI_CHAT, json=chat(model="gpt-unpriced-9000"))
        long = httpx.post(proxy.url + OPENAI_CHAT, json=chat(model=long_name))
    assert (short.status_code, long.status_code) == (400, 400)
    access = [line for line in json_lines(proxy.log()) if line.get("event") == "access"]
    assert [line["error"] for line in access] == ["model_not_priced"] * 2
    assert access[0]["model"] == "gpt-unpriced-9000"
    assert len(access[1]["model"]) == 300 and long_name.startswith(access[1]["model"][:-1])
    assert provider.receipts() == []


def test_an_effect_unknown_whose_client_left_is_still_a_warning(
    tmp_path: Path, provider: FakeProvider
) -> None:
    """At ``log_level = "warning"``, a call whose answer was never observed (504
    effect_unknown: money may be spent, an operator is needed) keeps its access line even
    when its client left first and the line says 499. The level used to follow the status
    alone: the line was info, and vanished at warning."""
    args = _config(tmp_path, '[server]\nlog_format = "json"\nlog_level = "warning"\n')
    with running_proxy(tmp_path / "l.db", upstreams={"openai": provider.url}, args=args) as proxy:
        leave_with_reset(proxy.url, OPENAI_CHAT, chat("left"), {"x-fake-delay": "1.5"}, 0.2)

        def access() -> list[dict[str, Any]]:
            return [x for x in json_lines(proxy.log()) if x.get("event") == "access"]

        lines = wait_for(access, 10, "the effect_unknown call's access line at warning")
    assert [(x["level"], x["status"], x["outcome"]) for x in lines] == [
        ("warning", 499, "effect_unknown")
    ], lines
