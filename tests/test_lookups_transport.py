"""A keyed resend of an effect-unknown call, decided by a lagging lookup, in-process.

Through AsyncGuardTransport against the real fake provider, whose ``/v1/search`` lags and
needs the provider's key: while the call is younger than the declared freshness (or the
search has not caught up) the resend is refused 409 ``effect_unknown``; afterwards the
lookup decides it. Applied → the recovered object, no new charge; not applied → exactly
one new charge. Charges are counted from the provider's own receipts.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from toolkit import (
    AUTH,
    KEY,
    SEND,
    SLOW_ANSWER_TIMES_OUT,
    charge,
    charges,
    declare,
    lossy_transport,
    lost_send,
)

from effectguard import AsyncGuardTransport
from effectguard.ledger import Ledger
from effectguard.rules.workstate import WorkState
from effectguard.testing import fake_provider

MakeTransport = Callable[..., AsyncGuardTransport]
Finish = Callable[[AsyncGuardTransport], Awaitable[None]]


async def reconciled_by(t: AsyncGuardTransport, call_id: str) -> list[dict[str, object]]:
    """The call's ``call.reconciled`` events' data."""
    return [e.data for e in await t.ledger.events(call_id) if e.kind == "call.reconciled"]


async def assert_refused_unknown(client: httpx.AsyncClient, url: str, body: object) -> None:
    """A keyed resend of ``body`` is refused 409 ``effect_unknown``."""
    refused = await client.post(url, json=body)
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"]["type"] == "effect_unknown"


async def test_applied_call_is_refused_until_the_search_finds_it_then_recovered(
    tmp_path: Path, make_transport: MakeTransport, finish: Finish
) -> None:
    """Lagging search: 409 while not found; once found, its object comes back as a 200
    marked recovered, the call is reconciled applied by lookup, and nothing is charged anew."""
    folder = declare(tmp_path, freshness=600)
    lag = ["--search-lag", "2", "--lookup-key", KEY]
    with fake_provider(tmp_path / "receipts.jsonl", extra_args=lag) as fake:
        t = make_transport(
            providers=[folder], upstreams={"payments": fake.url}, settings=SLOW_ANSWER_TIMES_OUT
        )
        client = httpx.AsyncClient(transport=t, headers={**AUTH, "Idempotency-Key": "pay-1"})
        url = fake.url + SEND
        # The provider takes the charge, then answers too late: effect unknown.
        first = await client.post(url, json=charge(5), headers={"x-fake-delay": "3"})
        assert first.status_code == 504, first.text
        call_id = first.headers["effectguard-call-id"]
        await assert_refused_unknown(client, url, charge(5))
        assert await reconciled_by(t, call_id) == []
        await asyncio.sleep(2.5)  # the provider's search catches up
        recovered = await client.post(url, json=charge(5))
        assert recovered.status_code == 200, recovered.text
        assert recovered.headers["effectguard-recovered"] == "lookup:payments"
        assert recovered.headers["effectguard-call-id"] == call_id
        (receipt,) = charges(fake)
        assert recovered.json() == {"id": f"send_fake{receipt['seq']}", "status": "sent"}
        assert receipt["op"] == call_id  # the call id travelled with the request
        (decided,) = await reconciled_by(t, call_id)
        assert (decided["by"], decided["applied"]) == ("lookup:payments", True)
        assert "evidence sha256:" in str(decided["note"])
        # Decided, with the result kept: a further resend replays it, never sent.
        again = await client.post(url, json=charge(5))
        assert again.status_code == 200, again.text
        assert again.headers["effectguard-replayed"] == "true"
        assert again.headers["effectguard-recovered"] == "lookup:payments"
        assert again.content == recovered.content
        assert len(charges(fake)) == 1
    await finish(t)


async def test_lost_call_is_refused_while_fresh_then_resent_exactly_once(
    tmp_path: Path, make_transport: MakeTransport, finish: Finish
) -> None:
    """Not found proves not applied only past the declared freshness: 409 before, then one
    new attempt (one charge in the provider's receipts), recorded by lookup:payments."""
    folder = declare(tmp_path, freshness=60)
    with fake_provider(tmp_path / "receipts.jsonl", extra_args=["--lookup-key", KEY]) as fake:
        t = lossy_transport(make_transport, folder, fake)
        client = httpx.AsyncClient(transport=t, headers={**AUTH, "Idempotency-Key": "pay-2"})
        url = fake.url + SEND
        call_id = await lost_send(client, url, charge(7))
        await assert_refused_unknown(client, url, charge(7))  # still young
        assert await reconciled_by(t, call_id) == []
        # The only patch these tests allow: the clock, past the declared freshness.
        guard = await t.guard()
        guard.resolver.clock = lambda: time.time() + 120
        resent = await client.post(url, json=charge(7))
        assert resent.status_code == 200, resent.text
        assert "effectguard-recovered" not in resent.headers
        assert len(charges(fake)) == 1
        (decided,) = await reconciled_by(t, call_id)
        assert (decided["by"], decided["applied"]) == ("lookup:payments", False)
        replay = await client.post(url, json=charge(7))
        assert replay.headers["effectguard-replayed"] == "true"
        assert json.loads(replay.content) == resent.json()
        assert len(charges(fake)) == 1
        (state,) = await t.ledger.calls()
        assert (state.stage, state.attempts, state.held) == ("completed", 2, 0)
    await finish(t)


async def test_not_found_past_the_declared_retention_proves_nothing(
    tmp_path: Path, make_transport: MakeTransport, finish: Finish
) -> None:
    """A provider that forgets operations (Postmark: 7 to 365 days) answers "not found"
    for one it applied long ago: past ``retention_s`` the lookup reads unknown, so the
    resend stays refused 409 and nothing is sent again."""
    folder = declare(tmp_path, freshness=60, retention=100)
    with fake_provider(tmp_path / "receipts.jsonl", extra_args=["--lookup-key", KEY]) as fake:
        t = lossy_transport(make_transport, folder, fake)
        client = httpx.AsyncClient(transport=t, headers={**AUTH, "Idempotency-Key": "pay-3"})
        url = fake.url + SEND
        call_id = await lost_send(client, url, charge(9))
        guard = await t.guard()
        guard.resolver.clock = lambda: time.time() + 120  # past freshness and retention
        await assert_refused_unknown(client, url, charge(9))
        assert charges(fake) == []
        assert await reconciled_by(t, call_id) == []
        guard.resolver.clock = lambda: time.time() + 80  # past freshness only: decided
        resent = await client.post(url, json=charge(9))
        assert resent.status_code == 200, resent.text
        assert len(charges(fake)) == 1
    await finish(t)


@pytest.mark.parametrize("answer", ["html", "no-data"])
async def test_a_200_that_is_not_a_search_result_proves_nothing(
    tmp_path: Path, make_transport: MakeTransport, finish: Finish, answer: str
) -> None:
    """A search answering 200 with an HTML error page, or with JSON lacking its ``data``
    list, is no "not found": past the freshness the call stays effect_unknown, a keyed
    resend is refused 409 and the sweeper decides nothing; the provider sees no resend."""
    folder = declare(tmp_path, freshness=60)
    extra = ["--lookup-key", KEY, "--search-answer", answer]
    with fake_provider(tmp_path / "receipts.jsonl", extra_args=extra) as fake:
        t = lossy_transport(make_transport, folder, fake)
        client = httpx.AsyncClient(transport=t, headers={**AUTH, "Idempotency-Key": "pay-4"})
        url = fake.url + SEND
        call_id = await lost_send(client, url, charge(4))
        guard = await t.guard()
        guard.resolver.clock = lambda: time.time() + 120  # past the declared freshness
        await assert_refused_unknown(client, url, charge(4))
        assert await guard.resolver.sweep() == []
        assert charges(fake) == []
        assert await reconciled_by(t, call_id) == []
        (state,) = await t.ledger.calls()
        assert state.stage == "effect_unknown"
    await finish(t)


async def test_a_result_the_sweeper_recovered_is_replayed_to_a_later_keyed_resend(
    tmp_path: Path, make_transport: MakeTransport, finish: Finish, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sweeper decides an applied call by lookup and keeps the object the search
    returned: the client's later keyed resend gets it as a 200 marked replayed and
    recovered, with no provider call and no new charge."""
    monkeypatch.setenv("PAYMENTS_API_KEY", KEY)  # the sweeper's lookup carries no request
    folder = declare(tmp_path, freshness=60)
    with fake_provider(tmp_path / "receipts.jsonl", extra_args=["--lookup-key", KEY]) as fake:
        t = make_transport(
            providers=[folder], upstreams={"payments": fake.url}, settings=SLOW_ANSWER_TIMES_OUT
        )
        client = httpx.AsyncClient(transport=t, headers={**AUTH, "Idempotency-Key": "pay-5"})
        url = fake.url + SEND
        first = await client.post(url, json=charge(6), headers={"x-fake-delay": "3"})
        assert first.status_code == 504, first.text
        call_id = first.headers["effectguard-call-id"]
        guard = await t.guard()
        guard.resolver.clock = lambda: time.time() + 120  # past the declared freshness
        assert await guard.resolver.sweep() == [call_id]
        (decided,) = await reconciled_by(t, call_id)
        assert (decided["by"], decided["applied"]) == ("lookup:payments", True)
        (before,) = await t.ledger.calls()
        assert before.stage == "reconciled_applied"
        (receipt,) = charges(fake)
        replay = await client.post(url, json=charge(6))
        assert replay.status_code == 200, replay.text
        assert replay.headers["effectguard-replayed"] == "true"
        assert replay.headers["effectguard-recovered"] == "lookup:payments"
        assert replay.json() == {"id": f"send_fake{receipt['seq']}", "status": "sent"}
        assert len(charges(fake)) == 1
        (after,) = await t.ledger.calls()
        assert (after.stage, after.attempts, after.cost) == (before.stage, 1, before.cost)
    await finish(t)


class DropEverySend(httpx.AsyncBaseTransport):
    """A network that loses every POST after it was written (the provider never sees it)."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            raise httpx.ReadError("connection reset after the request was written")
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


class ListedStates:
    """A store that notes how many call states each listing read returned (no patching:
    ``Ledger`` takes any store)."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.listed: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def list_calls(self, *args: Any, **kwargs: Any) -> list[WorkState]:
        states: list[WorkState] = await self._store.list_calls(*args, **kwargs)
        self.listed.append(len(states))
        return states

    async def unknown_after(self, *args: Any) -> list[WorkState]:
        states: list[WorkState] = await self._store.unknown_after(*args)
        self.listed.append(len(states))
        return states


async def test_the_sweeper_comes_round_to_every_unknown_call(
    tmp_path: Path, make_transport: MakeTransport, finish: Finish, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hundred newer unknown calls that nothing can decide (an endpoint with no lookup)
    do not starve an older one the lookup can: the sweeps go round the unknown calls in
    order, a page of 20 each, so within ceil(101 / 20) sweeps the old call is decided,
    and no sweep reads more than its page of calls from the ledger."""
    monkeypatch.setenv("PAYMENTS_API_KEY", KEY)
    folder = declare(tmp_path, freshness=60)
    with fake_provider(tmp_path / "receipts.jsonl", extra_args=["--lookup-key", KEY]) as fake:
        inner = DropEverySend(httpx.AsyncHTTPTransport())
        async with Ledger.open(str(tmp_path / "ledger.db")) as opened:
            store = ListedStates(opened.store)
            t = make_transport(
                inner=inner,
                ledger=Ledger(store),
                providers=[folder],
                upstreams={"payments": fake.url},
            )
            client = httpx.AsyncClient(transport=t, headers=AUTH)
            old = await client.post(fake.url + SEND, json=charge(1))
            assert old.status_code == 502, old.text
            call_id = old.headers["effectguard-call-id"]
            for n in range(100):  # /v1/other: undeclared, at_most_once, no lookup
                newer = await client.post(fake.url + "/v1/other", json={"n": n})
                assert newer.status_code == 502, newer.text
            guard = await t.guard()
            store.listed.clear()
            # While the old call is young, two sweeps look at it and at 39 of the others.
            assert [await guard.resolver.sweep(), await guard.resolver.sweep()] == [[], []]
            guard.resolver.clock = lambda: time.time() + 120  # past the declared freshness
            decided = [await guard.resolver.sweep() for _ in range(6)]
            assert [d for d in decided if d] == [[call_id]]
            assert store.listed and max(store.listed) <= 20
            state = await t.ledger.call(call_id)
            assert state.stage == "reconciled_not_applied"
            stages = {s.stage for s in await t.ledger.calls() if s.call_id != call_id}
            assert stages == {"effect_unknown"}
            assert charges(fake) == []
            await finish(t)


async def test_a_post_search_carries_its_declared_form_fields(
    tmp_path: Path, make_transport: MakeTransport, finish: Finish
) -> None:
    """A lookup declared as ``POST`` with ``form = { op = "{op}" }`` sends the operation id
    form-encoded in its body (the fake's POST search refuses a body without it, 400):
    an applied call is recovered, a lost one is resent exactly once."""
    folder = declare(tmp_path, freshness=60)
    path = folder / "payments.toml"
    text = path.read_text().replace(
        'query = { op = "{op}" }', 'method = "POST"\nform = { op = "{op}" }'
    )
    path.write_text(text)
    with fake_provider(tmp_path / "receipts.jsonl", extra_args=["--lookup-key", KEY]) as fake:
        t = lossy_transport(make_transport, folder, fake, settings=SLOW_ANSWER_TIMES_OUT)
        url = fake.url + SEND
        client = httpx.AsyncClient(transport=t, headers=AUTH)
        lost = await lost_send(client, url, charge(2), headers={"Idempotency-Key": "lost"})
        paid = await client.post(
            url,
            json=charge(3),
            headers={"Idempotency-Key": "paid", "x-fake-delay": "3"},
        )
        assert paid.status_code == 504, paid.text
        guard = await t.guard()
        guard.resolver.clock = lambda: time.time() + 120  # past the declared freshness
        recovered = await client.post(url, json=charge(3), headers={"Idempotency-Key": "paid"})
        assert recovered.status_code == 200, recovered.text
        assert recovered.headers["effectguard-recovered"] == "lookup:payments"
        resent = await client.post(url, json=charge(2), headers={"Idempotency-Key": "lost"})
        assert resent.status_code == 200, resent.text
        assert "effectguard-recovered" not in resent.headers
        assert sorted(r["op"] for r in charges(fake)) == sorted(
            [lost, paid.headers["effectguard-call-id"]]
        )
    await finish(t)
