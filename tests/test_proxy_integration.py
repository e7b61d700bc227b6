"""The proxy end to end: ``effectguard serve`` and the fake provider as real processes.

The official ``openai`` and ``anthropic`` SDKs reach the proxy by ``base_url`` alone
(sync and async, streaming and not); every call lands in the ledger at the price the
declaration gives for the usage the provider reported, and the provider's receipt log
agrees. Then: a 300-client race for a budget with room for exactly k calls, tenant
isolation with proxy keys, secrets that never reach the ledger, the log or the CLI,
and a graceful SIGTERM with a request in flight.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from observing import wait_for

from effectguard.config.settings import hash_key
from effectguard.ops.cli import main as cli_main
from effectguard.providers import load_providers
from effectguard.rules.money import nanos_to_usd, usd_to_nanos
from effectguard.rules.usage import Usage, cost
from effectguard.testing import FakeProvider, Proxy, fake_provider, running_proxy

pytestmark = pytest.mark.slow

PROVIDERS = load_providers()
OPENAI_MODEL = "gpt-4o-mini"
ANTHROPIC_MODEL = "claude-haiku-4-5"
OPENAI_CHAT = "/openai/v1/chat/completions"
ANTHROPIC_MESSAGES = "/anthropic/v1/messages"
CALL_ID = "effectguard-call-id"
CLI_TIMEOUT = 30.0


# -- helpers -------------------------------------------------------------------------------
def cli(ledger: str | Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``effectguard ARGS --ledger LEDGER`` as a subprocess (bounded in time)."""
    return subprocess.run(
        [sys.executable, "-m", "effectguard", *args, "--ledger", str(ledger)],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT,
        check=False,
    )


def cli_parallel(
    ledger: str | Path, *commands: list[str]
) -> list[subprocess.CompletedProcess[str]]:
    """Run several ``effectguard`` commands at once (each bounded in time)."""
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "effectguard", *args, "--ledger", str(ledger)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args in commands
    ]
    results = []
    try:
        for process in processes:
            out, err = process.communicate(timeout=CLI_TIMEOUT)
            results.append(subprocess.CompletedProcess(process.args, process.returncode, out, err))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return results


def cli_json(ledger: str | Path, *args: str) -> Any:
    """``effectguard ARGS --json``, parsed; the command must succeed."""
    result = cli(ledger, *args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def calls_by_id(ledger: str | Path) -> dict[str, dict[str, Any]]:
    """``effectguard calls --json`` keyed by call id."""
    return {row["call_id"]: row for row in cli_json(ledger, "calls")}


def budgets_by_path(ledger: str | Path) -> dict[str, dict[str, Any]]:
    """``effectguard budgets --json`` keyed by path."""
    return {row["path"]: row for row in cli_json(ledger, "budgets")}


def usd_cost(provider: str, model: str, usage: Usage) -> str:
    """The declared price of ``usage``, as the decimal string the CLI prints."""
    price = PROVIDERS[provider].price_for(model)
    assert price is not None
    return nanos_to_usd(cost(price, usage))


def seq_of(response_id: str) -> int:
    """The fake provider's receipt number embedded in a response id (``chatcmpl-fake7``)."""
    return int(response_id.rsplit("fake", 1)[1])


def chat(content: str = "hello", **extra: Any) -> dict[str, Any]:
    """An OpenAI chat completion request body."""
    return {
        "model": OPENAI_MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        **extra,
    }


def message(content: str = "hello", **extra: Any) -> dict[str, Any]:
    """An Anthropic Messages request body."""
    return {
        "model": ANTHROPIC_MODEL,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": content}],
        **extra,
    }


def write_config(path: Path, text: str) -> list[str]:
    """Write a ``--config`` TOML file; return the serve arguments naming it."""
    path.write_text(text)
    return ["--config", str(path)]


@pytest.fixture
def provider(tmp_path: Path) -> Iterator[FakeProvider]:
    """A fake provider process for one test."""
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        yield fake


def upstreams(fake: FakeProvider) -> dict[str, str]:
    """Both chat providers pointed at the fake provider."""
    return {"openai": fake.url, "anthropic": fake.url}


def test_a_stream_is_not_shown_the_usage_chunk_its_client_did_not_ask_for(tmp_path: Path) -> None:
    """effectguard asks an OpenAI stream for its usage to price it; the client, which did
    not ask, is not shown that chunk (whose ``choices`` is empty), live or replayed, so the
    SDK's own loop (``chunk.choices[0]`` of every chunk) runs to the end. The ledger keeps
    the provider's answer whole and prices the call from its usage."""
    with (
        fake_provider(tmp_path / "receipts.jsonl") as fake,
        running_proxy(tmp_path / "ledger.db", upstreams=upstreams(fake)) as proxy,
    ):
        oa = openai.OpenAI(base_url=proxy.url + "/openai/v1", api_key="sk-client", max_retries=0)
        body = chat("no usage asked for", stream=True)
        keyed = {"Idempotency-Key": "stream-1"}
        stream = oa.chat.completions.create(**body, extra_headers=keyed)
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream).startswith("ok")
        raw = oa.chat.completions.with_raw_response.create(**body, extra_headers=keyed)
        assert raw.headers["effectguard-replayed"] == "true"
        replayed = list(raw.parse())
        assert replayed and all(c.choices and c.usage is None for c in replayed)
        assert len(fake.effects()) == 1  # the replay reached nobody
        shown = cli_json(tmp_path / "ledger.db", "show", raw.headers[CALL_ID])
        (attempt,) = shown["attempts_detail"]
        assert "usage" in attempt["ended"] and "reservation" not in attempt["ended"], attempt


