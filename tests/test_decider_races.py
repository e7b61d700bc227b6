"""Races between the deciders of an effect-unknown call (docs/contract.md §2.2, §8).

Evidence (a lookup, the application's hook, a person reading the operator page) speaks
of the call as it was when it was gathered. Each test here lets one decider gather its
evidence, moves the call on meanwhile through another (a keyed resend, the sweeper, a
second operator), and then lets the first one decide. The provider's own receipts count
the effects: a decision the evidence did not support shows as a payment made twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
from collections.abc import Awaitable, Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
from hostilekit import HostileSearch, Script, answer, hostile_search
from operatorkit import ADMIN_KEY, PAGE, config_text
from pgkit import ledger_url
from toolkit import KEY, SEND, charge, charges, cli_json, declare, lost_send

from effectguard import Applied, AsyncGuardTransport, NotApplied, ReconcileQuestion, Unknown
from effectguard.callpath.hooks import HookAnswer
from effectguard.testing import FakeProvider, fake_provider, running_proxy

#: A search that finds nothing.
EMPTY = b'{"object": "search_result", "data": []}'
MakeTransport = Callable[..., AsyncGuardTransport]
Finish = Callable[[AsyncGuardTransport], Awaitable[None]]
_ = (ledger_url,)  # fixtures: each test runs on SQLite and on PostgreSQL


class ScriptedNetwork(httpx.AsyncBaseTransport):
    """A network whose n-th ``POST /v1/send`` meets the n-th fate of ``plan``:
    ``lost`` (lost on the way: the provider never sees it), ``unanswered`` (delivered,
    its answer lost: the provider applied it and effectguard cannot know), ``held``
    (held until the test releases it, then unanswered) or ``through``. Everything else
    goes through."""

    def __init__(self, inner: httpx.AsyncBaseTransport, plan: list[str]) -> None:
        self.inner = inner
        self.plan = plan
        self.holding = asyncio.Event()
        self.release = asyncio.Event()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method != "POST" or request.url.path != SEND:
            return await self.inner.handle_async_request(request)
        fate = self.plan.pop(0) if self.plan else "through"
        if fate == "lost":
            raise httpx.ReadError("connection reset after the request was written")
        if fate in ("held", "unanswered"):
            if fate == "held":
                self.holding.set()
                await self.release.wait()
            response = await self.inner.handle_async_request(request)
            await response.aread()
            raise httpx.ReadError("connection reset after the provider answered")
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


class Outbox:
    """The application's reconcile hook, each question answered by the test in turn."""

    def __init__(self) -> None:
        self.questions: asyncio.Queue[tuple[str, asyncio.Future[HookAnswer]]] = asyncio.Queue()

    async def __call__(self, question: ReconcileQuestion) -> HookAnswer:
        answer: asyncio.Future[HookAnswer] = asyncio.get_running_loop().create_future()
        await self.questions.put((question.op_id, answer))
        return await answer

    async def asked(self, op: str) -> asyncio.Future[HookAnswer]:
        """The next question about call ``op``, to answer; one about another call (the
        transport's own periodic sweep) is answered unknown. Bounded: a missing question
        fails the test, never hangs it."""
        async with asyncio.timeout(30):
            while True:
                asked, answer = await self.questions.get()
                if asked == op:
                    return answer
                answer.set_result(Unknown())

    async def answer_rest(self, answer: HookAnswer) -> None:
        """Answer every later question ``answer`` (run as a task; cancel it at the end)."""
        while True:
            _, future = await self.questions.get()
            future.set_result(answer)


@pytest.fixture
def fake(tmp_path: Path) -> FakeProvider:
    """The real fake provider: its receipts are the effects."""
    with fake_provider(tmp_path / "receipts.jsonl") as provider:
        yield provider


def sent(fake: FakeProvider, call_id: str) -> int:
    """How many times the provider received (and applied) ``call_id``."""
    return sum(1 for receipt in charges(fake) if receipt["op"] == call_id)


