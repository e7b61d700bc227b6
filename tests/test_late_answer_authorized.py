"""A late applied answer voids an operator's authorized resend of an effect-unknown call
(docs/contract.md §4, §8).

Attempt 1 is fenced while on the wire (effect unknown); ``reconcile --resend`` authorizes
one resend; that resend is answered 429 (not processed), so the call is effect_unknown
again with the authorization kept. Then attempt 1's late 200 is kept: the provider applied
the call, and the authorized resend would make the effect a second time at a provider that
does not deduplicate. The keyed resend, the proxy's automatic retry and a key-less declared
retry are refused 409 ``late_answer_applied``, nothing sent; the 502 and show say do not
resend and still offer the decision; a resend is no longer authorized once such an answer
is kept. (The resend was sent, and show offered it.)
"""

from __future__ import annotations

import html

import httpx
import pytest
from fencekit import (
    CHAT,
    UPSTREAM,
    Upstream,
    chat,
    make_runtime,
    taken_over_mid_call,
)
from pgkit import ledger_url
from test_late_answer import Fenced, acli, ajson, fenced_call, late_refusal
from test_late_answer_not_processed import resend, retry_meets_late_200

from effectguard.errors import ReconcileError, Refusal
from effectguard.ingress.admin.callpage import call_page
from effectguard.ops.verify import verify_ledger

_ = (ledger_url, fenced_call)  # fixtures

ADVICE = (
    "do not resend: a late answer kept for attempt 1 (status 200) says the provider "
    "applied it though one resend of it was authorized"
)
OFFERED = "one resend is authorized"


@pytest.mark.parametrize("fenced_call", [200], indirect=True)
async def test_an_authorized_keyed_resend_meets_an_earlier_attempts_late_200(
    fenced_call: Fenced,
) -> None:
    """The authorized resend ends not processed (429s, retried to the end) and the call is
    effect_unknown, still authorized; then attempt 1's late 200 is kept. The 502 and show
    say do not resend, offer the decision and no resend; the keyed resend is refused."""
    ledger, call_id = fenced_call.runtime.ledger, fenced_call.call_id
    await ledger.authorize_resend(call_id, note="risk accepted", by="ops")
    other = make_runtime(fenced_call.ledger_url, lease_s=60, heartbeat_s=3600, sweep_s=3600)
    guard = await other.start()
    try:
        limited = Upstream(429)
        answered = await guard.handle(guard.providers["openai"], resend(), limited.send)
        assert answered.status_code == 429
        late = await late_refusal(fenced_call)
        assert (late.status, late.type) == (502, "observe_refused")
        assert (late.stage, late.next_operation) == ("effect_unknown", "reconcile")
        assert ADVICE in late.message, late.message
        state, events = await ledger.call(call_id), await ledger.events(call_id)
        # The stored state is what it was: the rules, not the fold, void the authorization.
        assert (state.stage, state.resend_authorized) == ("effect_unknown", True)
        shown = await ajson("show", call_id, "--ledger", fenced_call.ledger_url)
        assert ADVICE in shown["next_command"], shown
        assert OFFERED not in shown["next_command"], shown
        assert f"effectguard reconcile {call_id}" in shown["next_command"]
        assert "--applied" in shown["next_command"]
        page = call_page(state, events, now=state.created_at, csrf="c")
        assert html.escape(ADVICE) in page
        assert "<th>next operation</th><td>reconcile</td>" in page
        assert 'id="reconcile-applied"' in page

        sent = Upstream(200)
        with pytest.raises(Refusal) as refused:
            await guard.handle(guard.providers["openai"], resend(), sent.send)
        assert (refused.value.status, refused.value.type) == (409, "late_answer_applied")
        assert refused.value.next_operation == "reconcile"
        assert ADVICE in refused.value.message, refused.value.message
        assert sent.sent == 0
        assert (await verify_ledger(ledger)).ok
    finally:
        await other.stop()


@pytest.mark.parametrize("fenced_call", [200], indirect=True)
async def test_the_proxys_automatic_retry_of_an_authorized_resend_stops_at_a_late_200(
    fenced_call: Fenced,
) -> None:
    """Attempt 1's late 200 is kept while the authorized resend's 429 is on its way: the
    proxy's automatic retry of that 429 would be the effect again. It is not sent."""
    ledger, call_id = fenced_call.runtime.ledger, fenced_call.call_id
    await ledger.authorize_resend(call_id, note="risk accepted", by="ops")
    assert await retry_meets_late_200(fenced_call, ADVICE) == "effect_unknown"


@pytest.mark.parametrize("fenced_call", [200], indirect=True)
async def test_no_resend_is_authorized_once_a_late_200_is_kept(fenced_call: Fenced) -> None:
    """``reconcile --resend`` of a call whose late 200 is kept is refused: the provider
    says it applied the call; the person decides it by that answer instead."""
    ledger, call_id = fenced_call.runtime.ledger, fenced_call.call_id
    await late_refusal(fenced_call)
    with pytest.raises(ReconcileError) as refused:
        await ledger.authorize_resend(call_id, note="risk accepted", by="ops")
    assert "says the provider applied it" in str(refused.value), refused.value
    assert "--accept-evidence" in str(refused.value)
    code, _ = await acli(
        "reconcile", call_id, "--resend", "--note", "risk", "--ledger", fenced_call.ledger_url
    )
    assert code != 0
    state = await ledger.call(call_id)
    assert (state.stage, state.resend_authorized) == ("effect_unknown", False)


async def test_a_keyless_authorized_resend_meets_its_own_late_200(ledger_url: str) -> None:
    """A key-less call authorized one resend while its attempt was on the wire; that
    attempt's late 200 is kept. Its declared retries, by hash or by call id, are refused,
    nothing sent; show offers --accept-evidence and no resend."""
    runtime = make_runtime(ledger_url, lease_s=60, heartbeat_s=3600, sweep_s=3600)
    guard = await runtime.start()
    held = Upstream(200, hold=True)
    keyless = httpx.Request("POST", UPSTREAM + CHAT, json=chat("held"))
    ledger = runtime.ledger
    try:
        async with taken_over_mid_call(runtime, guard, keyless, held, interrupt_calls=True) as (
            task,
            _,
        ):
            (call,) = await ledger.calls()
            await ledger.authorize_resend(call.call_id, note="risk accepted", by="ops")
            held.release.set()
            with pytest.raises(Refusal) as late:
                await task
        assert "do not resend" in late.value.message, late.value.message
        sent = Upstream(200)
        for header in ({"x-stainless-retry-count": "1"}, {"Effectguard-Retry-Of": call.call_id}):
            retry = httpx.Request("POST", UPSTREAM + CHAT, json=chat("held"), headers=header)
            with pytest.raises(Refusal) as refused:
                await guard.handle(guard.providers["openai"], retry, sent.send)
            assert (refused.value.status, refused.value.type) == (409, "late_answer_applied")
            assert refused.value.call_id == call.call_id
        assert sent.sent == 0
        shown = await ajson("show", call.call_id, "--ledger", ledger_url)
        assert OFFERED not in shown["next_command"], shown
        assert "--accept-evidence" in shown["next_command"], shown
        assert len(await ledger.calls()) == 1
    finally:
        await runtime.stop()
