"""How old an effect-unknown call is, for its lookup, by the ledger's clock alone.

On PostgreSQL the database's clock is the ledger's (contract §7): it times every attempt,
and a replica's host clock may run ahead of it or behind. A lookup's "not found" proves
"not applied" only once the call's last attempt is older than the provider's declared
``freshness_s`` (its search lags), and stops proving it past ``retention_s``. Measured with
the host's clock against the database's time of the attempt, a host running ahead of the
database read a fresh call as old: its "not found", a search that had not caught up yet,
decided it not applied, and the client's keyed resend made a second charge.

Each test moves the database's clock (its test-only offset, as ``test_period_boundary_pg``
does) and counts charges from the fake provider's own receipts.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
from pgkit import NEEDS_PG, pg_url
from toolkit import (
    AUTH,
    KEY,
    SEND,
    SLOW_ANSWER_TIMES_OUT,
    DropFirstSend,
    charge,
    charges,
    declare,
    lost_send,
)

from effectguard import AsyncGuardTransport
from effectguard.ops.verify import verify_ledger
from effectguard.testing import fake_provider
from effectguard.testing.pgclock import set_ledger_clock

pytestmark = NEEDS_PG
_ = (pg_url,)  # fixtures

#: How far the host's clock runs ahead of the database's in these tests: far past the
#: declared freshness, and far inside the retention.
AHEAD_S = 300.0
#: How far the database's clock reads behind the host's when the retention test's call is
#: lost: the host's age of it is then past the freshness and inside the retention.
BEHIND_S = 80.0
#: Where the database's clock then moves, ahead of the host's: past the retention.
AFTER_S = 200.0


async def test_a_host_clock_ahead_of_the_database_decides_no_fresh_call(
    pg_url: str,
    tmp_path: Path,
) -> None:
    """The provider takes a charge and answers too late (effect unknown); its search lags
    2 s. With the host's clock five minutes ahead of the database's, a keyed resend a
    second later is still refused 409 ``effect_unknown``: by the ledger's clock the call
    is younger than the declared freshness (60 s), so "not found" proves nothing. One
    charge at the provider, and the ledger verifies."""
    folder = declare(tmp_path, freshness=60, retention=3600)
    set_ledger_clock(pg_url, time.time() - AHEAD_S)
    lagging = ["--search-lag", "2", "--lookup-key", KEY]
    with fake_provider(tmp_path / "receipts.jsonl", extra_args=lagging) as fake:
        transport = AsyncGuardTransport(
            ledger=pg_url,
            providers=[folder],
            upstreams={"payments": fake.url},
            settings=SLOW_ANSWER_TIMES_OUT,
        )
        headers = {**AUTH, "Idempotency-Key": "pay-ahead"}
        async with httpx.AsyncClient(transport=transport, headers=headers) as client:
            url = fake.url + SEND
            first = await client.post(url, json=charge(5), headers={"x-fake-delay": "3"})
            assert first.status_code == 504, first.text
            await assert_refused_unknown(client, url, charge(5))
            assert len(charges(fake)) == 1
            await finish(transport)


async def test_a_host_clock_behind_the_database_decides_no_call_past_retention(
    pg_url: str,
    tmp_path: Path,
) -> None:
    """A provider that forgets operations after ``retention_s`` (100 s): the call is lost
    on the way (effect unknown) while the database's clock reads 80 s behind the host's,
    then the database's clock moves to 200 s ahead. By the ledger's clock the call is
    280 s old, past retention, so "not found" proves nothing and the keyed resend is
    refused 409, as without skew (``test_lookups_transport``); by the host's clock it was
    80 s old, inside the retention, and was decided not applied and sent again."""
    folder = declare(tmp_path, freshness=60, retention=100)
    set_ledger_clock(pg_url, time.time() - BEHIND_S)
    with fake_provider(tmp_path / "receipts.jsonl", extra_args=["--lookup-key", KEY]) as fake:
        transport = AsyncGuardTransport(
            inner=DropFirstSend(httpx.AsyncHTTPTransport()),
            ledger=pg_url,
            providers=[folder],
            upstreams={"payments": fake.url},
            settings=SLOW_ANSWER_TIMES_OUT,
        )
        headers = {**AUTH, "Idempotency-Key": "pay-behind"}
        async with httpx.AsyncClient(transport=transport, headers=headers) as client:
            url = fake.url + SEND
            call_id = await lost_send(client, url, charge(9))
            set_ledger_clock(pg_url, time.time() + AFTER_S)
            assert_unknown(await past_lease_lapse(client, url, charge(9)))
            assert charges(fake) == []
            events = await transport.ledger.events(call_id)
            assert [e for e in events if e.kind == "call.reconciled"] == []
            await finish(transport)


async def past_lease_lapse(client: httpx.AsyncClient, url: str, body: object) -> httpx.Response:
    """The answer to a keyed resend once the worker's heartbeat has renewed the lease that
    the ledger's clock jumped past: until then a request is refused 503, unsent (contract
    §7). Waits at most 30 s."""
    deadline = time.monotonic() + 30
    while (answer := await client.post(url, json=body)).status_code == 503:
        assert time.monotonic() < deadline, "the worker's lease was never renewed"
        await asyncio.sleep(0.2)
    return answer


async def assert_refused_unknown(client: httpx.AsyncClient, url: str, body: object) -> None:
    """A keyed resend of ``body`` is refused 409 ``effect_unknown``."""
    assert_unknown(await client.post(url, json=body))


def assert_unknown(answer: httpx.Response) -> None:
    """``answer`` is 409 ``effect_unknown``: nothing was sent."""
    assert answer.status_code == 409, answer.text
    assert answer.json()["error"]["type"] == "effect_unknown"


async def finish(transport: AsyncGuardTransport) -> None:
    """The ledger verifies; the transport is closed."""
    report = await verify_ledger(transport.ledger)
    assert report.ok, report.problems
    await transport.aclose()