async def test_the_sweeper_gathers_no_evidence_about_an_attempt_still_on_the_wire(
    tmp_path: Path,
    ledger_url: str,
    make_transport: MakeTransport,
    finish: Finish,
    fake: FakeProvider,
) -> None:
    """The sweeper's page holds two lost calls; while the hook is slow about the first,
    the second's keyed resend is proven not applied and sent again, and that attempt is
    on the wire when the sweeper reaches it. Asked then, the hook truthfully answers
    "not applied"; the attempt then reaches the provider and its answer is lost. That
    answer was about no finished attempt: nothing is recorded, the call stays unknown,
    and its next resend is refused, not sent a third time."""
    network = ScriptedNetwork(httpx.AsyncHTTPTransport(), ["lost", "lost", "held"])
    outbox = Outbox()
    t = make_transport(
        ledger=ledger_url,
        inner=network,
        providers=[declare(tmp_path, freshness=None)],
        upstreams={"payments": fake.url},
        reconcile_hook=outbox,
    )
    client = httpx.AsyncClient(transport=t)
    url = fake.url + SEND
    first = await lost_send(client, url, charge(1), headers={"Idempotency-Key": "first"})
    lost = await lost_send(client, url, charge(2), headers={"Idempotency-Key": "lost"})
    sweep = asyncio.ensure_future((await t.guard()).resolver.sweep())
    slow = await outbox.asked(first)  # the sweeper asks about the oldest first, and waits
    resend = asyncio.ensure_future(
        client.post(url, json=charge(2), headers={"Idempotency-Key": "lost"})
    )
    proof = await outbox.asked(lost)
    proof.set_result(NotApplied())  # true: attempt 1 never reached the provider
    await network.holding.wait()  # attempt 2 is on the wire
    slow.set_result(Unknown())  # the sweeper moves on, to the call being resent
    question = asyncio.ensure_future(outbox.asked(lost))
    await asyncio.wait({question, sweep}, return_when=asyncio.FIRST_COMPLETED)
    network.release.set()  # attempt 2 reaches the provider; its answer is lost
    assert (await resend).status_code == 502
    if question.done():  # the sweeper asked about attempt 2 while it was on the wire
        question.result().set_result(NotApplied())  # true when the application looked
    else:
        question.cancel()
    await sweep
    rest = asyncio.ensure_future(outbox.answer_rest(Unknown()))
    again = await client.post(url, json=charge(2), headers={"Idempotency-Key": "lost"})
    rest.cancel()
    assert sent(fake, lost) == 1  # attempt 2's effect, and no third send
    assert again.status_code == 409, again.text
    assert again.json()["error"]["type"] == "effect_unknown"
    assert (await t.ledger.call(lost)).stage == "effect_unknown"
    with contextlib.suppress(asyncio.CancelledError):
        await rest
    await finish(t)


async def test_a_page_read_before_the_call_was_sent_again_decides_nothing(
    tmp_path: Path,
    ledger_url: str,
    make_transport: MakeTransport,
    finish: Finish,
    fake: FakeProvider,
) -> None:
    """An operator opens a lost call's page. Meanwhile a second operator proves it not
    applied, its keyed resend reaches the provider and loses its answer: unknown again.
    The first operator's "not applied", true of what the page showed, is refused (409),
    and the call is not sent a third time."""
    network = ScriptedNetwork(httpx.AsyncHTTPTransport(), ["lost", "unanswered"])
    folder = declare(tmp_path, freshness=None)
    t = make_transport(
        ledger=ledger_url, inner=network, providers=[folder], upstreams={"payments": fake.url}
    )
    client = httpx.AsyncClient(transport=t)
    url, key = fake.url + SEND, {"Idempotency-Key": "lost"}
    lost = await lost_send(client, url, charge(2), headers=key)
    config = tmp_path / "effectguard.toml"
    config.write_text("[server]\nsweep_s = 3600\n" + config_text())
    log = tmp_path / "proxy.log"
    with running_proxy(ledger_url, args=["--config", str(config)], log_path=log) as proxy:
        page = f"{proxy.url}{PAGE}calls/{lost}"
        admin = {"authorization": f"Bearer {ADMIN_KEY}"}
        shown = httpx.get(page, headers=admin, timeout=30)
        assert shown.status_code == 200 and "reconcile-not_applied" in shown.text
        form = dict(re.findall(r'name="(\w+)" value="([^"]*)"', form_of(shown.text)))
        args = ("reconcile", lost, "--not-applied", "--note", "not on the dashboard")
        cli_json(*args, "--by", "bob", "--ledger", ledger_url)
        resent = await client.post(url, json=charge(2), headers=key)
        assert resent.status_code == 502, resent.text  # attempt 2: applied, answer lost
        form |= {"note": "not on the dashboard when I looked"}
        decided = httpx.post(page + "/reconcile", data=form, headers=admin, timeout=30)
    again = await client.post(url, json=charge(2), headers=key)
    assert sent(fake, lost) == 1  # attempt 2's effect, and no third send
    assert decided.status_code == 409, decided.text
    assert again.status_code == 409, again.text
    assert again.json()["error"]["type"] == "effect_unknown"
    await finish(t)


