"""A late applied answer to an EARLIER attempt of a call (docs/contract.md §2.2, §8, §9).

Attempt 1 is decided not applied while its answer is still on the wire; a keyed resend
starts attempt 2; then attempt 1's late 200 is kept. The provider applied the call,
whatever attempt 2 did: a decision not applied is about the call, so

* a lookup's or the hook's "not applied" about attempt 2 is not recorded, and the note
  says what a person runs instead (``--applied``: ``--accept-evidence`` takes only an
  answer to the current attempt);
* ``show`` and the operator page offer ``--applied`` first, and ``--not-applied`` only
  behind a warning that the evidence says applied (so they do, ``--accept-evidence``
  first, for a call its CURRENT attempt's late 200 says applied);
* ``reconcile --accept-evidence`` refuses to decide "not applied" by the current
  attempt's unprocessed answer while an earlier attempt's kept 200 says applied;
* once a person decides it not applied anyway, attempt 2's own late answer (one that is
  not applied) is refused 502 with ``next_operation`` ``none`` and show's "do not
  resend", not ``resend``: the resend would be refused 409 ``late_answer_applied``.
"""

from __future__ import annotations

import contextlib
import html
import shlex
from collections.abc import AsyncIterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from fencekit import CHAT, UPSTREAM, Upstream, chat, make_runtime, taken_over_mid_call
from operatorkit import ADMIN_KEY, PAGE, config_text
from pgkit import ledger_url
from test_late_answer import Fenced, acli, ajson, fenced_call, late_refusal

from effectguard.callpath.guard import Guard
from effectguard.callpath.hooks import NotApplied, ReconcileQuestion
from effectguard.callpath.resolve import facts_of
from effectguard.callpath.runtime import Runtime
from effectguard.errors import ReconcileError, Refusal
from effectguard.ops.verify import verify_ledger
from effectguard.testing import running_proxy

_ = (ledger_url, fenced_call)  # fixtures

ADVICE = "do not resend: a late answer kept for attempt 1 (status 200)"
#: How that advice ends for a call that carried no Idempotency-Key.
KEYLESS = "sending the request again (it carried no Idempotency-Key) would make the effect again"

#: How every offer of a decision the evidence contradicts begins.
AGAINST = "only if you know the provider did not apply it"
#: How the offer of the decision the evidence proves begins.
APPLIED = "the provider applied the call, whichever attempt made the effect"


def resend() -> httpx.Request:
    """The held call's keyed resend."""
    return httpx.Request(
        "POST", UPSTREAM + CHAT, json=chat("held"), headers={"Idempotency-Key": "k"}
    )


@dataclass
class Resent:
    """Attempt 1 decided not applied and resent; attempt 2 ended effect unknown."""

    fenced: Fenced
    runtime: Runtime
    guard: Guard


@pytest_asyncio.fixture
async def resent(fenced_call: Fenced) -> AsyncIterator[Resent]:
    """The fenced call decided not applied, resent by another runtime (attempt 2, a 500:
    effect unknown), then attempt 1's late 200 kept."""
    ledger, call_id = fenced_call.runtime.ledger, fenced_call.call_id
    await ledger.reconcile(call_id, applied=False, note="none seen", by="ops")
    other = make_runtime(fenced_call.ledger_url, lease_s=60, heartbeat_s=3600, sweep_s=3600)
    guard = await other.start()
    try:
        with contextlib.suppress(Refusal):
            await guard.handle(guard.providers["openai"], resend(), Upstream(500).send)
        await late_refusal(fenced_call)
        state = await ledger.call(call_id)
        assert (state.stage, state.attempts) == ("effect_unknown", 2)
        yield Resent(fenced_call, other, guard)
    finally:
        await other.stop()


@pytest.mark.parametrize("fenced_call", [200], indirect=True)
async def test_an_automated_not_applied_never_goes_against_an_earlier_attempts_200(
    resent: Resent,
) -> None:
    """The hook says "not applied" about attempt 2: not recorded, since attempt 1's late
    200 says the provider applied the call. The note's advice is ``--applied`` (the answer
    implies a cost), which a person runs as printed; not ``--accept-evidence``, which is
    refused for an answer to an earlier attempt. (The hook's decision was recorded.)"""
    ledger, call_id = resent.runtime.ledger, resent.fenced.call_id

    async def hook(question: ReconcileQuestion) -> NotApplied:
        return NotApplied()

    resolver = resent.guard.resolver
    resolver.hook = hook
    assert await resolver.sweep() == []
    assert (await ledger.call(call_id)).stage == "effect_unknown"

    facts = await facts_of(ledger, call_id)
    assert facts is not None
    said = await resolver.decide(facts)
    assert said.verdict == "unknown", said
    assert "late answer kept for attempt 1 (status 200)" in said.note, said.note
    (command,) = said.note.split("`")[1::2]  # the one command offered
    assert command == (
        f"effectguard reconcile {call_id} --applied [--cost USD] --note TEXT --attempt 2"
    )
    (late,) = (await ajson("show", call_id, "--ledger", resent.fenced.ledger_url))["evidence"]
    implied = Decimal(late["cost"]) / 10**9
    assert f"that answer implies {implied:.9f} USD" in said.note, said.note

    # The command runs as printed (the cost the answer implies put in): exit 0, applied.
    run = shlex.split(command.replace("[--cost USD]", f"--cost {implied}"))
    run = [arg.replace("TEXT", "late 200 to attempt 1") for arg in run]
    decided = await ajson(*run[1:], "--ledger", resent.fenced.ledger_url)
    assert decided["stage"] == "reconciled_applied"
    assert Decimal(decided["cost_usd"]) == implied
    assert (await verify_ledger(ledger)).ok


