"""The call path through AsyncGuardTransport against a respx-mocked upstream.

Every row of docs/contract.md §4 (idempotency), every docs/contract.md §6 stage reached through the
transport, transport-error classification (§3.4), tenacity's retry scope,
settlement and usage belief (§3.5, §5), key-less retry detection, the wire
shape of refusals (§9), pass-through, and a tool provider with a declared
idempotency guarantee.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import io
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
import respx

from effectguard import AsyncGuardTransport, GuardSettings
from effectguard.ops.cli import main as cli_main
from effectguard.providers import load_providers
from effectguard.rules.usage import Usage, cost, estimate

OPENAI = "https://api.openai.com"
CHAT_URL = OPENAI + "/v1/chat/completions"
ANTHROPIC = "https://api.anthropic.com"
TOOL = "http://tool.test"
MODEL = "gpt-4o-mini"
PROVIDERS = load_providers([], {"send_email": TOOL})
PRICE = PROVIDERS["openai"].price_for(MODEL)
assert PRICE is not None

MakeTransport = Callable[..., AsyncGuardTransport]
Finish = Callable[[AsyncGuardTransport], Awaitable[None]]


def chat_request(content: str = "hello", max_tokens: int = 10) -> dict[str, Any]:
    """A chat completion request body."""
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
    }


def chat_body(
    prompt: int = 10, completion: int = 5, usage: Any = None, text: str = "hi"
) -> dict[str, Any]:
    """A chat completion response body with the given usage."""
    if usage is None:
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
    body: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
            }
        ],
    }
    if usage != "absent":
        body["usage"] = usage
    return body


def ok(**kw: Any) -> httpx.Response:
    """A 200 chat completion from the upstream."""
    return httpx.Response(200, json=chat_body(**kw))


def reserve_of(request: dict[str, Any]) -> int:
    """The reservation contract.md §5 makes for ``request``: prompt bytes and max tokens, priced."""
    assert PRICE is not None
    return estimate(PRICE, request)


def expected_cost(prompt: int, completion: int) -> int:
    """The declared-price cost of a usage (nano-dollars)."""
    assert PRICE is not None
    return cost(PRICE, Usage(prompt, completion))


async def post(
    client: httpx.AsyncClient,
    body: dict[str, Any] | None = None,
    *,
    key: str | None = None,
    headers: dict[str, str] | None = None,
    url: str = CHAT_URL,
) -> httpx.Response:
    """POST a JSON body through the guarded client."""
    all_headers = dict(headers or {})
    if key is not None:
        all_headers["Idempotency-Key"] = key
    return await client.post(
        url, json=chat_request() if body is None else body, headers=all_headers
    )


def error_of(response: httpx.Response) -> dict[str, Any]:
    """The ``error`` object of a refusal body."""
    detail: dict[str, Any] = response.json()["error"]
    return detail


async def only_call(transport: AsyncGuardTransport) -> Any:
    """The single call in the ledger."""
    calls = await transport.ledger.calls()
    assert len(calls) == 1, calls
    return calls[0]


async def node(transport: AsyncGuardTransport, path: str = "default") -> Any:
    """One budget node."""
    nodes = {n.path: n for n in await transport.ledger.budgets()}
    return nodes[path]


async def kinds(transport: AsyncGuardTransport, call_id: str) -> list[str]:
    """The kinds of a call's events, in order."""
    return [e.kind for e in await transport.ledger.events(call_id)]


# -- docs/contract.md §4: idempotency ---------------------------------------------------------