# -- the SDKs ---------------------------------------------------------------------------------
def _sync_sdk_calls(proxy: Proxy) -> list[dict[str, Any]]:
    """Four calls through the sync SDKs; what each client saw."""
    seen: list[dict[str, Any]] = []
    oa = openai.OpenAI(base_url=proxy.url + "/openai/v1", api_key="sk-client", max_retries=0)
    raw = oa.chat.completions.with_raw_response.create(**chat("sync openai"))
    completion = raw.parse()
    assert completion.usage is not None
    assert completion.choices[0].message.content
    seen.append(
        {
            "call_id": raw.headers[CALL_ID],
            "provider": "openai",
            "model": OPENAI_MODEL,
            "seq": seq_of(completion.id),
            "usage": Usage(completion.usage.prompt_tokens, completion.usage.completion_tokens),
        }
    )
    asked = {"stream_options": {"include_usage": True}}  # asked for: the client is shown it
    raw = oa.chat.completions.with_raw_response.create(
        **chat("sync openai stream", stream=True, **asked)
    )
    chunks = list(raw.parse())
    usage_chunks = [c.usage for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.startswith("ok")
    seen.append(
        {
            "call_id": raw.headers[CALL_ID],
            "provider": "openai",
            "model": OPENAI_MODEL,
            "seq": seq_of(chunks[0].id),
            "usage": Usage(usage_chunks[0].prompt_tokens, usage_chunks[0].completion_tokens),
        }
    )
    oa.close()

    an = anthropic.Anthropic(base_url=proxy.url + "/anthropic", api_key="ak-client", max_retries=0)
    raw_m = an.messages.with_raw_response.create(**message("sync anthropic"))
    msg = raw_m.parse()
    seen.append(
        {
            "call_id": raw_m.headers[CALL_ID],
            "provider": "anthropic",
            "model": ANTHROPIC_MODEL,
            "seq": seq_of(msg.id),
            "usage": Usage(msg.usage.input_tokens, msg.usage.output_tokens),
        }
    )
    raw_s = an.messages.with_raw_response.create(**message("sync anthropic stream", stream=True))
    events = list(raw_s.parse())
    seen.append(_anthropic_stream_seen(raw_s.headers[CALL_ID], events))
    an.close()
    return seen


def _anthropic_stream_seen(call_id: str, events: list[Any]) -> dict[str, Any]:
    """What a client saw of an Anthropic stream: the ids and the usage it reported."""
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    start = events[0].message
    delta = next(e for e in events if e.type == "message_delta")
    return {
        "call_id": call_id,
        "provider": "anthropic",
        "model": ANTHROPIC_MODEL,
        "seq": seq_of(start.id),
        "usage": Usage(start.usage.input_tokens, delta.usage.output_tokens),
    }


async def _async_sdk_calls(proxy: Proxy) -> list[dict[str, Any]]:
    """Four calls through the async SDKs, concurrently; what each client saw."""
    oa = openai.AsyncOpenAI(base_url=proxy.url + "/openai/v1", api_key="sk-c", max_retries=0)
    an = anthropic.AsyncAnthropic(base_url=proxy.url + "/anthropic", api_key="ak-c", max_retries=0)

    async def openai_plain() -> dict[str, Any]:
        raw = await oa.chat.completions.with_raw_response.create(**chat("async openai"))
        completion = raw.parse()
        assert completion.usage is not None
        return {
            "call_id": raw.headers[CALL_ID],
            "provider": "openai",
            "model": OPENAI_MODEL,
            "seq": seq_of(completion.id),
            "usage": Usage(completion.usage.prompt_tokens, completion.usage.completion_tokens),
        }

    async def openai_stream() -> dict[str, Any]:
        raw = await oa.chat.completions.with_raw_response.create(
            **chat("async openai stream", stream=True, stream_options={"include_usage": True})
        )
        chunks = [chunk async for chunk in raw.parse()]
        usage = next(c.usage for c in chunks if c.usage is not None)
        return {
            "call_id": raw.headers[CALL_ID],
            "provider": "openai",
            "model": OPENAI_MODEL,
            "seq": seq_of(chunks[0].id),
            "usage": Usage(usage.prompt_tokens, usage.completion_tokens),
        }

    async def anthropic_plain() -> dict[str, Any]:
        raw = await an.messages.with_raw_response.create(**message("async anthropic"))
        msg = await raw.parse()
        return {
            "call_id": raw.headers[CALL_ID],
            "provider": "anthropic",
            "model": ANTHROPIC_MODEL,
            "seq": seq_of(msg.id),
            "usage": Usage(msg.usage.input_tokens, msg.usage.output_tokens),
        }

    async def anthropic_stream() -> dict[str, Any]:
        raw = await an.messages.with_raw_response.create(
            **message("async anthropic stream", stream=True)
        )
        events = [event async for event in await raw.parse()]
        return _anthropic_stream_seen(raw.headers[CALL_ID], events)

    try:
        return list(
            await asyncio.wait_for(
                asyncio.gather(
                    openai_plain(), openai_stream(), anthropic_plain(), anthropic_stream()
                ),
                timeout=30,
            )
        )
    finally:
        await oa.close()
        await an.close()


def test_sdks_through_the_proxy_are_recorded_at_declared_prices(
    tmp_path: Path, provider: FakeProvider
) -> None:
    """openai/anthropic SDKs (sync, async, stream or not) work by base_url; ledger == receipts."""
    ledger = tmp_path / "ledger.db"
    with running_proxy(ledger, upstreams=upstreams(provider)) as proxy:
        seen = _sync_sdk_calls(proxy)
        seen += asyncio.run(_async_sdk_calls(proxy))
    assert len({s["call_id"] for s in seen}) == 8
    calls = calls_by_id(ledger)
    receipts = {r["seq"]: r for r in provider.receipts()}
    assert len(calls) == 8
    assert sum(c["attempts"] for c in calls.values()) == len(receipts) == 8
    paths = {"openai": "/v1/chat/completions", "anthropic": "/v1/messages"}
    for s in seen:
        row = calls[s["call_id"]]
        assert row["stage"] == "completed"
        assert row["effect"] == "applied"
        assert row["next_operation"] == "none"
        assert row["provider"] == s["provider"]
        assert row["model"] == s["model"]
        assert row["budget"] == "default"
        assert row["attempts"] == 1
        assert row["idempotency_key"] is None
        assert row["held_usd"] == "0.000000000"
        assert Decimal(row["reserved_usd"]) > 0
        assert row["cost_usd"] == usd_cost(s["provider"], s["model"], s["usage"])
        receipt = receipts[s["seq"]]
        assert receipt["path"] == paths[s["provider"]]
        assert receipt["model"] == s["model"]
        assert receipt["status"] == 200
    spent = sum(Decimal(c["cost_usd"]) for c in calls.values())
    default = budgets_by_path(ledger)["default"]
    assert Decimal(default["spent_usd"]) == spent
    assert default["reserved_usd"] == default["held_usd"] == "0.000000000"
    verify = cli(ledger, "verify")
    assert verify.returncode == 0, verify.stdout + verify.stderr


# -- the budget race ---------------------------------------------------------------------------
RACE_CLIENTS = 300
RACE_ROOM = 37


def settled_at_reservation_body() -> bytes:
    """A chat body whose fake-provider usage costs exactly its reservation R.

    The fake provider reports one input token per 4 body bytes and ``max_tokens`` output
    tokens; R bounds input by the prompt's UTF-8 bytes. When the two input counts are equal,
    settling a call neither frees nor takes room, so exactly k admissions fit whatever the
    timing of settlements.
    """
    for size in range(1, 200):
        body = json.dumps(chat("r" * size), separators=(",", ":")).encode()
        if len(body) // 4 == size:
            return body
    raise AssertionError("no body size makes input tokens equal prompt bytes")


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
def test_an_sdk_timeout_shorter_than_the_answer_is_one_effect(
    tmp_path: Path, provider: FakeProvider, sdk: str
) -> None:
    """No key, the SDK's default retries and a 1 s timeout, the provider answering after
    2.5 s: the first try times out and the proxy reads the call to its end; the SDK's
    retries join it or, once settled, get its answer. One receipt, one charged call (the
    retry that came after the call settled was sent again: two effects, two charges)."""
    ledger = tmp_path / "ledger.db"
    delay = {"x-fake-delay": "2.5"}
    with running_proxy(ledger, upstreams=upstreams(provider)) as proxy:
        if sdk == "openai":
            oa = openai.OpenAI(base_url=proxy.url + "/openai/v1", api_key="k", timeout=1.0)
            reply = oa.chat.completions.create(**chat("slow"), extra_headers=delay)
            assert reply.choices[0].message.content
        else:
            an = anthropic.Anthropic(base_url=proxy.url + "/anthropic", api_key="k", timeout=1.0)
            message = an.messages.create(
                model="claude-haiku-4-5",
                max_tokens=16,
                messages=[{"role": "user", "content": "slow"}],
                extra_headers=delay,
            )
            assert message.content
    assert len(provider.receipts()) == 1
    (call,) = calls_by_id(ledger).values()
    assert (call["stage"], call["attempts"]) == ("completed", 1)


def test_a_joined_retry_waits_out_the_owners_automatic_retries(
    tmp_path: Path, provider: FakeProvider
) -> None:
    """The call's first attempt is answered 429 (the provider's not-processed status that
    effectguard retries on its own), the second 200. A declared retry that joined it gets
    the 200, not the passing 429 (which it once got, marked final, while the call went on
    to succeed and be charged)."""
    ledger = tmp_path / "ledger.db"
    body = chat("join through a retry")
    answers: dict[str, httpx.Response] = {}
    with running_proxy(ledger, upstreams=upstreams(provider)) as proxy:
        url = proxy.url + OPENAI_CHAT
        behaviour = {"x-fake-behaviour": "id=j1;times=1;status=429;delay=1.5"}

        def owner() -> None:
            answers["owner"] = httpx.post(url, json=body, headers=behaviour, timeout=30)

        thread = threading.Thread(target=owner)
        thread.start()
        wait_for(lambda: len(provider.receipts()) == 1, 10, what="the first attempt")
        joined = httpx.post(url, json=body, headers={"x-stainless-retry-count": "1"}, timeout=30)
        thread.join()
    assert answers["owner"].status_code == 200, answers["owner"].text
    assert joined.status_code == 200, joined.text
    assert joined.headers["effectguard-replayed"] == "true"
    assert joined.headers[CALL_ID] == answers["owner"].headers[CALL_ID]
    assert [r["status"] for r in provider.effects()] == [429, 200]


def test_300_concurrent_clients_admit_exactly_the_room(
    tmp_path: Path, provider: FakeProvider
) -> None:
    """With room for exactly k reservations, k of 300 concurrent calls pass; the rest get 402."""
    ledger = tmp_path / "ledger.db"
    body = settled_at_reservation_body()
    headers = {"content-type": "application/json", "x-fake-delay": "0.5"}
    with running_proxy(ledger, upstreams=upstreams(provider)) as proxy:
        probe = httpx.post(
            proxy.url + OPENAI_CHAT,
            content=body,
            timeout=10,
            headers={**headers, "Effectguard-Budget": "probe"},
        )
        assert probe.status_code == 200, probe.text
        probe_row = calls_by_id(ledger)[probe.headers[CALL_ID]]
        assert probe_row["cost_usd"] == probe_row["reserved_usd"]  # the premise above
        reserve = usd_to_nanos(probe_row["reserved_usd"])
        limit = nanos_to_usd(reserve * RACE_ROOM)
        set_limit = cli(ledger, "budget", "set", "race", "--limit", limit)
        assert set_limit.returncode == 0, set_limit.stderr
        receipts_before = len(provider.receipts())

        async def race() -> list[httpx.Response]:
            limits = httpx.Limits(max_connections=RACE_CLIENTS, max_keepalive_connections=0)
            async with httpx.AsyncClient(limits=limits, timeout=30) as client:
                return list(
                    await asyncio.gather(
                        *(
                            client.post(
                                proxy.url + OPENAI_CHAT,
                                content=body,
                                headers={**headers, "Effectguard-Budget": "race"},
                            )
                            for _ in range(RACE_CLIENTS)
                        )
                    )
                )

        responses = asyncio.run(asyncio.wait_for(race(), timeout=60))
    statuses = [r.status_code for r in responses]
    assert statuses.count(200) == RACE_ROOM, sorted(set(statuses))
    assert statuses.count(402) == RACE_CLIENTS - RACE_ROOM
    for refused in (r for r in responses if r.status_code == 402):
        assert refused.json()["error"]["type"] == "budget_exceeded"
        assert refused.headers["x-should-retry"] == "false"
    assert len(provider.receipts()) - receipts_before == RACE_ROOM
    calls_out, budgets_out = cli_parallel(ledger, ["calls", "--json"], ["budgets", "--json"])
    calls = [c for c in json.loads(calls_out.stdout) if c["budget"] == "race"]
    stages = [c["stage"] for c in calls]
    assert stages.count("completed") == RACE_ROOM
    assert stages.count("refused") == RACE_CLIENTS - RACE_ROOM
    node = {n["path"]: n for n in json.loads(budgets_out.stdout)}["race"]
    assert node["limit_usd"] == limit
    assert node["reserved_usd"] == node["held_usd"] == "0.000000000"
    assert node["spent_usd"] == limit


# -- tenants ------------------------------------------------------------------------------------
class Tenants:
    """A proxy with two proxy keys, tenant-a and tenant-b."""

    def __init__(self, proxy: Proxy, provider: FakeProvider, key_a: str, key_b: str) -> None:
        self.proxy = proxy
        self.provider = provider
        self.a = {"Authorization": f"Bearer {key_a}"}
        self.b = {"Authorization": f"Bearer {key_b}"}

    def sent(self) -> int:
        """How many requests reached the provider so far."""
        return len(self.provider.receipts())

    def post(self, headers: dict[str, str], body: dict[str, Any], **extra: str) -> httpx.Response:
        """POST a chat completion with ``headers`` and any ``extra`` headers."""
        return httpx.post(
            self.proxy.url + OPENAI_CHAT, json=body, headers={**headers, **extra}, timeout=15
        )


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tenants]:
    """One proxy for the tenant tests, with proxy keys for tenant-a and tenant-b."""
    tmp_path = tmp_path_factory.mktemp("tenants")
    key_a, key_b = "eg-" + secrets.token_urlsafe(24), "eg-" + secrets.token_urlsafe(24)
    args = write_config(
        tmp_path / "config.toml",
        f"""
[budgets]
"tenant-b" = "5.00"

[[keys]]
name = "a"
sha256 = "{hash_key(key_a)}"
budget_root = "tenant-a"

[[keys]]
name = "b"
sha256 = "{hash_key(key_b)}"
budget_root = "tenant-b"
""",
    )
    with (
        fake_provider(tmp_path / "receipts.jsonl") as provider,
        running_proxy(tmp_path / "ledger.db", upstreams=upstreams(provider), args=args) as proxy,
    ):
        yield Tenants(proxy, provider, key_a, key_b)