@pytest.mark.parametrize("fenced_call", [200], indirect=True)
async def test_show_and_the_page_offer_applied_first_and_not_applied_behind_a_warning(
    resent: Resent, tmp_path: Path
) -> None:
    """Attempt 1's late 200 is kept; the call is effect_unknown at attempt 2. ``show``
    (text and ``--json``) and the operator page offer ``--applied`` first, as the
    deciders' refusal advises, and ``--not-applied`` only behind a warning that the
    evidence says applied. (They offered ``--applied | --not-applied`` as equals, the page
    "Not applied" first: a person could free the resend of an applied call.)"""
    call_id, url = resent.fenced.call_id, resent.fenced.ledger_url
    shown = await ajson("show", call_id, "--ledger", url)
    choices = shown["next_command"].split(" | ")
    assert choices[0].startswith(APPLIED), choices
    assert "--applied [--cost USD] --note TEXT --attempt 2`" in choices[0], choices
    against = [c for c in choices if "--not-applied" in c]
    assert len(against) == 1 and against[0].startswith(AGAINST), choices
    assert "late answer kept for attempt 1 (status 200)" in against[0], choices
    code, text = await acli("show", call_id, "--ledger", url)
    offered = [line.strip() for line in text.split("\nnext\n")[1].splitlines()]
    assert code == 0 and offered[0].startswith(APPLIED), offered
    assert [o for o in offered if "--not-applied" in o] == ["or " + against[0]], offered

    page = operator_page(url, call_id, tmp_path)
    applied, not_applied = (
        page.index('id="reconcile-applied"'),
        page.index('id="reconcile-not_applied"'),
    )
    assert page.index(APPLIED) < applied < not_applied, page
    form = page[not_applied : page.index("</form>", not_applied)]
    assert AGAINST in form and "late answer kept for attempt 1 (status 200)" in form, form


@pytest.mark.parametrize("fenced_call", [200], indirect=True)
@pytest.mark.parametrize("status", [400, 429, 500])
async def test_a_later_attempts_late_answer_does_not_say_resend_a_contradicted_call(
    fenced_call: Fenced, status: int
) -> None:
    """Attempt 1 decided not applied; its keyed resend, attempt 2, is fenced in turn while
    on the wire; attempt 1's late 200 is kept; a person decides the call not applied
    again; then attempt 2's late answer arrives, one that is not applied (not processed,
    or of unknown effect). Attempt 1's kept 200 forbids the resend, so that 502 says
    next_operation ``none`` and show's advice, as the 409 the resend gets does. (It said
    ``resend``: only the arriving answer was read.)"""
    ledger, call_id = fenced_call.runtime.ledger, fenced_call.call_id
    await ledger.reconcile(call_id, applied=False, note="none seen", by="ops")
    other = make_runtime(fenced_call.ledger_url, lease_s=60, heartbeat_s=3600, sweep_s=3600)
    guard = await other.start()
    upstream = Upstream(status, hold=True)
    try:
        async with taken_over_mid_call(other, guard, resend(), upstream, interrupt_calls=True) as (
            task,
            _,
        ):
            await late_refusal(fenced_call)
            state = await ledger.call(call_id)
            assert (state.stage, state.attempts) == ("effect_unknown", 2)
            await ledger.reconcile(call_id, applied=False, note="none seen again", by="ops")
            upstream.release.set()
            with pytest.raises(Refusal) as refused:
                await task
        refusal = refused.value
        assert (refusal.status, refusal.type) == (502, "observe_refused")
        assert f"its answer (status {status}) is kept as evidence" in refusal.message
        assert (refusal.stage, refusal.next_operation) == ("reconciled_not_applied", "none")
        assert ADVICE in refusal.message, refusal.message
        with pytest.raises(Refusal) as again:
            await guard.handle(guard.providers["openai"], resend(), Upstream(200).send)
        assert (again.value.status, again.value.type) == (409, "late_answer_applied")
        assert ADVICE in again.value.message
        assert (await verify_ledger(ledger)).ok
    finally:
        await other.stop()


