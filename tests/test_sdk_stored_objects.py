"""The official SDKs' calls around a generation, through the proxy and the transport.

Reading a stored response, listing stored chat completions, cancelling a background
response, deleting a file, creating or reading an Anthropic message batch: the openai and
anthropic SDKs make these calls beside their generations. Each is declared in the bundled
provider files (docs/contract.md §2.4): a read passes through unrecorded, a change is
guarded as an ``at_most_once`` call at 0 USD. Before they were declared, every body-less
one was refused 400 as a billable request that is not JSON. A background response,
answered before it runs and without usage, is charged its reservation.

Through the proxy (slow: it starts processes), the upstream is a recording server that
answers every request with 200 and JSON, so the SDKs parse an answer; what reached it is
counted there, never from the ledger. Through the transport, the upstream is respx.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import anthropic
import httpx
import openai
import pytest
import respx
from edgekit import Seen, recording_upstream
from observing import cli_json

from effectguard import AsyncGuardTransport
from effectguard.providers import load_providers
from effectguard.testing import Proxy, running_proxy

BATCH_REQUEST = {
    "custom_id": "a",
    "params": {
        "model": "claude-haiku-4-5",
        "max_tokens": 10,
        "messages": [{"role": "user", "content": "x"}],
    },
}


@dataclass
class Env:
    proxy: Proxy
    seen: list[Seen]
    openai: openai.OpenAI
    anthropic: anthropic.Anthropic


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """A proxy whose openai and anthropic upstreams are one recording server."""
    tmp = tmp_path_factory.mktemp("stored")
    with (
        recording_upstream() as (upstream, seen),
        running_proxy(
            tmp / "ledger.db", upstreams={"openai": upstream, "anthropic": upstream}
        ) as proxy,
        openai.OpenAI(base_url=proxy.url + "/openai/v1", api_key="sk-x", max_retries=0) as o,
        anthropic.Anthropic(base_url=proxy.url + "/anthropic", api_key="sk-x", max_retries=0) as a,
    ):
        yield Env(proxy, seen, o, a)


Call = Callable[[Env], Any]

#: (SDK call, the method and path the upstream must see, whether it is an effect)
CASES: list[tuple[str, Call, str, str, bool]] = [
    (
        "responses.retrieve",
        lambda e: e.openai.responses.retrieve("resp_1"),
        "GET",
        "/v1/responses/resp_1",
        False,
    ),
    (
        "responses.input_items.list",
        lambda e: e.openai.responses.input_items.list("resp_1"),
        "GET",
        "/v1/responses/resp_1/input_items",
        False,
    ),
    (
        "responses.cancel",
        lambda e: e.openai.responses.cancel("resp_1"),
        "POST",
        "/v1/responses/resp_1/cancel",
        True,
    ),
    (
        "responses.delete",
        lambda e: e.openai.responses.delete("resp_1"),
        "DELETE",
        "/v1/responses/resp_1",
        True,
    ),
    (
        "chat.completions.list",
        lambda e: e.openai.chat.completions.list(),
        "GET",
        "/v1/chat/completions",
        False,
    ),
    (
        "chat.completions.retrieve",
        lambda e: e.openai.chat.completions.retrieve("cc_1"),
        "GET",
        "/v1/chat/completions/cc_1",
        False,
    ),
    (
        "chat.completions.messages.list",
        lambda e: e.openai.chat.completions.messages.list("cc_1"),
        "GET",
        "/v1/chat/completions/cc_1/messages",
        False,
    ),
    (
        "chat.completions.update",
        lambda e: e.openai.chat.completions.update("cc_1", metadata={"k": "v"}),
        "POST",
        "/v1/chat/completions/cc_1",
        True,
    ),
    (
        "chat.completions.delete",
        lambda e: e.openai.chat.completions.delete("cc_1"),
        "DELETE",
        "/v1/chat/completions/cc_1",
        True,
    ),
    (
        "conversations.create",
        lambda e: e.openai.conversations.create(),
        "POST",
        "/v1/conversations",
        True,
    ),
    (
        "conversations.retrieve",
        lambda e: e.openai.conversations.retrieve("conv_1"),
        "GET",
        "/v1/conversations/conv_1",
        False,
    ),
    (
        "conversations.delete",
        lambda e: e.openai.conversations.delete("conv_1"),
        "DELETE",
        "/v1/conversations/conv_1",
        True,
    ),
    (
        "files.content",
        lambda e: e.openai.files.content("file_1").read(),
        "GET",
        "/v1/files/file_1/content",
        False,
    ),
    ("files.delete", lambda e: e.openai.files.delete("file_1"), "DELETE", "/v1/files/file_1", True),
    ("batches.list", lambda e: e.openai.batches.list(), "GET", "/v1/batches", False),
    (
        "vector_stores.retrieve",
        lambda e: e.openai.vector_stores.retrieve("vs_1"),
        "GET",
        "/v1/vector_stores/vs_1",
        False,
    ),
    (
        "fine_tuning.jobs.list_events",
        lambda e: e.openai.fine_tuning.jobs.list_events("ftjob_1"),
        "GET",
        "/v1/fine_tuning/jobs/ftjob_1/events",
        False,
    ),
    (
        "moderations.create",
        lambda e: e.openai.moderations.create(input="hi", model="omni-moderation-latest"),
        "POST",
        "/v1/moderations",
        False,
    ),
    (
        "anthropic batches.create",
        lambda e: e.anthropic.messages.batches.create(requests=[BATCH_REQUEST]),
        "POST",
        "/v1/messages/batches",
        True,
    ),
    (
        "anthropic batches.list",
        lambda e: e.anthropic.messages.batches.list(),
        "GET",
        "/v1/messages/batches",
        False,
    ),
    (
        "anthropic batches.retrieve",
        lambda e: e.anthropic.messages.batches.retrieve("mb_1"),
        "GET",
        "/v1/messages/batches/mb_1",
        False,
    ),
    (
        "anthropic batches.cancel",
        lambda e: e.anthropic.messages.batches.cancel("mb_1"),
        "POST",
        "/v1/messages/batches/mb_1/cancel",
        True,
    ),
    (
        "anthropic batches.delete",
        lambda e: e.anthropic.messages.batches.delete("mb_1"),
        "DELETE",
        "/v1/messages/batches/mb_1",
        True,
    ),
]


def _calls(env: Env) -> dict[str, dict[str, Any]]:
    return {c["call_id"]: c for c in cli_json("calls", "--ledger", env.proxy.ledger)}


@pytest.mark.slow  # starts the proxy
@pytest.mark.parametrize(
    ("call", "method", "path", "effect"),
    [pytest.param(c, m, p, e, id=name) for name, c, m, p, e in CASES],
)
def test_sdk_call_reaches_the_provider_once_and_only_effects_are_calls(
    env: Env, call: Call, method: str, path: str, effect: bool
) -> None:
    """The SDK call is answered; the upstream saw it once, as sent; a read left no call in
    the ledger, a change left one completed call at 0 USD."""
    seen_before, calls_before = len(env.seen), _calls(env)
    call(env)
    arrived = env.seen[seen_before:]
    assert [(s.method, s.path.partition("?")[0]) for s in arrived] == [(method, path)]
    new = [c for k, c in _calls(env).items() if k not in calls_before]
    if not effect:
        assert new == []
        return
    (made,) = new
    assert (made["stage"], made["status"]) == ("completed", 200), made
    assert Decimal(made["cost_usd"]) == 0 and Decimal(made["held_usd"]) == 0, made


@pytest.mark.slow  # starts the proxy
def test_a_batch_creation_is_flagged_cost_deferred(env: Env) -> None:
    """An Anthropic batch is billed as it runs, apart from its creation: the creation's
    call says so."""
    before = _calls(env)
    env.anthropic.messages.batches.create(requests=[BATCH_REQUEST])
    (made,) = [c for k, c in _calls(env).items() if k not in before]
    assert made["flagged"].startswith("cost deferred"), made


@pytest.mark.slow  # starts the proxy
def test_a_bodiless_request_to_an_undeclared_endpoint_says_why_it_is_refused(env: Env) -> None:
    """A GET the provider file does not list is guarded as billable: without a body it is
    refused 400 with what to do about it; nothing is recorded and nothing is sent."""
    seen_before, calls_before = len(env.seen), _calls(env)
    r = httpx.get(env.proxy.url + "/openai/v1/assistants/asst_1", timeout=10)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "GET /v1/assistants/asst_1 is guarded as billable" in message
    assert "does not declare it" in message and "read_only" in message
    assert len(env.seen) == seen_before
    assert _calls(env) == calls_before  # refused before anything was recorded


# -- the same through the in-process transport ---------------------------------------------


async def test_stored_response_reads_and_deletes_through_the_transport(
    make_transport: Callable[..., AsyncGuardTransport],
    finish: Callable[[AsyncGuardTransport], Awaitable[None]],
) -> None:
    """AsyncGuardTransport: retrieving a stored response passes through unrecorded;
    deleting it is one completed call at 0 USD, and the ledger verifies."""
    answer = {"id": "resp_1", "object": "response.deleted", "deleted": True}
    transport = make_transport()
    url = "https://api.openai.com/v1/responses/resp_1"
    with respx.mock(assert_all_called=True) as mock:
        got = mock.get(url).respond(json=answer)
        gone = mock.delete(url).respond(json=answer)
        client = openai.AsyncOpenAI(
            api_key="sk-x", max_retries=0, http_client=httpx.AsyncClient(transport=transport)
        )
        assert (await client.responses.retrieve("resp_1")).id == "resp_1"
        assert await transport.ledger.calls() == []
        await client.responses.delete("resp_1")
    assert (got.call_count, gone.call_count) == (1, 1)
    (state,) = await transport.ledger.calls()
    assert (state.stage, state.cost) == ("completed", 0), state
    await finish(transport)


async def test_a_background_response_is_settled_at_its_reservation(
    make_transport: Callable[..., AsyncGuardTransport],
    finish: Callable[[AsyncGuardTransport], Awaitable[None]],
) -> None:
    """``background: true`` answers before the model runs, without usage: the call is
    settled at its reservation and flagged, not at zero (docs/contract.md §2.4)."""
    queued = {
        "id": "resp_1",
        "object": "response",
        "status": "queued",
        "background": True,
        "model": "gpt-4o-mini",
        "output": [],
        "usage": None,
    }
    transport = make_transport()
    with respx.mock(assert_all_called=True) as mock:
        mock.post("https://api.openai.com/v1/responses").respond(json=queued)
        client = openai.AsyncOpenAI(
            api_key="sk-x", max_retries=0, http_client=httpx.AsyncClient(transport=transport)
        )
        response = await client.responses.create(
            model="gpt-4o-mini", input="hi", background=True, max_output_tokens=100
        )
    assert response.status == "queued"
    (state,) = await transport.ledger.calls()
    assert state.stage == "completed" and state.reserved_at_admission > 0
    assert state.cost == state.reserved_at_admission, state
    assert state.flagged == "usage missing: settled at reservation"
    await finish(transport)


def test_cases_cover_every_declared_stored_object_path() -> None:
    """Each endpoint this module's CASES exercises is declared in the bundled files (a typo
    in a path would leave it undeclared, and the proxy test would catch only the refusal)."""
    providers = load_providers([])
    for name, _, method, path, effect in CASES:
        provider = providers["anthropic" if name.startswith("anthropic") else "openai"]
        declared = provider.endpoint_for(method, path)
        assert declared is not None, (name, method, path)
        assert (declared.effect != "read_only") is effect, name