def test_tenant_cannot_pick_a_budget_outside_its_root(tenants: Tenants) -> None:
    """Tenant A naming a node outside its root gets 403; nothing is reserved or sent."""
    before = (budgets_by_path(tenants.proxy.ledger), tenants.sent())
    for budget in ("tenant-b/run-1", "tenant-b", "elsewhere"):
        response = tenants.post(tenants.a, chat(), **{"Effectguard-Budget": budget})
        assert response.status_code == 403, response.text
        assert response.json()["error"]["type"] == "budget_forbidden"
        assert response.headers["x-should-retry"] == "false"
    assert (budgets_by_path(tenants.proxy.ledger), tenants.sent()) == before
    ok = tenants.post(tenants.a, chat(), **{"Effectguard-Budget": "tenant-a/run-1"})
    assert ok.status_code == 200, ok.text
    assert tenants.sent() == before[1] + 1


def test_unknown_or_missing_proxy_key_is_401(tenants: Tenants) -> None:
    """A request without a known proxy key is refused 401 and sends nothing."""
    before = tenants.sent()
    for headers in ({"Authorization": "Bearer eg-not-a-key"}, {}, {"x-api-key": "eg-nope"}):
        response = tenants.post(headers, chat())
        assert response.status_code == 401, response.text
        assert response.json()["error"]["type"] == "unknown_key"
        assert response.headers["x-should-retry"] == "false"
    assert tenants.sent() == before