async def test_a_keyless_calls_do_not_resend_names_no_idempotency_key(ledger_url: str) -> None:
    """A call that carried no Idempotency-Key, decided not applied, that its late 200
    says the provider applied: the 502, show and the 409 its declared retry gets say do
    not resend in words that fit it (a resend is a new call), not "a resend with the same
    Idempotency-Key", which it never had. (They said so.)"""
    runtime = make_runtime(ledger_url, lease_s=60, heartbeat_s=3600, sweep_s=3600)
    guard = await runtime.start()
    upstream = Upstream(200, hold=True)
    keyless = httpx.Request("POST", UPSTREAM + CHAT, json=chat("held"))
    try:
        async with taken_over_mid_call(runtime, guard, keyless, upstream, interrupt_calls=True) as (
            task,
            _,
        ):
            (call,) = await runtime.ledger.calls()
            await runtime.ledger.reconcile(call.call_id, applied=False, note="none", by="ops")
            upstream.release.set()
            with pytest.raises(Refusal) as late:
                await task
        retry = httpx.Request(
            "POST",
            UPSTREAM + CHAT,
            json=chat("held"),
            headers={"Effectguard-Retry-Of": call.call_id},
        )
        with pytest.raises(Refusal) as refused:
            await guard.handle(guard.providers["openai"], retry, upstream.send)
        assert (refused.value.status, refused.value.type) == (409, "late_answer_applied")
        shown = await ajson("show", call.call_id, "--ledger", ledger_url)
        for said in (late.value.message, refused.value.message, shown["next_command"]):
            assert ADVICE in said, said
            assert "Idempotency-Key would" not in said, said
            assert KEYLESS in said, said
        assert upstream.sent == 1
    finally:
        await runtime.stop()


async def test_a_retry_by_hash_meets_an_older_contradicted_call_past_a_newer_decided_one(
    ledger_url: str,
) -> None:
    """Two identical key-less calls, both decided not applied: the older one's late 200
    says the provider applied it, the newer one nothing does. A declared retry matched by
    hash repeats "the most recent call ... decided not applied while a late answer says
    the provider applied it" (contract §4): the older one, so it is refused 409
    ``late_answer_applied``, nothing sent. (Only the newest call decided not applied was
    looked at: the retry was new work, sent.)"""
    runtime = make_runtime(ledger_url, lease_s=60, heartbeat_s=3600, sweep_s=3600)
    other = make_runtime(ledger_url, lease_s=60, heartbeat_s=3600, sweep_s=3600)
    guard = await runtime.start()
    held = Upstream(200, hold=True)
    keyless = httpx.Request("POST", UPSTREAM + CHAT, json=chat("held"))
    ledger = runtime.ledger
    try:
        async with taken_over_mid_call(runtime, guard, keyless, held, interrupt_calls=True) as (
            task,
            _,
        ):
            (older,) = await ledger.calls()
            await ledger.reconcile(older.call_id, applied=False, note="none", by="ops")
            held.release.set()
            with pytest.raises(Refusal):
                await task
        guard = await other.start()  # the first runtime's worker was fenced
        unknown = Upstream(500)
        again = httpx.Request("POST", UPSTREAM + CHAT, json=chat("held"))
        with contextlib.suppress(Refusal):  # the provider's 500 is passed on
            await guard.handle(guard.providers["openai"], again, unknown.send)
        (newer,) = [c for c in await ledger.calls() if c.call_id != older.call_id]
        assert (newer.stage, unknown.sent) == ("effect_unknown", 1)
        await ledger.reconcile(newer.call_id, applied=False, note="none", by="ops")

        retry = httpx.Request(
            "POST", UPSTREAM + CHAT, json=chat("held"), headers={"x-stainless-retry-count": "1"}
        )
        sent = Upstream(200)
        with pytest.raises(Refusal) as refused:
            await guard.handle(guard.providers["openai"], retry, sent.send)
        assert (refused.value.status, refused.value.type) == (409, "late_answer_applied")
        assert refused.value.call_id == older.call_id
        assert ADVICE in refused.value.message
        assert sent.sent == 0
        assert len(await ledger.calls()) == 2
    finally:
        await other.stop()
        await runtime.stop()


def operator_page(url: str, call_id: str, tmp_path: Path) -> str:
    """The call's operator page, served by a proxy on ``url``, unescaped."""
    config = tmp_path / "effectguard.toml"
    config.write_text(config_text())
    log = tmp_path / "proxy.log"  # beside a file ledger by default; a DSN is none
    with running_proxy(url, args=["--config", str(config)], log_path=log) as proxy:
        got = httpx.get(
            f"{proxy.url}{PAGE}calls/{call_id}", headers={"authorization": f"Bearer {ADMIN_KEY}"}
        )
    assert got.status_code == 200, got.text
    return html.unescape(got.text)


