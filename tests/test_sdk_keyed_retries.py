"""The SDKs' own retries of a request that carries the agent's ``Idempotency-Key``.

An agent that passes its own key (``extra_headers``) and keeps the SDK's retries, with an
SDK timeout shorter than the answer, must fare at least as well as one that passes none:
one effect at the provider, one charge, and the answer. Both ways in: the proxy as a real
process and the in-process transports, the fake provider's receipt log counting effects.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest
from pgkit import ledger_url  # noqa: F401  (a fixture)

from effectguard import AsyncGuardTransport, GuardTransport
from effectguard.ingress.httpx2 import Httpx2Transport
from effectguard.testing import FakeProvider, fake_provider, running_proxy

pytestmark = pytest.mark.slow

#: The SDK's timeout, and the fake provider's delay before it answers: longer.
TIMEOUT_S = 0.5
SLOW = {"x-fake-delay": "1.2"}


def chat(content: str) -> dict[str, Any]:
    return {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 16,
    }


def message(content: str) -> dict[str, Any]:
    return {
        "model": "claude-haiku-4-5",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 16,
    }


def calls(ledger: Path | str) -> list[dict[str, Any]]:
    """``effectguard calls --json``, run as the operator would."""
    out = subprocess.run(
        [sys.executable, "-m", "effectguard", "calls", "--json", "--ledger", str(ledger)],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return list(json.loads(out.stdout))


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeProvider]:
    with fake_provider(tmp_path / "receipts.jsonl") as provider:
        yield provider


def assert_one_effect(fake: FakeProvider, ledger: Path, key: str) -> None:
    """One receipt for the key's request, one completed call of one attempt."""
    assert len(fake.effects()) == 1, fake.receipts()
    (call,) = calls(ledger)
    assert (call["idempotency_key"], call["stage"], call["attempts"]) == (key, "completed", 1)


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
def test_a_keyed_sdk_retry_after_its_timeout_gets_the_answer_through_the_proxy(
    tmp_path: Path, fake: FakeProvider, sdk: str
) -> None:
    """The SDK's first try times out, its retry (same key, ``x-stainless-retry-count: 1``)
    meets the call in flight. It joins it and gets the answer. It used to be refused 409
    ``in_progress`` with ``x-should-retry: false``, so the SDK raised ``ConflictError``
    while a key-less agent, in the same spot, got its answer."""
    ledger = tmp_path / "ledger.db"
    ups = {"openai": fake.url, "anthropic": fake.url}
    key = {"Idempotency-Key": f"{sdk}-task-1", **SLOW}
    with running_proxy(ledger, upstreams=ups) as proxy:
        if sdk == "openai":
            oa = openai.OpenAI(base_url=proxy.url + "/openai/v1", api_key="k", timeout=TIMEOUT_S)
            reply = oa.chat.completions.create(**chat("keyed"), extra_headers=key)
            assert reply.choices[0].message.content
        else:
            an = anthropic.Anthropic(
                base_url=proxy.url + "/anthropic", api_key="k", timeout=TIMEOUT_S
            )
            answer = an.messages.create(**message("keyed"), extra_headers=key)
            assert answer.content
    assert_one_effect(fake, ledger, f"{sdk}-task-1")