@respx.mock(base_url=OPENAI)
async def test_new_key_is_admitted_dispatched_and_settled(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """A request with a new Idempotency-Key is dispatched once and completed at its usage cost."""
    route = respx_mock.post("/v1/chat/completions").mock(return_value=ok())
    t = make_transport()
    client = httpx.AsyncClient(transport=t)
    r = await post(client, key="k-new")
    assert r.status_code == 200
    assert r.json() == chat_body()
    assert route.call_count == 1
    # The client's key is the guard's own: it is not forwarded to a provider that declares none.
    assert "idempotency-key" not in route.calls.last.request.headers
    call = await only_call(t)
    assert r.headers["effectguard-call-id"] == call.call_id
    assert (call.stage, call.idempotency_key, call.attempts) == ("completed", "k-new", 1)
    assert call.reserved_at_admission == reserve_of(chat_request())
    assert call.cost == expected_cost(10, 5)
    budget = await node(t)
    assert (budget.reserved, budget.spent, budget.held) == (0, expected_cost(10, 5), 0)
    assert await kinds(t, call.call_id) == [
        "call.manifest",
        "budget.reserved",
        "attempt.started",
        "attempt.observed",
        "budget.settled",
        "call.completed",
    ]
    await finish(t)


@respx.mock(base_url=OPENAI)
async def test_completed_key_same_request_is_replayed_without_upstream_or_charge(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """A completed key with the same request replays the stored response: no call, no charge."""
    route = respx_mock.post("/v1/chat/completions").mock(return_value=ok(text="stored"))
    t = make_transport()
    client = httpx.AsyncClient(transport=t)
    first = await post(client, key="k1")
    spent = (await node(t)).spent
    second = await post(client, key="k1")
    assert route.call_count == 1
    assert second.status_code == 200
    assert second.headers["effectguard-replayed"] == "true"
    assert "effectguard-replayed" not in first.headers
    assert second.headers["effectguard-call-id"] == first.headers["effectguard-call-id"]
    assert second.content == first.content
    assert (await node(t)).spent == spent == expected_cost(10, 5)
    assert (await only_call(t)).attempts == 1
    await finish(t)


@respx.mock(base_url=OPENAI)
async def test_key_reused_for_a_different_request_is_refused_422(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """A key reused with a different request hash answers 422 idempotency_key_reused."""
    route = respx_mock.post("/v1/chat/completions").mock(return_value=ok())
    t = make_transport()
    client = httpx.AsyncClient(transport=t)
    first = await post(client, key="k1")
    second = await post(client, chat_request("something else"), key="k1")
    assert second.status_code == 422
    assert error_of(second)["type"] == "idempotency_key_reused"
    assert second.headers["effectguard-call-id"] == first.headers["effectguard-call-id"]
    assert second.headers["x-should-retry"] == "false"
    assert route.call_count == 1
    await finish(t)


@respx.mock(base_url=OPENAI)
async def test_key_in_flight_is_refused_409_in_progress(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """A key whose call is still in flight answers 409 in_progress and is not dispatched."""
    entered, release = asyncio.Event(), asyncio.Event()

    async def slow(request: httpx.Request) -> httpx.Response:
        entered.set()
        await release.wait()
        return ok()

    route = respx_mock.post("/v1/chat/completions").mock(side_effect=slow)
    t = make_transport()
    client = httpx.AsyncClient(transport=t)
    first = asyncio.create_task(post(client, key="k-busy"))
    await asyncio.wait_for(entered.wait(), 10)
    second = await post(client, key="k-busy")
    release.set()
    first_response = await first
    assert second.status_code == 409
    assert error_of(second)["type"] == "in_progress"
    assert error_of(second)["stage"] == "in_flight"
    assert second.headers["x-should-retry"] == "false"
    assert first_response.status_code == 200
    assert route.call_count == 1
    assert (await only_call(t)).stage == "completed"
    await finish(t)


@respx.mock(base_url=OPENAI)
async def test_key_with_unknown_effect_is_refused_409_effect_unknown(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """A key whose call's effect is unknown answers 409 effect_unknown; openai is never resent."""
    route = respx_mock.post("/v1/chat/completions").mock(
        side_effect=[httpx.ReadTimeout("slow"), ok()]
    )
    t = make_transport()
    client = httpx.AsyncClient(transport=t)
    first = await post(client, key="k-unknown")
    second = await post(client, key="k-unknown")
    assert first.status_code == 504
    assert second.status_code == 409
    detail = error_of(second)
    assert (detail["type"], detail["stage"], detail["next_operation"]) == (
        "effect_unknown",
        "effect_unknown",
        "reconcile",
    )
    assert route.call_count == 1
    assert (await only_call(t)).stage == "effect_unknown"
    await finish(t)


@respx.mock(base_url=OPENAI)
async def test_key_not_sent_is_resumed_as_a_new_attempt(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """A not-sent keyed call is resumed under the same key and call id as attempt 2."""
    route = respx_mock.post("/v1/chat/completions").mock(
        side_effect=[httpx.ConnectError("refused"), ok()]
    )
    t = make_transport(settings=_settings(max_retries=0))
    client = httpx.AsyncClient(transport=t)
    first = await post(client, key="k-ns")
    assert first.status_code == 502
    assert error_of(first)["stage"] == "not_sent"
    assert (await only_call(t)).stage == "not_sent"
    second = await post(client, key="k-ns")
    assert second.status_code == 200
    assert second.headers["effectguard-call-id"] == first.headers["effectguard-call-id"]
    assert route.call_count == 2
    call = await only_call(t)
    assert (call.stage, call.attempts) == ("completed", 2)
    events = await t.ledger.events(call.call_id)
    assert [e.data["attempt"] for e in events if e.kind == "attempt.started"] == [1, 2]
    assert (await node(t)).reserved == 0
    await finish(t)


@respx.mock(base_url=OPENAI)
async def test_key_reconciled_not_applied_is_resumed(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """A call reconciled as not applied is resumed under its key; the hold is released."""
    route = respx_mock.post("/v1/chat/completions").mock(
        side_effect=[httpx.ReadTimeout("slow"), ok()]
    )
    t = make_transport()
    client = httpx.AsyncClient(transport=t)
    first = await post(client, key="k-rna")
    call_id = first.headers["effectguard-call-id"]
    await t.ledger.reconcile(call_id, applied=False, note="provider says no", by="test")
    assert (await t.ledger.call(call_id)).stage == "reconciled_not_applied"
    second = await post(client, key="k-rna")
    assert second.status_code == 200
    assert second.headers["effectguard-call-id"] == call_id
    assert route.call_count == 2
    call = await t.ledger.call(call_id)
    assert (call.stage, call.attempts, call.held) == ("completed", 2, 0)
    budget = await node(t)
    assert (budget.reserved, budget.held, budget.spent) == (0, 0, expected_cost(10, 5))
    await finish(t)


@respx.mock(base_url=OPENAI)
async def test_key_reconciled_applied_is_refused_409(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """A call reconciled as applied refuses its key with 409 reconciled_applied."""
    route = respx_mock.post("/v1/chat/completions").mock(side_effect=[httpx.ReadTimeout("slow")])
    t = make_transport()
    client = httpx.AsyncClient(transport=t)
    first = await post(client, key="k-ra")
    call_id = first.headers["effectguard-call-id"]
    await t.ledger.reconcile(call_id, applied=True, note="seen in dashboard", by="test")
    second = await post(client, key="k-ra")
    assert second.status_code == 409
    assert error_of(second)["type"] == "reconciled_applied"
    assert second.headers["effectguard-call-id"] == call_id
    assert route.call_count == 1
    call = await t.ledger.call(call_id)
    assert (call.stage, call.held, call.cost) == (
        "reconciled_applied",
        0,
        call.reserved_at_admission,
    )
    await finish(t)


@respx.mock(base_url=OPENAI)
async def test_key_of_a_refused_call_stays_free(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """A key whose request was refused for budget is admitted once the budget has room."""
    route = respx_mock.post("/v1/chat/completions").mock(return_value=ok())
    t = make_transport()
    await t.guard()
    await t.ledger.set_limit("team-b", 1)
    client = httpx.AsyncClient(transport=t, headers={"Effectguard-Budget": "team-b"})
    refused = await post(client, key="k-later")
    await t.ledger.set_limit("team-b", None)
    admitted = await post(client, key="k-later")
    assert (refused.status_code, admitted.status_code) == (402, 200)
    assert route.call_count == 1
    stages = sorted(c.stage for c in await t.ledger.calls())
    assert stages == ["completed", "refused"]
    await finish(t)


# -- docs/contract.md §6 stages through the transport ------------------------------------------


@respx.mock(base_url=OPENAI, assert_all_called=False)
async def test_budget_refusal_is_402_and_recorded_refused(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """A request that does not fit its budget answers 402 budget_exceeded; nothing is sent."""
    route = respx_mock.post("/v1/chat/completions").mock(return_value=ok())
    t = make_transport()
    await t.guard()
    await t.ledger.set_limit("team-a", reserve_of(chat_request()) - 1)
    client = httpx.AsyncClient(transport=t)
    r = await post(client, headers={"Effectguard-Budget": "team-a/run-1"})
    assert r.status_code == 402
    detail = error_of(r)
    assert detail["type"] == "budget_exceeded"
    assert "team-a" in detail["message"]
    assert r.headers["x-should-retry"] == "false"
    assert route.call_count == 0
    call = await only_call(t)
    assert r.headers["effectguard-call-id"] == call.call_id
    assert (call.stage, call.effect, call.next_operation) == ("refused", "none", "none")
    budget = await node(t, "team-a")
    assert (budget.reserved, budget.spent, budget.held) == (0, 0, 0)
    await finish(t)


@respx.mock(base_url=OPENAI, assert_all_called=False)
async def test_a_refused_calls_large_body_is_kept_as_its_digest(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish, ledger_path: str
) -> None:
    """A refusal is recorded for audit, but a large body it never sent keeps only its
    SHA-256 (``show`` names it by reference): a client retrying a 40 KB prompt against a
    full budget used to write it to the ledger whole each time. A short body is kept."""
    respx_mock.post("/v1/chat/completions").mock(return_value=ok())
    t = make_transport()
    await t.guard()
    await t.ledger.set_limit("tiny", 1)
    client = httpx.AsyncClient(transport=t)
    large = json.dumps(chat_request("x" * 40_000)).encode()
    headers = {"Effectguard-Budget": "tiny", "content-type": "application/json"}
    refused = await client.post(CHAT_URL, content=large, headers=headers)
    short = await client.post(CHAT_URL, json=chat_request("short"), headers=headers)
    assert (refused.status_code, short.status_code) == (402, 402)
    await finish(t)
    shown = await asyncio.to_thread(_show_json, ledger_path, refused.headers["effectguard-call-id"])
    assert shown["stage"] == "refused"
    assert shown["request"]["body_encoding"] == "sha256"
    assert shown["request"]["sha256"] == hashlib.sha256(large).hexdigest()
    kept = (await asyncio.to_thread(_show_json, ledger_path, short.headers["effectguard-call-id"]))[
        "request"
    ]
    assert kept["messages"][0]["content"] == "short"


def _show_json(ledger: str, call_id: str) -> dict[str, Any]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["show", call_id, "--ledger", ledger, "--json"]) == 0
    shown: dict[str, Any] = json.loads(out.getvalue())
    return shown


@respx.mock(base_url=OPENAI)
async def test_declared_not_processed_status_is_not_processed_and_released(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """A declared not-processed status (429) is stage not_processed with nothing spent."""
    route = respx_mock.post("/v1/chat/completions").mock(
        return_value=httpx.Response(429, json={"error": {"type": "rate_limit"}})
    )
    t = make_transport(settings=_settings(max_retries=0))
    client = httpx.AsyncClient(transport=t)
    r = await post(client)
    assert r.status_code == 429
    assert r.json() == {"error": {"type": "rate_limit"}}
    assert route.call_count == 1
    call = await only_call(t)
    assert (call.stage, call.effect, call.next_operation) == ("not_processed", "none", "resend")
    budget = await node(t)
    assert (budget.reserved, budget.spent, budget.held) == (0, 0, 0)
    await finish(t)


@respx.mock(base_url=OPENAI)
async def test_undeclared_error_status_is_failed_not_retried_and_charged(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """A 502 (undeclared) is stage failed (effect applied), not retried, charged at reservation."""
    route = respx_mock.post("/v1/chat/completions").mock(
        return_value=httpx.Response(502, json={"error": {"message": "boom"}})
    )
    t = make_transport()
    client = httpx.AsyncClient(transport=t)
    r = await post(client)
    assert r.status_code == 502
    assert r.json() == {"error": {"message": "boom"}}
    assert route.call_count == 1
    call = await only_call(t)
    assert (call.stage, call.effect, call.attempts) == ("failed", "applied", 1)
    assert call.cost == call.reserved_at_admission
    assert (await node(t)).reserved == 0
    await finish(t)


@respx.mock(base_url=OPENAI)
async def test_keyed_resend_after_a_transient_500_is_refused_effect_unknown_not_replayed(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """OpenAI declares 500 of unknown effect: held, the resend is 409 effect_unknown, not a 500."""
    route = respx_mock.post("/v1/chat/completions").mock(
        return_value=httpx.Response(500, json={"error": {"message": "boom"}})
    )
    t = make_transport()
    client = httpx.AsyncClient(transport=t)
    first = await post(client, key="k-500")
    assert (first.status_code, first.json()) == (500, {"error": {"message": "boom"}})
    call = await only_call(t)
    assert (call.stage, call.status, call.cost) == ("effect_unknown", 500, None)
    assert call.held == call.reserved_at_admission
    budget = await node(t)
    assert (budget.reserved, budget.spent, budget.held) == (0, 0, call.held)
    again = await post(client, key="k-500")
    assert again.status_code == 409
    assert error_of(again)["type"] == "effect_unknown"
    assert "effectguard-replayed" not in again.headers
    assert route.call_count == 1
    assert (await kinds(t, call.call_id))[-3:] == [
        "attempt.observed",
        "attempt.interrupted",
        "budget.held",
    ]
    await finish(t)


@respx.mock(base_url=OPENAI)
async def test_keyed_resend_after_a_transient_503_is_a_new_attempt(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """OpenAI declares 503 of no effect: released, and the keyed resend is a new attempt."""
    route = respx_mock.post("/v1/chat/completions").mock(
        side_effect=[httpx.Response(503, json={"error": {"message": "slow down"}}), ok()]
    )
    t = make_transport()
    client = httpx.AsyncClient(transport=t)
    first = await post(client, key="k-503")
    assert first.status_code == 503
    call = await only_call(t)
    assert (call.stage, call.reserved, call.held, call.cost) == ("not_processed", 0, 0, None)
    again = await post(client, key="k-503")
    assert again.status_code == 200 and "effectguard-replayed" not in again.headers
    assert again.headers["effectguard-call-id"] == call.call_id
    assert route.call_count == 2
    call = await only_call(t)
    assert (call.stage, call.attempts) == ("completed", 2)
    await finish(t)


EFFECT_UNKNOWN_ERRORS = [
    (httpx.ReadTimeout, 504),
    (httpx.WriteTimeout, 504),
    (httpx.RemoteProtocolError, 502),
    (httpx.WriteError, 502),
    (httpx.ReadError, 502),
]


@pytest.mark.parametrize(("error", "status"), EFFECT_UNKNOWN_ERRORS)
async def test_error_after_send_is_effect_unknown_never_retried_and_held(
    error: type[httpx.TransportError],
    status: int,
    make_transport: MakeTransport,
    finish: Finish,
) -> None:
    """A transport error once the request may be out is effect_unknown: 504/502, one try, held."""
    t = make_transport()
    with respx.mock(base_url=OPENAI) as mock:
        route = mock.post("/v1/chat/completions").mock(side_effect=error)
        client = httpx.AsyncClient(transport=t)
        r = await post(client)
    assert r.status_code == status
    detail = error_of(r)
    assert (detail["type"], detail["stage"], detail["next_operation"]) == (
        "effect_unknown",
        "effect_unknown",
        "reconcile",
    )
    assert r.headers["x-should-retry"] == "false"
    assert route.call_count == 1
    call = await only_call(t)
    assert r.headers["effectguard-call-id"] == call.call_id
    assert (call.stage, call.effect, call.attempts) == ("effect_unknown", "unknown", 1)
    assert call.held == call.reserved_at_admission == reserve_of(chat_request())
    assert call.reserved == 0
    budget = await node(t)
    assert (budget.reserved, budget.spent, budget.held) == (0, 0, call.reserved_at_admission)
    assert "attempt.interrupted" in await kinds(t, call.call_id)
    await finish(t)


class ProcessExit(BaseException):
    """Not an error: what SystemExit or KeyboardInterrupt is to a dispatch."""


async def test_a_dispatch_ended_by_a_process_exit_stays_in_flight_and_close_does_not_wait_for_it(
    make_transport: MakeTransport,
) -> None:
    """An exception that is not an error, raised while the request is out, reaches the
    caller; the ledger keeps the call in flight (nothing is known of it: recovery marks it),
    and closing the transport does not wait its 30 s drain for a dispatch that is over."""
    sent: list[httpx.Request] = []

    def exits(request: httpx.Request) -> httpx.Response:
        sent.append(request)  # respx counts no call that raised a BaseException
        raise ProcessExit

    t = make_transport()
    with respx.mock(base_url=OPENAI, assert_all_called=False) as mock:
        mock.post("/v1/chat/completions").mock(side_effect=exits)
        client = httpx.AsyncClient(transport=t)
        with pytest.raises(ProcessExit):
            await post(client, key="k-exit")
    assert len(sent) == 1
    call = await only_call(t)
    assert (call.stage, call.attempts, call.idempotency_key) == ("in_flight", 1, "k-exit")
    # A bound on a hang (the drain waits 30 s), not a timing claim.
    await asyncio.wait_for(t.aclose(), timeout=10)


@pytest.mark.parametrize("error", [httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout])
async def test_error_before_send_is_not_sent_retried_and_released(
    error: type[httpx.TransportError], make_transport: MakeTransport, finish: Finish
) -> None:
    """A connection that never opened is not_sent: retried by tenacity, every attempt recorded."""
    t = make_transport(settings=_settings(max_retries=2))
    with respx.mock(base_url=OPENAI) as mock:
        route = mock.post("/v1/chat/completions").mock(side_effect=error)
        client = httpx.AsyncClient(transport=t)
        r = await post(client)
    assert r.status_code == 502
    detail = error_of(r)
    assert (detail["stage"], detail["next_operation"]) == ("not_sent", "resend")
    assert route.call_count == 3
    call = await only_call(t)
    assert (call.stage, call.effect, call.attempts) == ("not_sent", "none", 3)
    events = await kinds(t, call.call_id)
    assert events.count("attempt.started") == 3
    assert events.count("attempt.not_sent") == 3
    assert events.count("budget.released") == 3
    budget = await node(t)
    assert (budget.reserved, budget.spent, budget.held) == (0, 0, 0)
    await finish(t)


@respx.mock(base_url=OPENAI)
async def test_not_sent_then_success_completes_on_the_retry(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """A connect error followed by an answer completes the call on its second attempt."""
    route = respx_mock.post("/v1/chat/completions").mock(
        side_effect=[httpx.ConnectError("refused"), ok()]
    )
    t = make_transport()
    client = httpx.AsyncClient(transport=t)
    r = await post(client)
    assert r.status_code == 200
    assert r.json() == chat_body()
    assert route.call_count == 2
    call = await only_call(t)
    assert (call.stage, call.attempts, call.cost) == ("completed", 2, expected_cost(10, 5))
    budget = await node(t)
    assert (budget.reserved, budget.spent, budget.held) == (0, expected_cost(10, 5), 0)
    await finish(t)


# -- tenacity: only not-sent and declared retry statuses ---------------------------


@respx.mock(base_url=OPENAI)
async def test_declared_retry_status_is_retried_up_to_max_retries(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """A 429 is retried max_retries times, each a new recorded attempt; the last 429 is returned."""
    route = respx_mock.post("/v1/chat/completions").mock(
        return_value=httpx.Response(429, json={"error": {"type": "rate_limit"}})
    )
    t = make_transport(settings=_settings(max_retries=2))
    client = httpx.AsyncClient(transport=t)
    r = await post(client)
    assert r.status_code == 429
    assert route.call_count == 3
    call = await only_call(t)
    assert (call.stage, call.attempts) == ("not_processed", 3)
    events = await t.ledger.events(call.call_id)
    assert [e.data["attempt"] for e in events if e.kind == "attempt.started"] == [1, 2, 3]
    assert [e.data["status"] for e in events if e.kind == "attempt.observed"] == [429] * 3
    budget = await node(t)
    assert (budget.reserved, budget.spent, budget.held) == (0, 0, 0)
    await finish(t)


@respx.mock(base_url=OPENAI)
async def test_declared_retry_status_then_success(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """A 429 followed by a 200 returns the 200, charged once."""
    route = respx_mock.post("/v1/chat/completions").mock(
        side_effect=[httpx.Response(429, json={}), ok()]
    )
    t = make_transport()
    client = httpx.AsyncClient(transport=t)
    r = await post(client)
    assert r.status_code == 200
    assert route.call_count == 2
    call = await only_call(t)
    assert (call.stage, call.attempts, call.cost) == ("completed", 2, expected_cost(10, 5))
    assert (await node(t)).spent == expected_cost(10, 5)
    await finish(t)


@respx.mock(base_url=OPENAI)
async def test_not_processed_status_outside_retry_statuses_is_not_retried(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """A 400 (declared not processed, but not a retry status) is answered after one try."""
    route = respx_mock.post("/v1/chat/completions").mock(
        return_value=httpx.Response(400, json={"error": {"message": "bad"}})
    )
    t = make_transport()
    client = httpx.AsyncClient(transport=t)
    r = await post(client)
    assert r.status_code == 400
    assert route.call_count == 1
    assert (await only_call(t)).stage == "not_processed"
    await finish(t)


# -- settlement and usage belief (docs/contract.md §3.7, §5) -----------------------------------


@respx.mock(base_url=OPENAI)
async def test_overshoot_is_settled_at_actual_cost(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """Usage that costs more than the reservation is spent in full and recorded as overshoot
    (here the input: a chat's framing tokens, which its prompt's bytes do not count, and
    twice the output cap, the most output believed)."""
    respx_mock.post("/v1/chat/completions").mock(return_value=ok(prompt=1000, completion=2))
    t = make_transport()
    request = chat_request(max_tokens=1)
    client = httpx.AsyncClient(transport=t)
    r = await post(client, request)
    assert r.status_code == 200
    call = await only_call(t)
    actual = expected_cost(1000, 2)
    assert call.reserved_at_admission == reserve_of(request)
    assert actual > call.reserved_at_admission
    assert (call.stage, call.cost, call.flagged) == ("completed", actual, None)
    budget = await node(t)
    assert (budget.reserved, budget.spent) == (0, actual)
    settled = [e for e in await t.ledger.events(call.call_id) if e.kind == "budget.settled"]
    assert [(e.data["reserved"], e.data["actual"]) for e in settled] == [
        (call.reserved_at_admission, actual)
    ]
    await finish(t)


UNBELIEVABLE = {
    "negative": {"prompt_tokens": -5, "completion_tokens": 3, "total_tokens": -2},
    "cached_exceeds_input": {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 50},
    },
    "absurd": {"prompt_tokens": 2**60, "completion_tokens": 3, "total_tokens": 2**60 + 3},
    # max_tokens is 10: a provider stops there, so 10^12 is a miscount ($600,000 here).
    "beyond_cap": {"prompt_tokens": 5, "completion_tokens": 10**12, "total_tokens": 10**12 + 5},
    "missing": "absent",
    "not_numbers": {"prompt_tokens": "5", "completion_tokens": 3},
}


@pytest.mark.parametrize("usage", list(UNBELIEVABLE.values()), ids=list(UNBELIEVABLE))
async def test_unbelievable_usage_is_settled_at_reservation_and_flagged(
    usage: Any, make_transport: MakeTransport, finish: Finish
) -> None:
    """Missing, negative, absurd or inconsistent usage: charged at the reservation and flagged."""
    t = make_transport()
    with respx.mock(base_url=OPENAI) as mock:
        mock.post("/v1/chat/completions").mock(return_value=ok(usage=usage))
        client = httpx.AsyncClient(transport=t)
        r = await post(client)
    assert r.status_code == 200
    call = await only_call(t)
    assert call.stage == "completed"
    assert call.cost == call.reserved_at_admission == reserve_of(chat_request())
    assert call.flagged
    assert (await node(t)).spent == call.reserved_at_admission
    await finish(t)


async def test_output_somewhat_past_the_cap_is_charged_and_far_past_it_is_not_believed(
    make_transport: MakeTransport, finish: Finish
) -> None:
    """Output up to twice the request's cap (max_tokens 10) is believed, its overshoot
    charged in full (§5.4); past that the usage is not believed and the call is settled
    at its reservation, flagged with why."""
    t = make_transport()
    usages = [(15, "charged"), (21, "not believed")]
    with respx.mock(base_url=OPENAI) as mock:
        client = httpx.AsyncClient(transport=t)
        for completion, _ in usages:
            usage = {"prompt_tokens": 5, "completion_tokens": completion, "total_tokens": 99}
            mock.post("/v1/chat/completions").mock(return_value=ok(usage=usage))
            assert (await post(client)).status_code == 200
    over, beyond = sorted(await t.ledger.calls(), key=lambda c: c.created_at)
    assert over.flagged is None and over.cost is not None
    assert over.cost > over.reserved_at_admission  # the overshoot, charged
    assert beyond.cost == beyond.reserved_at_admission
    assert beyond.flagged is not None and "beyond the request's output cap" in beyond.flagged
    await finish(t)


@pytest.mark.parametrize("where", ["usage", "elsewhere"])
async def test_an_answer_nested_past_the_parsers_stack_is_passed_on_and_settled_at_reservation(
    where: str, make_transport: MakeTransport, finish: Finish
) -> None:
    """A 200 whose JSON nests 5,000 deep (the decoder's RecursionError was a 500 and left
    the call effect_unknown): the provider answered, so the client gets the answer and the
    call completes at its reservation, flagged, as with no usage."""
    deep = b"[" * 5000 + b"]" * 5000
    body = b'{"id":"chatcmpl-deep","' + where.encode() + b'":' + deep + b"}"
    t = make_transport()
    with respx.mock(base_url=OPENAI) as mock:
        answer = httpx.Response(200, content=body, headers={"content-type": "application/json"})
        mock.post("/v1/chat/completions").mock(return_value=answer)
        client = httpx.AsyncClient(transport=t)
        r = await post(client)
    assert (r.status_code, r.content) == (200, body)
    call = await only_call(t)
    assert call.stage == "completed"
    assert call.cost == call.reserved_at_admission == reserve_of(chat_request())
    assert call.flagged
    await finish(t)


# -- key-less requests and declared retries (docs/contract.md §4) ------------------------------


@respx.mock(base_url=OPENAI)
async def test_identical_keyless_requests_are_independent_work(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """Two identical requests without a key or retry header are two calls, both dispatched."""
    route = respx_mock.post("/v1/chat/completions").mock(return_value=ok())
    t = make_transport()
    client = httpx.AsyncClient(transport=t)
    a, b = await asyncio.gather(post(client), post(client))
    assert (a.status_code, b.status_code) == (200, 200)
    assert a.headers["effectguard-call-id"] != b.headers["effectguard-call-id"]
    assert route.call_count == 2
    assert len(await t.ledger.calls()) == 2
    assert (await node(t)).spent == 2 * expected_cost(10, 5)
    await finish(t)


@respx.mock(base_url=OPENAI)
async def test_sdk_retry_of_in_flight_call_joins_it(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """An x-stainless-retry-count retry of an in-flight call waits for it and gets its body."""
    entered, release = asyncio.Event(), asyncio.Event()

    async def slow(request: httpx.Request) -> httpx.Response:
        entered.set()
        await release.wait()
        return ok(text="once")

    route = respx_mock.post("/v1/chat/completions").mock(side_effect=slow)
    t = make_transport()
    client = httpx.AsyncClient(transport=t)
    first = asyncio.create_task(post(client, headers={"x-stainless-retry-count": "0"}))
    await asyncio.wait_for(entered.wait(), 10)
    retry = asyncio.create_task(post(client, headers={"x-stainless-retry-count": "1"}))
    # Let the retry be admitted (as a join) while the first is still in flight.
    await asyncio.sleep(0.5)
    assert not retry.done()
    release.set()
    a, b = await asyncio.gather(first, retry)
    assert (a.status_code, b.status_code) == (200, 200)
    assert a.content == b.content
    assert a.headers["effectguard-call-id"] == b.headers["effectguard-call-id"]
    assert route.call_count == 1
    call = await only_call(t)
    assert (call.stage, call.cost) == ("completed", expected_cost(10, 5))
    assert (await node(t)).spent == expected_cost(10, 5)
    await finish(t)


@respx.mock(base_url=OPENAI)
async def test_sdk_retry_of_effect_unknown_call_is_refused(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """A declared retry of an effect-unknown call answers 409 effect_unknown without sending."""
    route = respx_mock.post("/v1/chat/completions").mock(
        side_effect=[httpx.ReadTimeout("slow"), ok()]
    )
    t = make_transport()
    client = httpx.AsyncClient(transport=t)
    first = await post(client, headers={"x-stainless-retry-count": "0"})
    retry = await post(client, headers={"x-stainless-retry-count": "1"})
    assert first.status_code == 504
    assert retry.status_code == 409
    assert error_of(retry)["type"] == "effect_unknown"
    assert retry.headers["effectguard-call-id"] == first.headers["effectguard-call-id"]
    assert retry.headers["x-should-retry"] == "false"
    assert route.call_count == 1
    assert len(await t.ledger.calls()) == 1
    await finish(t)


@respx.mock(base_url=OPENAI)
async def test_retry_of_header_names_the_call_it_retries(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """Effectguard-Retry-Of naming an effect-unknown call is refused 409 effect_unknown."""
    route = respx_mock.post("/v1/chat/completions").mock(
        side_effect=[httpx.ReadTimeout("slow"), ok()]
    )
    t = make_transport()
    client = httpx.AsyncClient(transport=t)
    first = await post(client)
    call_id = first.headers["effectguard-call-id"]
    retry = await post(client, headers={"Effectguard-Retry-Of": call_id})
    assert retry.status_code == 409
    assert error_of(retry)["type"] == "effect_unknown"
    assert error_of(retry)["call_id"] == call_id
    assert route.call_count == 1
    await finish(t)


# -- refusals on the wire (docs/contract.md §9) -----------------------------------------------


async def test_refusals_use_each_dialects_error_shape(
    make_transport: MakeTransport, finish: Finish
) -> None:
    """Refusals are OpenAI/Anthropic-shaped errors with the call id and x-should-retry: false."""
    t = make_transport()
    await t.guard()
    await t.ledger.set_limit("tiny", 1)
    with respx.mock(assert_all_called=False) as mock:
        openai_route = mock.post(CHAT_URL).mock(return_value=ok())
        anthropic_route = mock.post(ANTHROPIC + "/v1/messages").mock(return_value=ok())
        client = httpx.AsyncClient(transport=t, headers={"Effectguard-Budget": "tiny"})
        o = await post(client)
        a = await client.post(
            ANTHROPIC + "/v1/messages",
            json={
                "model": "claude-haiku-4-5",
                "max_tokens": 100,
                "messages": [{"role": "user", "content": "hi"}],
            },
        )
    assert openai_route.call_count == anthropic_route.call_count == 0
    for r in (o, a):
        assert r.status_code == 402
        assert r.headers["x-should-retry"] == "false"
        assert r.headers["content-type"] == "application/json"
    o_body, a_body = o.json(), a.json()
    assert set(o_body) == {"error"}
    assert o_body["error"]["type"] == o_body["error"]["code"] == "budget_exceeded"
    assert o_body["error"]["call_id"] == o.headers["effectguard-call-id"]
    assert a_body["type"] == "error"
    assert a_body["error"]["type"] == "budget_exceeded"
    assert a_body["error"]["call_id"] == a.headers["effectguard-call-id"]
    assert isinstance(a_body["error"]["message"], str)
    await finish(t)


async def _assert_nothing_recorded(t: AsyncGuardTransport) -> None:
    assert await t.ledger.calls() == []
    assert all((n.reserved, n.spent, n.held) == (0, 0, 0) for n in await t.ledger.budgets())


@respx.mock(base_url=OPENAI, assert_all_called=False)
async def test_malformed_json_is_400_with_nothing_reserved_or_sent(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """A body that is not JSON answers 400 before admission: no call, no reservation, no send."""
    route = respx_mock.post("/v1/chat/completions").mock(return_value=ok())
    t = make_transport()
    client = httpx.AsyncClient(transport=t)
    r = await client.post(
        CHAT_URL,
        content=b'{"model": "gpt-4o-mini", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400
    assert error_of(r)["type"] == "invalid_request"
    assert r.headers["x-should-retry"] == "false"
    assert route.call_count == 0
    await _assert_nothing_recorded(t)
    await finish(t)


@respx.mock(base_url=OPENAI, assert_all_called=False)
async def test_unpriced_model_is_refused_400(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """A model with no declared price answers 400 model_not_priced and is not sent."""
    route = respx_mock.post("/v1/chat/completions").mock(return_value=ok())
    t = make_transport()
    client = httpx.AsyncClient(transport=t)
    r = await post(client, {**chat_request(), "model": "gpt-unknown-9"})
    assert r.status_code == 400
    assert error_of(r)["type"] == "model_not_priced"
    assert "gpt-unknown-9" in error_of(r)["message"]
    assert route.call_count == 0
    await _assert_nothing_recorded(t)
    await finish(t)


@respx.mock(base_url=OPENAI, assert_all_called=False)
async def test_a_request_naming_no_model_is_told_so(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """A billable request without a model, to an endpoint with no per-call price, is
    refused saying it names no model (it said "model None has no declared price")."""
    route = respx_mock.post("/v1/chat/completions").mock(return_value=ok())
    t = make_transport()
    client = httpx.AsyncClient(transport=t)
    body = {k: v for k, v in chat_request().items() if k != "model"}
    r = await post(client, body)
    assert r.status_code == 400
    assert error_of(r)["type"] == "model_not_priced"
    assert "names no model" in error_of(r)["message"] and "None" not in error_of(r)["message"]
    assert route.call_count == 0
    await _assert_nothing_recorded(t)
    await finish(t)


@pytest.mark.parametrize("budget", ["../etc", "team a", "a//b", "/root", "x" * 65, ""])
async def test_invalid_budget_header_is_refused_400(
    budget: str, make_transport: MakeTransport, finish: Finish
) -> None:
    """An Effectguard-Budget header that is not a valid budget path answers 400 (an empty
    one too: taken as absent, it would quietly spend the transport's own budget)."""
    t = make_transport()
    with respx.mock(base_url=OPENAI, assert_all_called=False) as mock:
        route = mock.post("/v1/chat/completions").mock(return_value=ok())
        client = httpx.AsyncClient(transport=t)
        r = await post(client, headers={"Effectguard-Budget": budget})
    assert r.status_code == 400
    assert error_of(r)["type"] == "invalid_budget"
    assert route.call_count == 0
    await _assert_nothing_recorded(t)
    await finish(t)


async def test_an_invalid_budget_is_not_echoed_whole(
    make_transport: MakeTransport, finish: Finish
) -> None:
    """A 30,000-character budget header is refused 400 naming its start, not repeated
    whole (the answer grew with the input, up to the header-size cap)."""
    t = make_transport()
    with respx.mock(base_url=OPENAI, assert_all_called=False) as mock:
        route = mock.post("/v1/chat/completions").mock(return_value=ok())
        client = httpx.AsyncClient(transport=t)
        r = await post(client, headers={"Effectguard-Budget": "x" * 30_000})
    assert r.status_code == 400 and error_of(r)["type"] == "invalid_budget"
    assert f"invalid budget path '{'x' * 80}…'" in error_of(r)["message"]
    assert len(r.content) < 1000 and route.call_count == 0
    await finish(t)


# -- pass-through ---------------------------------------------------------------


@respx.mock(base_url=OPENAI)
async def test_read_only_endpoint_passes_through_unrecorded(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """GET /v1/models is read-only: forwarded, answered as is, and not written to the ledger."""
    models = {"object": "list", "data": [{"id": MODEL, "object": "model"}]}
    route = respx_mock.get("/v1/models").mock(return_value=httpx.Response(200, json=models))
    t = make_transport()
    client = httpx.AsyncClient(transport=t)
    r = await client.get(OPENAI + "/v1/models")
    assert r.status_code == 200
    assert r.json() == models
    assert "effectguard-call-id" not in r.headers
    assert route.call_count == 1
    await _assert_nothing_recorded(t)
    await finish(t)


@respx.mock(base_url=OPENAI)
async def test_head_of_a_read_only_endpoint_passes_through_unrecorded(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """HEAD /v1/models (a monitoring probe) is what GET of it is, without the body:
    read-only, forwarded and not written to the ledger. It was refused 400 as billable."""
    route = respx_mock.head("/v1/models").mock(return_value=httpx.Response(200))
    t = make_transport()
    client = httpx.AsyncClient(transport=t)
    r = await client.head(OPENAI + "/v1/models")
    assert r.status_code == 200, r.text
    assert "effectguard-call-id" not in r.headers
    assert route.call_count == 1
    await _assert_nothing_recorded(t)
    await finish(t)


async def test_unmatched_host_passes_through_untouched(
    make_transport: MakeTransport, finish: Finish
) -> None:
    """A request to a host no provider declares is forwarded byte for byte and not recorded."""
    t = make_transport()
    body = b"not json at all"
    headers = {"Idempotency-Key": "k", "Effectguard-Budget": "x", "Authorization": "Bearer t"}
    with respx.mock() as mock:
        route = mock.post("https://elsewhere.test/v1/chat/completions").mock(
            return_value=httpx.Response(201, text="fine", headers={"x-up": "1"})
        )
        client = httpx.AsyncClient(transport=t)
        r = await client.post(
            "https://elsewhere.test/v1/chat/completions", content=body, headers=headers
        )
    assert (r.status_code, r.text, r.headers["x-up"]) == (201, "fine", "1")
    assert "effectguard-call-id" not in r.headers
    assert route.call_count == 1
    sent = route.calls.last.request
    assert sent.content == body
    for name, value in headers.items():
        assert sent.headers[name] == value
    await _assert_nothing_recorded(t)
    await finish(t)


# -- a tool provider with a declared idempotency guarantee --------------------------


SEND = TOOL + "/v1/send"
EMAIL = {"to": "ops@example.com", "subject": "hello", "text": "hi"}


def _tool_transport(make_transport: MakeTransport) -> AsyncGuardTransport:
    return make_transport(upstreams={"send_email": TOOL})


@respx.mock(base_url=TOOL)
async def test_tool_provider_sends_declared_idempotency_header_and_charges_per_call(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """send_email gets one Idempotency-Key (the call's id, never the client's key) and is
    charged its per-call price."""
    route = respx_mock.post("/v1/send").mock(return_value=httpx.Response(200, json={"id": "m1"}))
    t = _tool_transport(make_transport)
    client = httpx.AsyncClient(transport=t)
    r = await client.post(SEND, json=EMAIL, headers={"Idempotency-Key": "mail-1"})
    keyless = await client.post(SEND, json=EMAIL)
    assert (r.status_code, keyless.status_code) == (200, 200)
    assert route.call_count == 2
    assert route.calls[0].request.headers.get_list("idempotency-key") == [
        r.headers["effectguard-call-id"]
    ]
    # Without a client key, the provider is given the call's id just the same.
    assert route.calls[1].request.headers.get_list("idempotency-key") == [
        keyless.headers["effectguard-call-id"]
    ]
    per_call = PROVIDERS["send_email"].models["default"].per_call
    assert per_call
    assert (await node(t)).spent == 2 * per_call
    await finish(t)


@respx.mock(base_url=TOOL)
async def test_tool_provider_effect_unknown_keyed_call_is_resent_with_same_key(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """An effect-unknown send_email call is resent inside the window, with the same provider key."""
    route = respx_mock.post("/v1/send").mock(
        side_effect=[httpx.ReadTimeout("slow"), httpx.Response(200, json={"id": "m1"})]
    )
    t = _tool_transport(make_transport)
    client = httpx.AsyncClient(transport=t)
    first = await client.post(SEND, json=EMAIL, headers={"Idempotency-Key": "mail-2"})
    second = await client.post(SEND, json=EMAIL, headers={"Idempotency-Key": "mail-2"})
    assert first.status_code == 504
    assert second.status_code == 200
    assert second.headers["effectguard-call-id"] == first.headers["effectguard-call-id"]
    assert route.call_count == 2
    call_id = first.headers["effectguard-call-id"]
    assert [c.request.headers.get_list("idempotency-key") for c in route.calls] == [
        [call_id],
        [call_id],
    ]
    call = await only_call(t)
    assert (call.stage, call.attempts) == ("completed", 2)
    await finish(t)


@respx.mock(base_url=TOOL)
async def test_tool_provider_resend_that_completes_releases_the_hold(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """After a provider-deduplicated resend completes, the call is charged once, holds nothing."""
    route = respx_mock.post("/v1/send").mock(
        side_effect=[httpx.ReadTimeout("slow"), httpx.Response(200, json={"id": "m1"})]
    )
    t = _tool_transport(make_transport)
    client = httpx.AsyncClient(transport=t)
    await client.post(SEND, json=EMAIL, headers={"Idempotency-Key": "mail-3"})
    second = await client.post(SEND, json=EMAIL, headers={"Idempotency-Key": "mail-3"})
    assert second.status_code == 200
    assert route.call_count == 2
    per_call = PROVIDERS["send_email"].models["default"].per_call
    call = await only_call(t)
    budget = await node(t)
    # The provider applied the operation once (same key, inside its window): one charge.
    assert (call.held, budget.held) == (0, 0)
    assert budget.spent == per_call
    await finish(t)


@respx.mock(base_url=TOOL)
async def test_tool_provider_resend_fits_the_budget_that_admitted_the_original(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """A provider-deduplicated resend is not refused for the hold it is about to release."""
    route = respx_mock.post("/v1/send").mock(
        side_effect=[httpx.ReadTimeout("slow"), httpx.Response(200, json={"id": "m1"})]
    )
    per_call = PROVIDERS["send_email"].models["default"].per_call
    assert per_call
    t = _tool_transport(make_transport)
    await t.guard()
    await t.ledger.set_limit("mail", per_call + per_call // 2)
    client = httpx.AsyncClient(transport=t, headers={"Effectguard-Budget": "mail"})
    first = await client.post(SEND, json=EMAIL, headers={"Idempotency-Key": "mail-4"})
    second = await client.post(SEND, json=EMAIL, headers={"Idempotency-Key": "mail-4"})
    assert (first.status_code, second.status_code) == (504, 200)
    assert route.call_count == 2
    budget = await node(t, "mail")
    assert (budget.reserved, budget.held, budget.spent) == (0, 0, per_call)
    await finish(t)


@respx.mock(base_url=OPENAI)
async def test_openai_effect_unknown_keyed_call_is_not_resent(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish
) -> None:
    """OpenAI declares no idempotency: its effect-unknown keyed call is refused, not resent."""
    route = respx_mock.post("/v1/chat/completions").mock(side_effect=[httpx.ReadTimeout("x"), ok()])
    t = make_transport(upstreams={"send_email": TOOL})
    client = httpx.AsyncClient(transport=t)
    await post(client, key="same")
    second = await post(client, key="same")
    assert second.status_code == 409
    assert route.call_count == 1
    await finish(t)


def _settings(**kw: Any) -> GuardSettings:
    """Fast guard settings with some fields changed."""
    return dataclasses.replace(GuardSettings(retry_wait_s=0, retry_wait_max_s=0), **kw)