def form_of(page: str) -> str:
    """The page's "not applied" form."""
    start = page.index('id="reconcile-not_applied"')
    return page[start : page.index("</form>", start)]


async def until_stage(t: AsyncGuardTransport, call_id: str, stage: str) -> None:
    """Wait until ``call_id`` is in ``stage`` (settled in the background, its caller gone)."""
    for _ in range(1000):
        if (await t.ledger.call(call_id)).stage == stage:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"call {call_id} never became {stage}")


async def test_a_retry_after_its_caller_left_is_not_sent_once_evidence_decided_it_applied(
    tmp_path: Path,
    ledger_url: str,
    make_transport: MakeTransport,
    finish: Finish,
    fake: FakeProvider,
) -> None:
    """A key-less call's caller gives up while it is on the wire; the call reaches the
    provider and loses its answer. The sweeper's hook proves it applied before the SDK's
    retry comes: that retry gets the result the hook recovered, as it would have got 409
    ``effect_unknown`` a moment earlier, and is not sent as new work."""
    network = ScriptedNetwork(httpx.AsyncHTTPTransport(), ["held"])
    outbox = Outbox()
    t = make_transport(
        ledger=ledger_url,
        inner=network,
        providers=[declare(tmp_path, freshness=None)],
        upstreams={"payments": fake.url},
        reconcile_hook=outbox,
    )
    client = httpx.AsyncClient(transport=t)
    url = fake.url + SEND
    gone = asyncio.ensure_future(client.post(url, json=charge(5), timeout=30))
    await network.holding.wait()
    (call,) = await t.ledger.calls()
    gone.cancel()  # the caller leaves; the call goes on
    with contextlib.suppress(asyncio.CancelledError):
        await gone
    network.release.set()  # it reaches the provider; its answer is lost
    await until_stage(t, call.call_id, "effect_unknown")
    sweep = asyncio.ensure_future((await t.guard()).resolver.sweep())
    answer = await outbox.asked(call.call_id)
    answer.set_result(Applied(Decimal("0.01"), {"id": "from-outbox", "op": call.call_id}))
    assert await sweep == [call.call_id]
    retry = await client.post(url, json=charge(5), headers={"x-stainless-retry-count": "1"})
    assert len(charges(fake)) == 1  # the one effect, not a second one
    assert retry.status_code == 200, retry.text
    assert retry.headers["effectguard-recovered"] == "hook"
    assert retry.headers["effectguard-call-id"] == call.call_id
    await finish(t)


@pytest.mark.parametrize("matched_by", ["retry-of", "hash"])
async def test_a_retry_is_not_sent_once_a_person_decided_the_call_it_repeats_applied(
    tmp_path: Path,
    ledger_url: str,
    make_transport: MakeTransport,
    finish: Finish,
    fake: FakeProvider,
    matched_by: str,
) -> None:
    """A key-less call loses its answer; the agent's retry, naming the call with
    ``Effectguard-Retry-Of`` or an SDK's retry matched by the request's hash alone, is
    refused 409 ``effect_unknown``. An operator records the call applied, and the next
    retry is refused 409 ``reconciled_applied``: the decision does not turn it into new
    work, a second payment. (Matched by hash, it was sent again until 2026-12-04.)"""
    network = ScriptedNetwork(httpx.AsyncHTTPTransport(), ["unanswered"])
    folder = declare(tmp_path, freshness=None)
    t = make_transport(
        ledger=ledger_url, inner=network, providers=[folder], upstreams={"payments": fake.url}
    )
    client = httpx.AsyncClient(transport=t)
    url = fake.url + SEND
    lost = await lost_send(client, url, charge(6))
    by_hash = {"x-stainless-retry-count": "1"}
    retry = {"Effectguard-Retry-Of": lost} if matched_by == "retry-of" else by_hash
    early = await client.post(url, json=charge(6), headers=retry)
    assert early.status_code == 409, early.text
    assert early.json()["error"]["type"] == "effect_unknown"
    args = ("reconcile", lost, "--applied", "--note", "on the provider's dashboard")
    await asyncio.to_thread(cli_json, *args, "--ledger", ledger_url)
    again = await client.post(url, json=charge(6), headers=retry)
    assert len(charges(fake)) == 1  # the one effect, not a second one
    assert again.status_code == 409, again.text
    assert again.json()["error"]["type"] == "reconciled_applied"
    assert again.headers["effectguard-call-id"] == lost
    await finish(t)


