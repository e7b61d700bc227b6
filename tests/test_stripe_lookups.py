"""The bundled ``stripe`` declaration, as it ships, against the Stripe-like fake.

Stripe's ``Idempotency-Key`` saves a request's first result, a 500 included, and keeps
keys for at least 24 hours; past that window an unknown create of a searchable resource
(a PaymentIntent, Customer, Charge or Invoice: each test runs on all four) is decided by
the declared metadata search, whose "not found" proves nothing until the call's last
attempt is an hour old (``freshness_s = 3600``), nor for a call one of whose attempts
the ledger does not show carrying the operation id (one an older release sent).
Through AsyncGuardTransport on a SQLite ledger whose clock the test moves (the only
patch: clocks, and the sweeper's key in the environment); each later day is a new
transport, as a restarted process would be. What Stripe made is counted from the fake's
own receipts, never from the ledger.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes import RunningFake, running_fake

import effectguard.providers
from effectguard import AsyncGuardTransport
from effectguard.ledger import Ledger, open_store
from effectguard.testing.clock import ManualClock

MakeTransport = Callable[..., AsyncGuardTransport]
Finish = Callable[[AsyncGuardTransport], Awaitable[None]]

AUTH = {"Authorization": "Bearer sk_test_fake"}
BUNDLED = Path(effectguard.providers.__file__).parent / "bundled"
#: Where these creates write their operation id, as each attempt.started records it.
OP_ID_IN = "form metadata[effectguard_op]"
#: The data keys of an attempt.started that records no operation id (as every release
#: before op_id_in wrote them).
STARTED_KEYS = {"at", "attempt", "call", "generation", "provider_idempotency_key", "worker"}
DAY, HOUR = 86400.0, 3600.0
#: How long (real seconds) the fake's search takes to show a new object.
LAG_S = 3.0
#: Each searchable create and a form body for it; ``n`` makes two requests differ.
FORMS: dict[str, Callable[[int], dict[str, str]]] = {
    "/v1/payment_intents": lambda n: {"amount": str(n), "currency": "usd"},
    "/v1/customers": lambda n: {"email": f"c{n}@example.com", "name": f"Customer {n}"},
    "/v1/charges": lambda n: {"amount": str(n), "currency": "usd", "source": "tok_visa"},
    "/v1/invoices": lambda n: {"customer": "cus_fake1", "description": f"order {n}"},
}


@pytest.fixture(params=list(FORMS), ids=lambda path: path.rsplit("/", 1)[-1])
def create(request: pytest.FixtureRequest) -> str:
    """The create path the test runs on: each searchable Stripe resource."""
    return str(request.param)


@pytest.fixture
async def clocked(tmp_path: Path) -> AsyncIterator[tuple[Ledger, ManualClock]]:
    """A SQLite ledger on a clock that moves only when the test says so."""
    clock = ManualClock()
    ledger = Ledger(open_store(str(tmp_path / "ledger.db"), clock=clock))
    await ledger.store.open()
    yield ledger, clock
    await ledger.store.close()


class Stripe:
    """One process's view: a transport over the clocked ledger, to the fake, creating
    objects at ``create``."""

    def __init__(
        self,
        make: MakeTransport,
        ledger: Ledger,
        clock: ManualClock,
        url: str,
        create: str,
        **kwargs: Any,
    ) -> None:
        self.transport = make(ledger=ledger, upstreams={"stripe": url}, **kwargs)
        self.ledger = ledger
        self.clock = clock
        self.url = url
        self.create = create

    async def pay(self, key: str, amount: int, **headers: str) -> httpx.Response:
        """POST a create, form-encoded, under ``key``."""
        guard = await self.transport.guard()
        guard.resolver.clock = self.clock  # the lookup's "how old" reads the ledger's clock
        async with httpx.AsyncClient(transport=self.transport) as client:
            return await client.post(
                self.url + self.create,
                data=FORMS[self.create](amount),
                headers={**AUTH, "Idempotency-Key": key, **headers},
            )

    async def sweep(self) -> list[str]:
        """One sweep of the unknown calls, on the ledger's clock; the ones decided."""
        guard = await self.transport.guard()
        guard.resolver.clock = self.clock
        return await guard.resolver.sweep()

    async def decisions(self, call_id: str) -> list[dict[str, Any]]:
        """The call's ``call.reconciled`` events' data."""
        events = await self.transport.ledger.events(call_id)
        return [e.data for e in events if e.kind == "call.reconciled"]