def test_a_proxy_key_works_as_each_sdks_api_key(tenants: Tenants) -> None:
    """The openai SDK sends ``api_key`` as a bearer token; the anthropic SDK as
    ``x-api-key`` or, in its 2.x releases, as a bearer token too: both are a proxy key
    (it was refused 401 from the anthropic SDK, its budget check 401 instead of 403)."""
    key_a = tenants.a["Authorization"].removeprefix("Bearer ")
    url = tenants.proxy.url
    oa = openai.OpenAI(base_url=url + "/openai/v1", api_key=key_a, max_retries=0)
    an = anthropic.Anthropic(base_url=url + "/anthropic", api_key=key_a, max_retries=0)
    before = tenants.sent()
    oa.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "k"}])
    message = an.messages.create(
        model="claude-haiku-4-5", max_tokens=8, messages=[{"role": "user", "content": "k"}]
    )
    assert message.content
    assert tenants.sent() == before + 2
    with pytest.raises(anthropic.PermissionDeniedError) as forbidden:
        an.messages.create(
            model="claude-haiku-4-5",
            max_tokens=8,
            messages=[{"role": "user", "content": "k"}],
            extra_headers={"Effectguard-Budget": "tenant-b"},
        )
    assert forbidden.value.status_code == 403
    bearer = httpx.post(
        url + "/anthropic/v1/messages",
        json={"model": "claude-haiku-4-5", "max_tokens": 8, "messages": []},
        headers={"Authorization": "Bearer eg-not-a-key"},
        timeout=15,
    )
    assert bearer.status_code == 401, bearer.text
    assert tenants.sent() == before + 2
    # An auth scheme is case-insensitive (RFC 9110 §11.1): "bearer" was refused 401.
    lower = tenants.post({"Authorization": f"bearer {key_a}"}, chat("lower-case scheme"))
    assert lower.status_code == 200, lower.text


