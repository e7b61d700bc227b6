"""A late applied answer to an earlier attempt of a call whose later attempt proved
nothing (docs/contract.md §4, §6, §8).

Attempt 1 is fenced while on the wire (effect unknown); a person decides it not applied;
its keyed resend, attempt 2, is answered 429, which the provider declares not processed,
so the call is ``not_processed``, whose next operation is ``resend``. Attempt
1's late 200, kept as evidence, says the provider applied the call: a resend (the client's
keyed one, or the proxy's own automatic retry) would make the effect a second time at a
provider that does not deduplicate. Both are refused 409 ``late_answer_applied``, nothing
sent, and show says do not resend. (Both were sent: only a call decided not applied was
read for that evidence.)
"""

from __future__ import annotations

import html

import httpx
import pytest
from fencekit import CHAT, UPSTREAM, Upstream, answer_body, chat, make_runtime
from pgkit import ledger_url
from test_late_answer import Fenced, ajson, fenced_call, late_refusal

from effectguard.errors import Refusal
from effectguard.ingress.admin.callpage import call_page
from effectguard.ops.verify import verify_ledger

_ = (ledger_url, fenced_call)  # fixtures

ADVICE = "do not resend: a late answer kept for attempt 1 (status 200)"
#: How the advice goes on for a call whose later attempt was not processed.
SAYS = " says the provider applied it though its last attempt was not processed"


def resend() -> httpx.Request:
    """The fenced call's keyed resend."""
    return httpx.Request(
        "POST", UPSTREAM + CHAT, json=chat("held"), headers={"Idempotency-Key": "k"}
    )


@pytest.mark.parametrize("fenced_call", [200], indirect=True)
async def test_a_keyed_resend_of_a_not_processed_call_meets_an_earlier_attempts_200(
    fenced_call: Fenced,
) -> None:
    """The resend ends not_processed (429, retried to the end); then attempt
    1's late 200 is kept. The client's keyed resend is refused, nothing sent."""
    ledger, call_id = fenced_call.runtime.ledger, fenced_call.call_id
    await ledger.reconcile(call_id, applied=False, note="none seen", by="ops")
    other = make_runtime(fenced_call.ledger_url, lease_s=60, heartbeat_s=3600, sweep_s=3600)
    guard = await other.start()
    try:
        limited = Upstream(429)
        answered = await guard.handle(guard.providers["openai"], resend(), limited.send)
        assert answered.status_code == 429
        late = await late_refusal(fenced_call)
        assert (late.status, late.type, late.next_operation) == (502, "observe_refused", "none")
        assert ADVICE + SAYS in late.message, late.message
        state, events = await ledger.call(call_id), await ledger.events(call_id)
        assert state.stage == "not_processed"
        shown = await ajson("show", call_id, "--ledger", fenced_call.ledger_url)
        assert ADVICE + SAYS in shown["next_command"], shown
        page = call_page(state, events, now=state.created_at, csrf="c")
        assert html.escape(ADVICE + SAYS) in page
        assert "<th>next operation</th><td>none</td>" in page

        sent = Upstream(200)
        with pytest.raises(Refusal) as refused:
            await guard.handle(guard.providers["openai"], resend(), sent.send)
        assert (refused.value.status, refused.value.type) == (409, "late_answer_applied")
        assert refused.value.next_operation == "none"
        assert f"call {call_id} rests not_processed after its last attempt" in refused.value.message
        assert ADVICE in refused.value.message, refused.value.message
        assert sent.sent == 0
        assert (await verify_ledger(ledger)).ok
    finally:
        await other.stop()


async def retry_meets_late_200(fenced_call: Fenced, advice: str) -> str:
    """The fenced call's keyed resend, through a second runtime: its first attempt is
    answered 429 while attempt 1's late 200 arrives, and the proxy's automatic retry of
    that 429 must not be sent: 409 ``late_answer_applied`` saying ``advice``, one request
    sent, the ledger verifying. The call's stage after (its attempts are then 2)."""
    ledger, call_id = fenced_call.runtime.ledger, fenced_call.call_id
    other = make_runtime(fenced_call.ledger_url, lease_s=60, heartbeat_s=3600, sweep_s=3600)
    guard = await other.start()
    sent: list[int] = []

    async def limited_then_ok(request: httpx.Request) -> httpx.Response:
        status = 429 if not sent else 200
        sent.append(status)
        if status == 429:
            await late_refusal(fenced_call)  # attempt 1's 200 arrives meanwhile
        return httpx.Response(
            status,
            headers={"content-type": "application/json"},
            stream=httpx.ByteStream(answer_body(status)),
            request=request,
        )

    try:
        with pytest.raises(Refusal) as refused:
            await guard.handle(guard.providers["openai"], resend(), limited_then_ok)
        assert (refused.value.status, refused.value.type) == (409, "late_answer_applied")
        assert advice in refused.value.message, refused.value.message
        assert sent == [429]
        state = await ledger.call(call_id)
        assert state.attempts == 2, state
        assert (await verify_ledger(ledger)).ok
        return state.stage
    finally:
        await other.stop()


@pytest.mark.parametrize("fenced_call", [200], indirect=True)
async def test_the_proxys_automatic_retry_stops_at_an_earlier_attempts_200(
    fenced_call: Fenced,
) -> None:
    """Attempt 1's late 200 is kept while the resend's 429 is on its way: the
    proxy's automatic retry of that 429 would be the effect again. It is not sent; the
    client is answered 409 ``late_answer_applied``."""
    ledger, call_id = fenced_call.runtime.ledger, fenced_call.call_id
    await ledger.reconcile(call_id, applied=False, note="none seen", by="ops")
    assert await retry_meets_late_200(fenced_call, ADVICE) == "not_processed"