def creates(fake: RunningFake, create: str) -> list[dict[str, Any]]:
    """The objects the fake created at ``create`` (its own receipts)."""
    return [r for r in fake.effects() if r["path"] == create]


async def carried(ledger: Ledger, call_id: str) -> list[str | None]:
    """Where each attempt of the call recorded writing its operation id (None: nowhere)."""
    events = await ledger.events(call_id)
    return [e.data.get("op_id_in") for e in events if e.kind == "attempt.started"]


def error_type(response: httpx.Response) -> str:
    return str(response.json()["error"]["type"])


async def test_a_500_is_replayed_inside_the_window_and_recovered_by_search_after_it(
    tmp_path: Path,
    clocked: tuple[Ledger, ManualClock],
    make_transport: MakeTransport,
    finish: Finish,
    create: str,
) -> None:
    """Stripe created the object and answered 500, which its key saved: a keyed
    resend late in the 24 h window goes to Stripe with the same key and meets the saved
    500 (nothing created twice; still unknown). Just past the window, the search has not
    caught up and the call's last attempt is younger than its hour of lag: refused 409.
    Once the search shows the object, it comes back as the recovered result, and nothing
    is charged anew."""
    ledger, clock = clocked
    with running_fake("stripe_like", tmp_path / "receipts.jsonl", lag_s=LAG_S) as fake:
        day1 = Stripe(make_transport, ledger, clock, fake.url, create)
        first = await day1.pay("order-1", 500, **{"x-fake-status": "500"})
        # Stripe's own 500 reaches the client; the ledger holds the call as unknown.
        assert (first.status_code, error_type(first)) == (500, "api_error"), first.text
        call_id = first.headers["effectguard-call-id"]
        (created,) = creates(fake, create)
        assert created["op"] == call_id  # metadata[effectguard_op] reached Stripe
        await day1.transport.aclose()

        clock.advance(DAY - 600)  # ten minutes before the key's window closes
        late = Stripe(make_transport, ledger, clock, fake.url, create)
        again = await late.pay("order-1", 500)
        assert (again.status_code, error_type(again)) == (500, "api_error"), again.text
        assert again.headers["idempotent-replayed"] == "true"  # Stripe's saved 500
        assert "effectguard-replayed" not in again.headers  # sent, not answered by us
        assert len(creates(fake, create)) == 1
        (state,) = await ledger.calls()
        assert (state.stage, state.attempts) == ("effect_unknown", 2)
        await late.transport.aclose()

        clock.advance(601)  # past the window; the last attempt is ten minutes old
        young = Stripe(make_transport, ledger, clock, fake.url, create)
        refused = await young.pay("order-1", 500)
        assert refused.status_code == 409, refused.text  # the search lags: not found yet
        assert error_type(refused) == "effect_unknown"
        assert await young.decisions(call_id) == []
        await young.transport.aclose()

        time.sleep(max(0.0, created["ts"] + LAG_S - time.time()))  # the search catches up
        clock.advance(HOUR)
        later = Stripe(make_transport, ledger, clock, fake.url, create)
        recovered = await later.pay("order-1", 500)
        assert recovered.status_code == 200, recovered.text
        assert recovered.headers["effectguard-recovered"] == "lookup:stripe"
        assert recovered.json()["id"] == created["id"]
        assert recovered.json()["metadata"] == {"effectguard_op": call_id}
        (decided,) = await later.decisions(call_id)
        assert (decided["by"], decided["applied"]) == ("lookup:stripe", True)
        assert len(creates(fake, create)) == 1
        await finish(later.transport)