def searched_at(hostile: HostileSearch, folder: Path, timeout_s: float) -> Path:
    """``folder``'s ``payments`` declaration with its lookup sent to ``hostile``, answering
    within ``timeout_s``, a found object checked to carry the call's op id."""
    path = folder / "payments.toml"
    text = path.read_text().replace("{base_url}/v1/search", hostile.url + "/v1/search")
    match = 'match = "metadata.effectguard_op"'
    path.write_text(text.replace("timeout_s = 5", f"timeout_s = {timeout_s}\n{match}"))
    return folder


async def searches(hostile: HostileSearch, seen: int, also: asyncio.Future[Any]) -> bool:
    """Wait until the lookup endpoint has seen more than ``seen`` searches (True), or
    ``also`` is done first (False)."""
    for _ in range(3000):
        if hostile.hits("/v1/search") > seen:
            return True
        if also.done():
            return False
        await asyncio.sleep(0.01)
    raise AssertionError("no search came, and the command did not end")


@pytest.mark.slow
async def test_reconcile_auto_asks_nothing_about_a_call_resent_since_it_listed_it(
    tmp_path: Path,
    ledger_url: str,
    make_transport: MakeTransport,
    finish: Finish,
    fake: FakeProvider,
) -> None:
    """``reconcile --auto`` lists two lost calls and hangs on the newer one's lookup;
    meanwhile an operator decides the other not applied and its keyed resend through a
    running transport sends it again: that attempt is on the wire when the command
    reaches the call. Its search then truthfully finds nothing; the attempt reaches the
    provider and loses its answer. Nothing is recorded of that search, and the call is
    not sent a third time. (Only the command searches: the transport declares no
    lookup, so its own sweeps ask nothing.)"""
    (tmp_path / "auto").mkdir()
    (tmp_path / "transport").mkdir()
    with hostile_search() as hostile:
        folder = searched_at(hostile, declare(tmp_path / "auto", freshness=0), timeout_s=4)
        network = ScriptedNetwork(httpx.AsyncHTTPTransport(), ["lost", "lost", "held"])
        t = make_transport(
            ledger=ledger_url,
            inner=network,
            providers=[declare(tmp_path / "transport", freshness=None)],
            upstreams={"payments": fake.url},
        )
        # The resend waits out the command's search (a second's pause) before its answer:
        # httpx's default 5 s was too short for it on a loaded machine (a bound, not a timing).
        client = httpx.AsyncClient(transport=t, timeout=60)
        url, key = fake.url + SEND, {"Idempotency-Key": "lost"}
        lost = await lost_send(client, url, charge(2), headers=key)
        # Newer, so listed first (the command lists the newest first).
        await lost_send(client, url, charge(1), headers={"Idempotency-Key": "newer"})
        hostile.follow(Script((b"",), ending="hang"))
        seen = hostile.hits("/v1/search")
        auto = asyncio.ensure_future(reconcile_auto(ledger_url, folder, fake.url))
        assert await searches(hostile, seen, auto)  # the newer call's lookup hangs
        hostile.follow(Script(tuple(answer(200, EMPTY).partition(b"\r\n\r\n")), pause_s=1.0))
        args = ("reconcile", lost, "--not-applied", "--note", "not on the dashboard")
        await asyncio.to_thread(cli_json, *args, "--ledger", ledger_url)
        resend = asyncio.ensure_future(client.post(url, json=charge(2), headers=key))
        await network.holding.wait()  # attempt 2 is on the wire
        await searches(hostile, hostile.hits("/v1/search"), auto)
        network.release.set()  # attempt 2 reaches the provider; its answer is lost
        assert (await resend).status_code == 502
        await auto
        again = await client.post(url, json=charge(2), headers=key)
    assert sent(fake, lost) == 1  # attempt 2's effect, and no third send
    assert again.status_code == 409, again.text
    assert again.json()["error"]["type"] == "effect_unknown"
    await finish(t)


async def reconcile_auto(ledger: str, folder: Path, upstream: str) -> None:
    """``effectguard reconcile --auto`` in a process of its own, as an operator runs it."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        *("-m", "effectguard", "reconcile", "--auto", "--ledger", ledger),
        *("--providers", str(folder), "--upstream", f"payments={upstream}"),
        env={**os.environ, "PAYMENTS_API_KEY": KEY},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, errors = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, errors.decode()