@pytest.mark.parametrize("fenced_call", [200], indirect=True)
async def test_the_current_attempts_200_puts_not_applied_behind_the_same_warning(
    fenced_call: Fenced, tmp_path: Path
) -> None:
    """The call's own (current) attempt's late 200 is kept. ``show`` offers
    ``--accept-evidence`` first (it decides by that answer), ``--applied`` next, and
    ``--not-applied`` only behind the warning an earlier attempt's 200 gets; the page puts
    "Applied" first and that warning in the "Not applied" form. (They offered
    ``--applied | --not-applied`` as equals, the page "Not applied" first.)"""
    await late_refusal(fenced_call)
    await fenced_call.runtime.stop()
    call_id, url = fenced_call.call_id, fenced_call.ledger_url
    shown = await ajson("show", call_id, "--ledger", url)
    choices = shown["next_command"].split(" | ")
    assert "--accept-evidence [--note TEXT] --attempt 1" in choices[0], choices
    against = [c for c in choices if "--not-applied" in c]
    assert len(against) == 1 and against[0].startswith(AGAINST), choices
    assert "late answer kept for attempt 1 (status 200)" in against[0], choices
    assert choices.index(against[0]) == len(choices) - 1, choices
    code, text = await acli("show", call_id, "--ledger", url)
    offered = [line.strip() for line in text.split("\nnext\n")[1].splitlines()]
    assert code == 0 and "--accept-evidence" in offered[0], offered
    assert [o for o in offered if "--not-applied" in o] == ["or " + against[0]], offered

    page = operator_page(url, call_id, tmp_path)
    applied, not_applied = (
        page.index('id="reconcile-applied"'),
        page.index('id="reconcile-not_applied"'),
    )
    assert page.index("--accept-evidence") < applied < not_applied, page
    form = page[not_applied : page.index("</form>", not_applied)]
    assert AGAINST in form and "late answer kept for attempt 1 (status 200)" in form, form


@pytest.mark.parametrize("fenced_call", [200], indirect=True)
async def test_accept_evidence_refuses_not_applied_against_an_earlier_attempts_200(
    fenced_call: Fenced,
) -> None:
    """Attempt 1 decided not applied; its keyed resend, attempt 2, fenced on the wire;
    attempt 1's late 200 kept; then attempt 2's late 429 (not processed) kept, the call
    still effect_unknown. ``reconcile --accept-evidence`` decides by the evidence, which as
    a whole says applied: refused, exit 3, naming attempt 1's answer and the ``--applied``
    command; nothing recorded. A person can still decide ``--not-applied`` by hand. (It
    decided "not applied" by attempt 2's 429, with no warning.)"""
    ledger, call_id = fenced_call.runtime.ledger, fenced_call.call_id
    await ledger.reconcile(call_id, applied=False, note="none seen", by="ops")
    other = make_runtime(fenced_call.ledger_url, lease_s=60, heartbeat_s=3600, sweep_s=3600)
    guard = await other.start()
    upstream = Upstream(429, hold=True)
    try:
        async with taken_over_mid_call(other, guard, resend(), upstream, interrupt_calls=True) as (
            task,
            _,
        ):
            await late_refusal(fenced_call)
            upstream.release.set()
            with pytest.raises(Refusal):
                await task
        (late,) = [
            e.data
            for e in await ledger.events(call_id)
            if e.data.get("attempt") == 2 and e.kind == "attempt.late_answer"
        ]
        assert (late["status"], late["effect"]) == (429, "none")
        state = await ledger.call(call_id)
        assert (state.stage, state.attempts) == ("effect_unknown", 2)
    finally:
        await other.stop()

    url = fenced_call.ledger_url
    code, out = await acli(
        "reconcile", call_id, "--accept-evidence", "--attempt", "2", "--ledger", url
    )
    assert code == 3, out
    with pytest.raises(ReconcileError) as refused:
        await ledger.accept_evidence(call_id, note=None, by="ops", attempt=2)
    said = str(refused.value)
    assert "late answer kept for attempt 1 (status 200)" in said, said
    assert APPLIED in said and f"reconcile {call_id} --applied" in said, said
    assert "--attempt 2" in said, said
    state = await ledger.call(call_id)
    assert state.stage == "effect_unknown"
    decided = await ajson(
        "reconcile",
        call_id,
        "--not-applied",
        "--note",
        "reversed at the provider",
        "--attempt",
        "2",
        "--ledger",
        url,
    )
    assert decided["stage"] == "reconciled_not_applied"
    assert (await verify_ledger(ledger)).ok