async def test_not_found_is_unknown_while_young_then_not_applied_and_sent_once(
    tmp_path: Path,
    clocked: tuple[Ledger, ManualClock],
    make_transport: MakeTransport,
    finish: Finish,
    create: str,
) -> None:
    """A 503 (before any work: nothing saved, nothing created) leaves the call unknown.
    Resent late in the window, it meets another 503. Just past the window its last
    attempt is younger than the search's hour of lag: the lookup's "not found" proves
    nothing and the resend is refused 409. An hour on, it proves "not applied": the
    resend goes out as a new attempt and creates exactly one object. (Customers, Charges
    and Invoices were found-only while the ledger did not record that an attempt carried
    the operation id: such a call stayed unknown, and waited for a person.)"""
    ledger, clock = clocked
    with running_fake("stripe_like", tmp_path / "receipts.jsonl", lag_s=LAG_S) as fake:
        day1 = Stripe(make_transport, ledger, clock, fake.url, create)
        first = await day1.pay("order-2", 700, **{"x-fake-status": "503"})
        assert first.status_code == 503, first.text
        call_id = first.headers["effectguard-call-id"]
        assert await carried(ledger, call_id) == [OP_ID_IN]
        await day1.transport.aclose()

        clock.advance(DAY - 600)  # ten minutes before the window closes
        late = Stripe(make_transport, ledger, clock, fake.url, create)
        resent = await late.pay("order-2", 700, **{"x-fake-status": "503"})
        assert resent.status_code == 503, resent.text
        assert (await ledger.calls())[0].stage == "effect_unknown"
        await late.transport.aclose()

        clock.advance(601)  # past the window; the last attempt is ten minutes old
        young = Stripe(make_transport, ledger, clock, fake.url, create)
        refused = await young.pay("order-2", 700)
        assert refused.status_code == 409, refused.text
        assert error_type(refused) == "effect_unknown"
        assert await young.decisions(call_id) == []
        assert creates(fake, create) == []
        await young.transport.aclose()

        clock.advance(HOUR)
        old = Stripe(make_transport, ledger, clock, fake.url, create)
        sent = await old.pay("order-2", 700)
        assert sent.status_code == 200, sent.text
        assert "effectguard-recovered" not in sent.headers
        (decided,) = await old.decisions(call_id)
        assert (decided["by"], decided["applied"]) == ("lookup:stripe", False)
        (created,) = creates(fake, create)
        assert created["op"] == call_id and sent.json()["id"] == created["id"]
        replay = await old.pay("order-2", 700)
        assert replay.headers["effectguard-replayed"] == "true"
        assert json.loads(replay.content) == sent.json()
        assert len(creates(fake, create)) == 1
        await finish(old.transport)


async def test_a_resend_that_stripe_turns_away_leaves_the_first_charge_unknown(
    tmp_path: Path,
    clocked: tuple[Ledger, ManualClock],
    make_transport: MakeTransport,
    finish: Finish,
    create: str,
) -> None:
    """Stripe created the object and answered 500. The keyed resend inside the window
    meets Stripe's rate limiter (429, which runs before its idempotency layer): that proves
    nothing about the first request, so the call stays effect_unknown and holds its charge.
    Past the window (when Stripe may have pruned the key) the resend is not sent again: the
    search answers it, and nothing is created twice. (Booked ``not_processed``, the call
    had held nothing and would have gone to Stripe as a new request.)"""
    ledger, clock = clocked
    with running_fake("stripe_like", tmp_path / "receipts.jsonl", lag_s=LAG_S) as fake:
        day1 = Stripe(make_transport, ledger, clock, fake.url, create)
        first = await day1.pay("order-3", 900, **{"x-fake-status": "500"})
        assert first.status_code == 500, first.text
        call_id = first.headers["effectguard-call-id"]
        (state,) = await ledger.calls()
        held = state.held
        turned_away = await day1.pay("order-3", 900, **{"x-fake-status": "429"})
        assert turned_away.status_code == 429, turned_away.text  # Stripe's own answer
        (state,) = await ledger.calls()
        assert (state.stage, state.effect, state.held) == ("effect_unknown", "unknown", held)
        assert state.attempts == 4  # the resend and its two automatic retries, all 429
        assert len(creates(fake, create)) == 1
        await day1.transport.aclose()

        (created,) = creates(fake, create)
        time.sleep(max(0.0, created["ts"] + LAG_S - time.time()))  # the search catches up
        clock.advance(DAY + HOUR)
        later = Stripe(make_transport, ledger, clock, fake.url, create)
        recovered = await later.pay("order-3", 900)
        assert recovered.status_code == 200, recovered.text
        assert recovered.headers["effectguard-recovered"] == "lookup:stripe"
        assert recovered.json()["id"] == created["id"]
        (decided,) = await later.decisions(call_id)
        assert (decided["by"], decided["applied"]) == ("lookup:stripe", True)
        assert len(creates(fake, create)) == 1
        await finish(later.transport)