def test_a_keyed_sdk_retry_after_its_timeout_gets_the_answer_through_the_sync_transport(
    ledger_url: str,  # noqa: F811
    fake: FakeProvider,
) -> None:
    """The same through ``GuardTransport`` (and the Anthropic SDK's httpx2 adapter), on
    either ledger: the join reads the call from the ledger, as another replica's would."""
    ledger = ledger_url
    transport = GuardTransport(
        ledger=str(ledger), upstreams={"openai": fake.url, "anthropic": fake.url}
    )
    oa = openai.OpenAI(
        base_url=fake.url + "/v1",
        api_key="k",
        timeout=TIMEOUT_S,
        http_client=httpx.Client(transport=transport),
    )
    an = anthropic.Anthropic(
        base_url=fake.url,
        api_key="k",
        timeout=TIMEOUT_S,
        http_client=httpx2.Client(transport=Httpx2Transport(transport)),
    )
    try:
        reply = oa.chat.completions.create(
            **chat("keyed"), extra_headers={"Idempotency-Key": "t-1", **SLOW}
        )
        assert reply.choices[0].message.content
        answer = an.messages.create(
            **message("keyed"), extra_headers={"Idempotency-Key": "t-2", **SLOW}
        )
        assert answer.content
    finally:
        transport.close()
    assert len(fake.effects()) == 2, fake.receipts()
    stages = sorted((c["idempotency_key"], c["stage"], c["attempts"]) for c in calls(ledger))
    assert stages == [("t-1", "completed", 1), ("t-2", "completed", 1)]


def test_a_keyed_sdk_stream_retried_after_its_timeout_is_read_whole_through_the_async_transport(
    tmp_path: Path, fake: FakeProvider
) -> None:
    """A keyed stream whose first byte comes after the SDK's timeout: the retry joins the
    call and is given its stream, replayed whole, usage chunk held back as asked."""
    ledger = tmp_path / "ledger.db"

    async def run() -> list[Any]:
        transport = AsyncGuardTransport(ledger=str(ledger), upstreams={"openai": fake.url})
        oa = openai.AsyncOpenAI(
            base_url=fake.url + "/v1",
            api_key="k",
            timeout=TIMEOUT_S,
            http_client=httpx.AsyncClient(transport=transport),
        )
        try:
            stream = await oa.chat.completions.create(
                **chat("keyed stream"),
                stream=True,
                extra_headers={"Idempotency-Key": "s-1", **SLOW},
            )
            return [chunk async for chunk in stream]
        finally:
            await transport.aclose()

    chunks = asyncio.run(run())
    assert chunks and all(c.choices for c in chunks)
    assert_one_effect(fake, ledger, "s-1")


class _Seen(httpx.BaseTransport):
    """Passes requests on; keeps each try's retry count and each answer's status, error
    type and ``x-should-retry``."""

    def __init__(self, inner: httpx.BaseTransport) -> None:
        self.inner = inner
        self.answers: list[tuple[int, str | None, str | None]] = []
        self.tries: list[str | None] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.tries.append(request.headers.get("x-stainless-retry-count"))
        response = self.inner.handle_request(request)
        response.read()
        kind = response.json().get("error", {}).get("type") if response.content else None
        self.answers.append((response.status_code, kind, response.headers.get("x-should-retry")))
        return response


def test_a_retry_that_waited_for_a_call_never_sent_is_retried_by_the_sdk(tmp_path: Path) -> None:
    """The provider cannot be reached (connection refused) and the SDK's timeout is shorter
    than effectguard's own retries of the connection: the SDK's retry waits for the call,
    which ends ``not_sent``, and is answered 409 ``retry_failed``. Nothing was sent, so the
    SDK may retry, as it does after the owner's own 502 ``upstream_unreachable``. The 409
    said ``x-should-retry: false``: the SDK stopped and raised ``ConflictError`` after one
    retry where, with a longer timeout, it kept retrying."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    closed.close()  # nothing listens there: every connection is refused
    transport = GuardTransport(ledger=str(tmp_path / "ledger.db"), upstreams={"openai": url})
    seen = _Seen(transport)
    oa = openai.OpenAI(
        base_url=url + "/v1",
        api_key="k",
        timeout=0.3,
        max_retries=2,
        http_client=httpx.Client(transport=seen),
    )
    try:
        with pytest.raises(openai.APIError):
            oa.chat.completions.create(**chat("unreachable"))
    finally:
        transport.close()
    failed = [a for a in seen.answers if a[1] == "retry_failed"]
    assert failed, seen.answers  # the premise: a retry waited for the call
    assert all(should_retry == "true" for _, _, should_retry in failed), seen.answers
    assert seen.tries == ["0", "1", "2"]  # the SDK's retries, all made
