"""A requests-per-minute limit across three ``effectguard serve`` replicas on one PostgreSQL
ledger, with the database's clock as the only clock (issue #15).

Runs against the real server at ``EFFECTGUARD_TEST_PG_DSN``, in schema ``periods_test``
(dropped before and after).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pgkit import DSN, NEEDS_PG, with_schema
from test_postgres import _post, _serve, _stop_all

from effectguard.ledger import Ledger
from effectguard.ops.verify import verify_ledger
from effectguard.rules.budget import BudgetPolicy
from effectguard.rules.ratelimit import minute_of
from effectguard.testing import fake_provider

SCHEMA = "periods_test"
#: The burst must fit in one minute: it starts in the first seconds of a minute.
LATEST_START_S = 10

pytestmark = NEEDS_PG


def _drop_schema() -> None:
    import psycopg

    with psycopg.connect(DSN, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")


@pytest.fixture
def pg_url() -> Iterator[str]:
    """The ledger in schema ``periods_test``, fresh for the test and dropped after it."""
    _drop_schema()
    yield with_schema(DSN, SCHEMA)
    _drop_schema()


async def _start_of_a_minute() -> None:
    """Wait (at most a minute) until a minute has just begun, so the burst fits in it."""
    while time.time() % 60 >= LATEST_START_S:
        await asyncio.sleep(min(1.0, 60.5 - time.time() % 60))


@pytest.mark.slow
async def test_three_replicas_hold_sixty_requests_per_minute(pg_url: str, tmp_path: Path) -> None:
    """300 clients over three replicas against rpm 60: exactly 60 answered 200 in the minute,
    240 refused 429 rate_limited with retry-after and x-should-retry: true, and nothing of
    the refused reached the provider."""
    async with Ledger.open(pg_url) as ledger:
        await ledger.set_policy(BudgetPolicy("fleet", rpm=60))
    with fake_provider(tmp_path / "receipts.jsonl") as provider:
        replicas = _serve(pg_url, tmp_path, provider.url, 3)
        try:
            limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
            async with httpx.AsyncClient(timeout=60, limits=limits) as client:
                await _start_of_a_minute()
                responses = await asyncio.gather(
                    *(_post(client, replicas[i % 3]) for i in range(300))
                )
        finally:
            _stop_all(replicas)
        statuses = Counter(r.status_code for r in responses)
        refused = [r for r in responses if r.status_code == 429]
        for r in refused:
            assert r.json()["error"]["type"] == "rate_limited"
            assert r.headers["x-should-retry"] == "true"
            assert 1 <= int(r.headers["retry-after"]) <= 60
        effects = len(provider.effects())
    async with Ledger.open(pg_url) as ledger:
        calls = await ledger.calls(limit=1000)
        minutes = {minute_of(c.created_at) for c in calls}
        assert len(minutes) == 1, "the burst straddled a minute of the database's clock"
        assert statuses == {200: 60, 429: 240}, statuses
        assert effects == 60
        assert Counter(c.stage for c in calls) == {"completed": 60, "refused": 240}
        (node,) = [n for n in await ledger.budgets() if n.path == "fleet"]
        assert node.reserved == 0
        report = await verify_ledger(ledger)
        assert report.ok, report.problems