async def test_a_connect_payment_is_searched_for_in_its_connected_account(
    tmp_path: Path,
    clocked: tuple[Ledger, ManualClock],
    make_transport: MakeTransport,
    finish: Finish,
    create: str,
) -> None:
    """A platform creates an object in a connected account (``Stripe-Account``) and
    meets a 500: created there, its result unknown. Past the window and the search's
    hour, the keyed resend asks the search in that account, finds the object and
    answers with it; nothing is created twice. (Searched in the platform's own account,
    it read "not found", then "not applied", and the call went out again.)"""
    ledger, clock = clocked
    connected = {"Stripe-Account": "acct_connected1"}
    with running_fake("stripe_like", tmp_path / "receipts.jsonl", lag_s=LAG_S) as fake:
        day1 = Stripe(make_transport, ledger, clock, fake.url, create)
        first = await day1.pay("order-4", 1200, **connected, **{"x-fake-status": "500"})
        assert first.status_code == 500, first.text
        call_id = first.headers["effectguard-call-id"]
        await day1.transport.aclose()

        (created,) = creates(fake, create)
        time.sleep(max(0.0, created["ts"] + LAG_S - time.time()))  # the search catches up
        clock.advance(DAY + 2 * HOUR)
        later = Stripe(make_transport, ledger, clock, fake.url, create)
        recovered = await later.pay("order-4", 1200, **connected)
        assert recovered.status_code == 200, recovered.text
        assert recovered.headers["effectguard-recovered"] == "lookup:stripe"
        assert recovered.json()["id"] == created["id"]
        (decided,) = await later.decisions(call_id)
        assert (decided["by"], decided["applied"]) == ("lookup:stripe", True)
        assert len(creates(fake, create)) == 1
        await finish(later.transport)


async def test_one_key_in_two_connected_accounts_is_not_answered_with_the_others_payment(
    tmp_path: Path,
    clocked: tuple[Ledger, ManualClock],
    make_transport: MakeTransport,
    finish: Finish,
    create: str,
) -> None:
    """The same body under the same key, sent to another connected account, is another
    request (Stripe keeps each account's keys apart): refused 422, never answered with the
    first account's object as if the second had been charged. (The account was not
    part of the request's hash, and the second request was replayed the first's answer.)"""
    ledger, clock = clocked
    with running_fake("stripe_like", tmp_path / "receipts.jsonl", lag_s=LAG_S) as fake:
        stripe = Stripe(make_transport, ledger, clock, fake.url, create)
        first = await stripe.pay("order-5", 300, **{"Stripe-Account": "acct_a"})
        assert first.status_code == 200, first.text
        other = await stripe.pay("order-5", 300, **{"Stripe-Account": "acct_b"})
        assert other.status_code == 422, other.text
        assert error_type(other) == "idempotency_key_reused"
        again = await stripe.pay("order-5", 300, **{"Stripe-Account": "acct_a"})
        assert again.headers["effectguard-replayed"] == "true"
        assert len(creates(fake, create)) == 1
        await finish(stripe.transport)