def test_same_idempotency_key_in_two_tenants_is_two_calls(tenants: Tenants) -> None:
    """B's Idempotency-Key used by A is a new call for A, never B's replay."""
    key = {"Idempotency-Key": "shared-key-1"}
    before = tenants.sent()
    first_b = tenants.post(tenants.b, chat("same"), **key)
    assert first_b.status_code == 200, first_b.text
    replay_b = tenants.post(tenants.b, chat("same"), **key)
    assert replay_b.headers.get("effectguard-replayed") == "true"
    assert replay_b.headers[CALL_ID] == first_b.headers[CALL_ID]
    assert tenants.sent() == before + 1
    from_a = tenants.post(tenants.a, chat("same"), **key)
    assert from_a.status_code == 200, from_a.text
    assert from_a.headers.get("effectguard-replayed") is None
    assert from_a.headers[CALL_ID] != first_b.headers[CALL_ID]
    assert from_a.json()["id"] != first_b.json()["id"]
    assert tenants.sent() == before + 2
    calls = calls_by_id(tenants.proxy.ledger)
    assert calls[from_a.headers[CALL_ID]]["budget"] == "tenant-a"
    assert calls[first_b.headers[CALL_ID]]["budget"] == "tenant-b"


def test_tenant_retry_never_joins_another_tenants_call(tenants: Tenants) -> None:
    """A declared retry from A matching B's in-flight call is new work; B's own retry joins."""
    body = chat("in flight")
    results: dict[str, httpx.Response] = {}
    before = tenants.sent()

    def post(name: str, headers: dict[str, str], **extra: str) -> None:
        results[name] = tenants.post(headers, body, **extra)

    first = threading.Thread(target=post, args=("b1", tenants.b), kwargs={"x-fake-delay": "1.5"})
    first.start()
    try:
        deadline = time.monotonic() + 10
        while tenants.sent() == before and time.monotonic() < deadline:
            time.sleep(0.02)
        assert tenants.sent() == before + 1
        retry = {"x-stainless-retry-count": "1"}
        threads = [
            threading.Thread(target=post, args=("b2", tenants.b), kwargs=retry),
            threading.Thread(target=post, args=("a1", tenants.a), kwargs=retry),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
    finally:
        first.join(20)
    assert {name: r.status_code for name, r in results.items()} == {"b1": 200, "b2": 200, "a1": 200}
    assert results["b2"].headers[CALL_ID] == results["b1"].headers[CALL_ID]
    assert results["a1"].headers[CALL_ID] != results["b1"].headers[CALL_ID]
    assert tenants.sent() == before + 2


def test_tenant_spending_never_touches_another_tenants_budget(tenants: Tenants) -> None:
    """A's calls are charged under tenant-a only; tenant-b's counters do not move."""
    b_call = tenants.post(tenants.b, chat("b spends"))
    assert b_call.status_code == 200
    before = budgets_by_path(tenants.proxy.ledger)
    a_calls = [tenants.post(tenants.a, chat(f"a spends {i}")) for i in range(3)]
    assert [r.status_code for r in a_calls] == [200] * 3
    refused = tenants.post(tenants.a, chat("a tries b"), **{"Effectguard-Budget": "tenant-b"})
    assert refused.status_code == 403
    after = budgets_by_path(tenants.proxy.ledger)
    assert after["tenant-b"] == before["tenant-b"]
    assert Decimal(after["tenant-a"]["spent_usd"]) > Decimal(before["tenant-a"]["spent_usd"])
    calls = calls_by_id(tenants.proxy.ledger)
    assert {calls[r.headers[CALL_ID]]["budget"] for r in a_calls} == {"tenant-a"}
    assert calls[b_call.headers[CALL_ID]]["budget"] == "tenant-b"


# -- secrets --------------------------------------------------------------------------------------
PROVIDER_CANARIES = ("sk-canary-provider-openai", "sk-canary-provider-anthropic")
PROMPT_CANARY = "canary-prompt-in-a-body"
CLIENT_CANARIES = ("sk-canary-client-bearer", "sk-canary-client-xapikey", "eg-canary-unknown-key")


def test_secrets_never_reach_ledger_log_or_cli(
    tmp_path: Path, provider: FakeProvider, capsys: pytest.CaptureFixture[str]
) -> None:
    """Provider keys, client credentials and proxy keys never appear in ledger, log or CLI output.

    Over success (plain and streamed), refusals (402/400/404/413/401/403), an upstream read
    timeout (504 effect_unknown) and a broken stream.
    """
    proxy_key = "eg-canary-proxy-" + secrets.token_urlsafe(12)
    args = write_config(
        tmp_path / "config.toml",
        f"""
[server]
max_body_bytes = 4096

[upstream]
read_timeout_s = 1.5

[budgets]
"canary/poor" = "0.000000001"

[[keys]]
name = "canary"
sha256 = "{hash_key(proxy_key)}"
budget_root = "canary"
""",
    )
    env = {"OPENAI_API_KEY": PROVIDER_CANARIES[0], "ANTHROPIC_API_KEY": PROVIDER_CANARIES[1]}
    ledger = tmp_path / "ledger.db"
    creds = {
        "Effectguard-Key": proxy_key,
        "Authorization": f"Bearer {CLIENT_CANARIES[0]}",
        "x-api-key": CLIENT_CANARIES[1],
    }
    statuses: dict[str, int] = {}
    call_ids: set[str] = set()
    snapshots: list[bytes] = []
    args += ["--log-format", "json", "--log-level", "debug"]
    with running_proxy(ledger, upstreams=upstreams(provider), args=args, env=env) as proxy:
        client = httpx.Client(base_url=proxy.url, headers=creds, timeout=10)

        def post(name: str, path: str, **kwargs: Any) -> httpx.Response:
            response = client.post(path, **kwargs)
            statuses[name] = response.status_code
            if CALL_ID in response.headers:
                call_ids.add(response.headers[CALL_ID])
            return response

        post("openai", OPENAI_CHAT, json=chat(PROMPT_CANARY))
        post("anthropic", ANTHROPIC_MESSAGES, json=message(PROMPT_CANARY))
        with client.stream("POST", OPENAI_CHAT, json=chat(stream=True)) as streamed:
            assert b"[DONE]" in streamed.read()
            call_ids.add(streamed.headers[CALL_ID])
        with client.stream("POST", ANTHROPIC_MESSAGES, json=message(stream=True)) as streamed:
            assert b"message_stop" in streamed.read()
            call_ids.add(streamed.headers[CALL_ID])
        post("402", OPENAI_CHAT, json=chat(), headers={"Effectguard-Budget": "canary/poor"})
        post("400", OPENAI_CHAT, content=b"{not json")
        post("404", "/nowhere/v1/chat/completions", json=chat())
        post("413", OPENAI_CHAT, json=chat("x" * 5000))
        post("401", OPENAI_CHAT, json=chat(), headers={"Effectguard-Key": CLIENT_CANARIES[2]})
        post("403", OPENAI_CHAT, json=chat(), headers={"Effectguard-Budget": "other"})
        timeout = post("504", OPENAI_CHAT, json=chat("slow"), headers={"x-fake-delay": "4"})
        assert timeout.json()["error"]["type"] == "effect_unknown"
        with (
            pytest.raises(httpx.TransportError),
            client.stream(
                "POST",
                OPENAI_CHAT,
                json=chat("broken", stream=True),
                headers={"x-fake-break-after": "2"},
            ) as broken,
        ):
            call_ids.add(broken.headers[CALL_ID])
            broken.read()
        client.close()
        snapshots += [p.read_bytes() for p in tmp_path.glob("ledger.db*") if p.is_file()]
    assert statuses == {
        "openai": 200,
        "anthropic": 200,
        "402": 402,
        "400": 400,
        "404": 404,
        "413": 413,
        "401": 401,
        "403": 403,
        "504": 504,
    }
    calls = calls_by_id(ledger)
    assert call_ids <= set(calls)
    assert calls[timeout.headers[CALL_ID]]["stage"] == "effect_unknown"
    unknown = [c for c in calls.values() if c["stage"] == "effect_unknown"]
    assert len(unknown) == 2  # the timeout and the broken stream
    commands = [["calls", "--json"], ["calls"], ["budgets", "--json"]]
    results = cli_parallel(ledger, *commands)
    assert [r.returncode for r in results] == [0] * len(commands)
    outputs = [r.stdout + r.stderr for r in results]
    for call_id in calls:  # show, in-process (the same CLI code, without 10 more processes)
        capsys.readouterr()
        assert cli_main(["show", call_id, "--json", "--ledger", str(ledger)]) == 0
        outputs.append(capsys.readouterr().out)
    snapshots += [p.read_bytes() for p in tmp_path.glob("ledger.db*") if p.is_file()]
    texts = {
        "proxy log": proxy.log().encode(),
        "cli output": "\n".join(outputs).encode(),
        "ledger files": b"\n".join(snapshots),
    }
    assert all(texts.values())
    for where, blob in texts.items():
        for canary in (*PROVIDER_CANARIES, *CLIENT_CANARIES, proxy_key):
            assert canary.encode() not in blob, f"{canary} found in {where}"
    # The log holds one JSON access line per guarded request, and no prompt or answer.
    log_lines = [json.loads(x) for x in proxy.log().splitlines() if x.startswith("{")]
    assert {line.get("call_id") for line in log_lines if line.get("event") == "access"} >= call_ids
    assert PROMPT_CANARY not in proxy.log() and '"content"' not in proxy.log()


# -- graceful shutdown -------------------------------------------------------------------------
def test_sigterm_lets_an_in_flight_call_finish(tmp_path: Path, provider: FakeProvider) -> None:
    """On SIGTERM an in-flight request completes (200), then the proxy exits; nothing in flight."""
    ledger = tmp_path / "ledger.db"
    with running_proxy(ledger, upstreams=upstreams(provider)) as proxy:
        result: dict[str, httpx.Response | BaseException] = {}

        def call() -> None:
            try:
                result["response"] = httpx.post(
                    proxy.url + OPENAI_CHAT, json=chat(), headers={"x-fake-delay": "1"}, timeout=15
                )
            except BaseException as exc:
                result["response"] = exc

        worker = threading.Thread(target=call)
        worker.start()
        try:
            deadline = time.monotonic() + 10
            while not provider.receipts() and time.monotonic() < deadline:
                time.sleep(0.02)
            assert provider.receipts(), "the request never reached the provider"
            proxy.kill(signal.SIGTERM)
        finally:
            worker.join(20)
        returncode = proxy.process.wait(20)
    response = result["response"]
    assert isinstance(response, httpx.Response), response
    assert response.status_code == 200, response.text
    assert returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once drained
    assert cli_json(ledger, "calls", "--state", "in_flight") == []
    assert calls_by_id(ledger)[response.headers[CALL_ID]]["stage"] == "completed"
