"""A late applied answer to an EARLIER attempt of a call (docs/contract.md §2.2, §8, §9).

Attempt 1 is decided not applied while its answer is still on the wire; a keyed resend
starts attempt 2; then attempt 1's late 200 is kept. The provider applied the call,
whatever attempt 2 did: a decision not applied is about the call, so

* a lookup's or the hook's "not applied" about attempt 2 is not recorded, and the note
  says what a person runs instead (``--applied``: ``--accept-evidence`` takes only an
  answer to the current attempt);
* once a person decides it not applied anyway, attempt 2's own late answer (one that is
  not applied) is refused 502 with ``next_operation`` ``none`` and show's "do not
  resend", not ``resend``: the resend would be refused 409 ``late_answer_applied``.
"""

from __future__ import annotations

import contextlib
import shlex
from collections.abc import AsyncIterator
from dataclasses import dataclass
from decimal import Decimal

import httpx
import pytest
import pytest_asyncio
from fencekit import CHAT, UPSTREAM, Upstream, chat, make_runtime, taken_over_mid_call
from pgkit import ledger_url
from test_late_answer import Fenced, ajson, fenced_call, late_refusal

from effectguard.callpath.guard import Guard
from effectguard.callpath.hooks import NotApplied, ReconcileQuestion
from effectguard.callpath.resolve import facts_of
from effectguard.callpath.runtime import Runtime
from effectguard.errors import Refusal
from effectguard.ops.verify import verify_ledger

_ = (ledger_url, fenced_call)  # fixtures

ADVICE = "do not resend: a late answer kept for attempt 1 (status 200)"
#: How that advice ends for a call that carried no Idempotency-Key.
KEYLESS = "sending the request again (it carried no Idempotency-Key) would make the effect again"


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