# -- the sweeper, past the window --------------------------------------------------------


class LoseAnswers(httpx.AsyncBaseTransport):
    """A network that loses every POST's answer: after Stripe did the work (``reached``),
    or with the request lost before it reached Stripe. Either way the connection resets
    once the request was written, so effectguard cannot tell which happened."""

    def __init__(self, *, reached: bool) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.reached = reached

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method != "POST":
            return await self.inner.handle_async_request(request)
        if self.reached:
            answer = await self.inner.handle_async_request(request)
            await answer.aread()
            await answer.aclose()
        raise httpx.ReadError("connection reset before the answer arrived")

    async def aclose(self) -> None:
        await self.inner.aclose()


async def lose(stripe: Stripe, key: str, n: int) -> str:
    """A keyed create whose answer the network loses: 502 ``effect_unknown``; its id."""
    lost = await stripe.pay(key, n)
    assert lost.status_code == 502, lost.text
    assert error_type(lost) == "effect_unknown"
    return lost.headers["effectguard-call-id"]


def search_answers(fake: RunningFake, answer: str) -> None:
    """Make every later search of the fake answer ``answer`` (tests/fakes/stripe_like)."""
    httpx.post(fake.url + "/_fake/search-answer", data={"answer": answer}).raise_for_status()


async def test_the_sweeper_recovers_a_create_whose_answer_was_lost(
    tmp_path: Path,
    clocked: tuple[Ledger, ManualClock],
    make_transport: MakeTransport,
    finish: Finish,
    create: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stripe made the object and the answer was lost: effect unknown. Inside the 24 h
    window the sweeper leaves it to the client's keyed resend; past it, the search finds
    the object by the operation id that reached Stripe's form body, the sweeper records
    it applied by lookup, and a later keyed resend gets it back without a second one."""
    monkeypatch.setenv("STRIPE_API_KEY", "sk_test_fake")  # the sweeper's own lookup key
    ledger, clock = clocked
    with running_fake("stripe_like", tmp_path / "receipts.jsonl", lag_s=LAG_S) as fake:
        day1 = Stripe(make_transport, ledger, clock, fake.url, create,
                      inner=LoseAnswers(reached=True))  # fmt: skip
        call_id = await lose(day1, "lost-1", 400)
        (created,) = creates(fake, create)
        assert created["op"] == call_id  # metadata[effectguard_op] reached Stripe
        time.sleep(max(0.0, created["ts"] + LAG_S - time.time()))  # the search catches up
        clock.advance(DAY - 600)
        assert await day1.sweep() == []  # inside the window: the client's resend decides
        clock.advance(601)
        assert await day1.sweep() == [call_id]
        (decided,) = await day1.decisions(call_id)
        assert (decided["by"], decided["applied"]) == ("lookup:stripe", True)
        await day1.transport.aclose()

        later = Stripe(make_transport, ledger, clock, fake.url, create)
        again = await later.pay("lost-1", 400)
        assert again.status_code == 200, again.text
        assert again.headers["effectguard-recovered"] == "lookup:stripe"
        assert again.json()["id"] == created["id"]
        assert len(creates(fake, create)) == 1
        await finish(later.transport)


async def test_the_sweeper_decides_a_lost_create_not_applied_only_past_the_freshness(
    tmp_path: Path,
    clocked: tuple[Ledger, ManualClock],
    make_transport: MakeTransport,
    finish: Finish,
    create: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The create never reached Stripe, nor did its keyed resend late in the window. Just
    past the window that resend is ten minutes old, younger than the search's hour of
    lag: the sweeper's "not found" proves nothing. An hour on it proves "not applied",
    recorded by lookup, and Stripe has made nothing."""
    monkeypatch.setenv("STRIPE_API_KEY", "sk_test_fake")
    ledger, clock = clocked
    with running_fake("stripe_like", tmp_path / "receipts.jsonl", lag_s=LAG_S) as fake:
        stripe = Stripe(make_transport, ledger, clock, fake.url, create,
                        inner=LoseAnswers(reached=False))  # fmt: skip
        call_id = await lose(stripe, "lost-2", 500)
        clock.advance(DAY - 600)
        assert await lose(stripe, "lost-2", 500) == call_id  # resent inside the window
        clock.advance(601)
        assert await stripe.sweep() == []
        assert await stripe.decisions(call_id) == []
        clock.advance(HOUR)
        assert await stripe.sweep() == [call_id]
        (decided,) = await stripe.decisions(call_id)
        assert (decided["by"], decided["applied"]) == ("lookup:stripe", False)
        assert (await ledger.call(call_id)).stage == "reconciled_not_applied"
        assert await carried(ledger, call_id) == [OP_ID_IN, OP_ID_IN]
        assert creates(fake, create) == []
        await finish(stripe.transport)


#: The creates that gained their op_id and lookup late (stripe.toml, 2026-12-04).
LATE = ("/v1/customers", "/v1/charges", "/v1/invoices")


def older_release(tmp_path: Path) -> list[str]:
    """``providers=`` for a stripe.toml as the release before these lookups declared it:
    the Customers, Charges and Invoices creates without ``op_id`` and ``lookup``. Their
    requests then carry no operation id and their attempts record none: an attempt.started
    exactly as an older release wrote it."""
    text = (BUNDLED / "stripe.toml").read_text()
    blocks = text.split("[[endpoints]]\n")
    for i, block in enumerate(blocks):
        if any(block.startswith(f'path = "{path}"\n') for path in LATE):
            head = block.split("[endpoints.lookup]\n")[0]
            lines = head.splitlines(keepends=True)
            blocks[i] = "".join(line for line in lines if not line.startswith("op_id"))
    folder = tmp_path / "older"
    folder.mkdir()
    (folder / "stripe.toml").write_text("[[endpoints]]\n".join(blocks))
    return [str(folder)]


async def left_unknown(stripe: Stripe, call_id: str) -> None:
    """The sweeper decides nothing of ``call_id``, which stays ``effect_unknown``."""
    assert await stripe.sweep() == []
    assert await stripe.decisions(call_id) == []
    assert (await stripe.ledger.call(call_id)).stage == "effect_unknown"


@pytest.mark.parametrize("create", LATE)
async def test_not_found_never_decides_a_create_an_older_release_sent(
    tmp_path: Path,
    clocked: tuple[Ledger, ManualClock],
    make_transport: MakeTransport,
    finish: Finish,
    create: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A create sent by a release before it carried the operation id (its attempt.started
    records none, its data as that release wrote it) that never reached Stripe: the search
    cannot find what Stripe never saw, so its "not found" decides nothing. The call stays
    unknown a day and an hour past the window, through the sweeper and a keyed resend
    alike (409), and nothing is created."""
    monkeypatch.setenv("STRIPE_API_KEY", "sk_test_fake")
    ledger, clock = clocked
    with running_fake("stripe_like", tmp_path / "receipts.jsonl", lag_s=LAG_S) as fake:
        lost, older = LoseAnswers(reached=False), older_release(tmp_path)
        old = Stripe(make_transport, ledger, clock, fake.url, create, inner=lost, providers=older)
        call_id = await lose(old, "lost-3", 500)
        (started,) = [e for e in await ledger.events(call_id) if e.kind == "attempt.started"]
        assert started.data.keys() == STARTED_KEYS  # no op_id_in: as an older release wrote
        await old.transport.aclose()

        clock.advance(2 * DAY + HOUR)
        stripe = Stripe(make_transport, ledger, clock, fake.url, create)
        await left_unknown(stripe, call_id)
        refused = await stripe.pay("lost-3", 500)
        assert refused.status_code == 409, refused.text
        assert error_type(refused) == "effect_unknown"
        assert creates(fake, create) == []
        await finish(stripe.transport)


@pytest.mark.parametrize("create", LATE)
async def test_not_found_never_decides_a_call_one_of_whose_attempts_carried_no_id(
    tmp_path: Path,
    clocked: tuple[Ledger, ManualClock],
    make_transport: MakeTransport,
    finish: Finish,
    create: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An older release sent the create without the operation id and lost its answer;
    after the upgrade, its keyed resend inside the window (carrying the id) is lost too.
    Stripe may have made the object on the first attempt, without our id, and answered
    the resend from its key: "not found" for the id cannot tell, whatever the last attempt
    carried. Past the window and the hour the call stays unknown."""
    monkeypatch.setenv("STRIPE_API_KEY", "sk_test_fake")
    ledger, clock = clocked
    with running_fake("stripe_like", tmp_path / "receipts.jsonl", lag_s=LAG_S) as fake:
        lost, older = LoseAnswers(reached=False), older_release(tmp_path)
        old = Stripe(make_transport, ledger, clock, fake.url, create, inner=lost, providers=older)
        call_id = await lose(old, "lost-4", 700)
        await old.transport.aclose()

        clock.advance(DAY - 600)  # inside the window: resent under Stripe's key
        new = Stripe(make_transport, ledger, clock, fake.url, create,
                     inner=LoseAnswers(reached=False))  # fmt: skip
        assert await lose(new, "lost-4", 700) == call_id
        assert await carried(ledger, call_id) == [None, OP_ID_IN]
        clock.advance(600 + 2 * HOUR)
        await left_unknown(new, call_id)
        assert creates(fake, create) == []
        await finish(new.transport)


@pytest.mark.parametrize(
    ("answer", "reached"),
    [("503", True), ("html", True), ("no-data", True), ("other-op", False)],
)
async def test_a_search_answer_that_proves_nothing_leaves_the_create_unknown(
    tmp_path: Path,
    clocked: tuple[Ledger, ManualClock],
    make_transport: MakeTransport,
    finish: Finish,
    create: str,
    monkeypatch: pytest.MonkeyPatch,
    answer: str,
    reached: bool,
) -> None:
    """Past the window and the freshness, a search answering 503, a 200 HTML page, a 200
    without ``data`` (for an object Stripe did make: none of them is "not found"), or an
    object carrying another operation's id (for one it did not: that is no "found")
    decides nothing: the sweeper records nothing, a keyed resend is refused 409 and
    Stripe sees no second create. Once the search answers as Stripe does, it decides."""
    monkeypatch.setenv("STRIPE_API_KEY", "sk_test_fake")
    ledger, clock = clocked
    with running_fake("stripe_like", tmp_path / "receipts.jsonl", lag_s=LAG_S) as fake:
        stripe = Stripe(make_transport, ledger, clock, fake.url, create,
                        inner=LoseAnswers(reached=reached))  # fmt: skip
        call_id = await lose(stripe, "odd-1", 600)
        made = creates(fake, create)
        assert [r["op"] for r in made] == ([call_id] if reached else [])
        search_answers(fake, answer)
        clock.advance(DAY + 2 * HOUR)
        assert await stripe.sweep() == []
        refused = await stripe.pay("odd-1", 600)
        assert refused.status_code == 409, refused.text
        assert error_type(refused) == "effect_unknown"
        assert await stripe.decisions(call_id) == []
        assert (await ledger.call(call_id)).stage == "effect_unknown"
        assert creates(fake, create) == made

        # The control: the same call, searched as Stripe answers, is decided.
        search_answers(fake, "stripe")
        if made:
            time.sleep(max(0.0, made[0]["ts"] + LAG_S - time.time()))
        # Decided by this sweep, or by the one the transport's runtime made as it started
        # again for it: that sweeper reads the same ledger clock.
        assert await stripe.sweep() in ([call_id], [])
        (decided,) = await stripe.decisions(call_id)
        assert (decided["by"], decided["applied"]) == ("lookup:stripe", reached)
        await finish(stripe.transport)
