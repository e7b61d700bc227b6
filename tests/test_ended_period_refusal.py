"""A later attempt of a call is charged to the period the call was admitted in (contract
§5.5), even once that period has ended. When that period is full, the attempt is refused
402 for good: the message says so, names the ended period, and gives the ways out (a new
key, which is a new call charged to the current period; or an operator raising the
node's limit). Before, it read like an ordinary full budget ("has 0.0001 USD of room in
period 2027-01-15"), and a client waiting for the next period waited for ever.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from effectguard import AsyncGuardTransport
from effectguard.ledger import Ledger
from effectguard.ops.cli import main as cli_main
from effectguard.rules.budget import BudgetPolicy
from effectguard.testing.clock import ManualClock

CHAT_URL = "https://api.openai.com/v1/chat/completions"
ANSWER = (
    b'{"id": "c", "object": "chat.completion", "model": "gpt-4o-mini", "choices": [],'
    b' "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}'
)
MIDNIGHT = 1_800_057_600.0  # 2027-01-16T00:00:00Z: day 2027-01-15 ends here


def _reply(request: httpx.Request) -> httpx.Response:
    # The first request (content "first") is refused before any work: not processed.
    if b'"first"' in request.content:
        return httpx.Response(400, json={"error": {"message": "bad", "type": "invalid"}})
    return httpx.Response(
        200, headers={"content-type": "application/json"}, stream=httpx.ByteStream(ANSWER)
    )


async def _resend_past_midnight(ledger: str) -> httpx.Response:
    """A keyed call not processed at 23:59:55, another filling that day, then at 00:00:05
    the keyed resend: its answer."""
    clock = ManualClock(start=MIDNIGHT - 5)
    async with Ledger.open(ledger, clock=clock) as led:
        await led.set_policy(BudgetPolicy("team", period="day"))
        transport = AsyncGuardTransport(httpx.MockTransport(_reply), ledger=led)
        budget = {"Effectguard-Budget": "team"}
        async with httpx.AsyncClient(transport=transport, headers=budget) as client:

            async def chat(content: str, **headers: str) -> httpx.Response:
                body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": content}]}
                return await client.post(CHAT_URL, json=body, headers=headers)

            first = await chat("first", **{"Idempotency-Key": "job-7"})
            assert first.status_code == 400  # not processed: decided not applied
            (call,) = await led.calls()
            # Room for one reservation on 2027-01-15, which another call then takes.
            limit = call.reserved_at_admission
            await led.set_policy(BudgetPolicy("team", limit=limit, period="day"))
            assert (await chat("other")).status_code == 200
            clock.advance(10)  # 2027-01-16 00:00:05 (inside the writer's lease)
            return await chat("first", **{"Idempotency-Key": "job-7"})


def test_a_keyed_resend_into_a_full_ended_period_names_it_and_the_way_out(
    tmp_path: Path,
) -> None:
    ledger = str(tmp_path / "l.db")
    again = asyncio.run(_resend_past_midnight(ledger))
    assert again.status_code == 402, again.text
    message = again.json()["error"]["message"]
    assert "admitted in period 2027-01-15" in message and "has ended" in message, message
    assert "new Idempotency-Key" in message and "raise" in message, message
    assert cli_main(["verify", "--ledger", ledger]) == 0
