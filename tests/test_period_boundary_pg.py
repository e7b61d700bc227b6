"""A daily budget at its period boundary across three ``effectguard serve`` replicas on one
PostgreSQL ledger, with the database's clock as the only clock (issue #15).

The ledger's clock is the database's ``effectguard_now()``; the test moves it (the
test-only ``clock_offset``, :mod:`effectguard.testing.pgclock`) so that midnight in the
budget's timezone is seconds away instead of hours. No host clock decides a period.

Runs against the real server at ``EFFECTGUARD_TEST_PG_DSN``, each test in a schema of
its own (dropped after).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
from observing import cli_json
from pgkit import NEEDS_PG, pg_url  # noqa: F401
from test_postgres import _post, _reservation, _serve, _stop_all

from effectguard.ledger import Ledger
from effectguard.ledger.postgres import PostgresSession, Target
from effectguard.ops.cli import main as cli_main
from effectguard.rules import periods
from effectguard.rules.budget import BudgetPolicy
from effectguard.testing import fake_provider
from effectguard.testing.pgclock import ledger_clock, set_ledger_clock

pytestmark = NEEDS_PG

#: A half-hour zone: its midnight is nobody's UTC midnight, so the declared zone decides.
TZ = "Asia/Kolkata"
#: Reservations a period has room for.
ROOM = 20
CLIENTS = 300
#: Seconds of the ledger's clock before the boundary when the replicas start: enough for
#: three processes to start, after which the test waits for the burst's start.
LEAD_S = 12.0
#: The clients start one after another over this many seconds, centred on the boundary.
SPREAD_S = 3.0
#: The provider holds each admitted call this long, so every reservation of the burst is
#: still held while the rest is decided (a settled call would free what it did not spend).
HOLD_S = 12.0


def _next_midnight(at: float, tz: str) -> float:
    """The first instant of the local day after the one containing ``at`` in ``tz``."""
    today = periods.label("day", tz, at)
    tomorrow = periods.label_of_date("day", periods.first_day(today) + timedelta(days=1))
    bounds = periods.bounds(tomorrow, tz)
    assert bounds is not None
    return bounds[0]


def test_the_store_reads_the_moved_database_clock(pg_url: str, caplog: Any) -> None:  # noqa: F811
    """set_ledger_clock moves what the store's transactions read as now (the database's
    clock plus the offset), and a store opened on a moved clock warns that it is moved."""
    assert set_ledger_clock(pg_url, None) == 0.0
    moved_to = time.time() + 86_400.0
    set_ledger_clock(pg_url, moved_to)
    assert abs(ledger_clock(pg_url) - moved_to) < 5.0
    with caplog.at_level(logging.WARNING, logger="effectguard.ledger"):
        session = PostgresSession(Target.parse(pg_url))
    try:
        session.begin()
        assert abs(session.now() - moved_to) < 5.0
        session.commit()
    finally:
        session.close()
    assert any("clock is shifted" in r.getMessage() for r in caplog.records)
    assert set_ledger_clock(pg_url, None) == 0.0
    assert abs(ledger_clock(pg_url) - time.time()) < 5.0


def test_budgets_show_the_period_of_the_database_clock(pg_url: str) -> None:  # noqa: F811
    """Without --period, `effectguard budgets` shows the period admission would charge now:
    the database's clock decides it, not the host's."""
    moved_to = time.time() + 3 * 86_400.0
    assert cli_main(["migrate", "--ledger", pg_url]) == 0  # the CLI makes no ledger but so
    assert cli_json(
        "budget", "set", "team", "--limit", "5", "--period", "day", "--tz", TZ, "--ledger", pg_url
    )
    try:
        set_ledger_clock(pg_url, moved_to)
        (node,) = [n for n in cli_json("budgets", "--ledger", pg_url) if n["path"] == "team"]
    finally:
        set_ledger_clock(pg_url, None)
    assert node["period"] == periods.label("day", TZ, moved_to)
    assert node["period"] != periods.label("day", TZ, time.time())


async def _burst(replicas: list[Any], boundary_at: float) -> list[httpx.Response]:
    """CLIENTS concurrent clients, started one after another over SPREAD_S seconds of this
    host's monotonic clock centred on ``boundary_at`` (also monotonic), over the replicas."""
    limits = httpx.Limits(max_connections=CLIENTS + 50, max_keepalive_connections=CLIENTS + 50)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def one(i: int) -> httpx.Response:
            start = boundary_at - SPREAD_S / 2 + SPREAD_S * i / CLIENTS
            await asyncio.sleep(max(0.0, start - time.monotonic()))
            return await _post(client, replicas[i % 3], **{"x-fake-tag": f"c{i}"})

        return await asyncio.gather(*(one(i) for i in range(CLIENTS)))


@pytest.mark.slow
def test_three_replicas_admit_what_each_day_has_room_for(pg_url: str, tmp_path: Path) -> None:  # noqa: F811
    """300 clients over three replicas across midnight of a daily budget: each day admits
    exactly the reservations it has room for, the rest are refused 402, only the admitted
    reach the provider, and each day's counters hold exactly its own calls."""
    reserve = _reservation()
    limit = ROOM * reserve

    async def declare() -> None:
        async with Ledger.open(pg_url) as ledger:
            await ledger.set_policy(BudgetPolicy("fleet", limit=limit, period="day", tz=TZ))

    asyncio.run(declare())
    # Moved before the replicas start: a jump of hours under running replicas would lapse
    # every lease at once and let them fence each other.
    boundary = _next_midnight(ledger_clock(pg_url), TZ)
    set_ledger_clock(pg_url, boundary - LEAD_S)
    boundary_at = time.monotonic() + LEAD_S  # the boundary on this host's monotonic clock
    with fake_provider(tmp_path / "receipts.jsonl", delay=HOLD_S) as provider:
        replicas = _serve(pg_url, tmp_path, provider.url, 3)
        try:
            assert time.monotonic() < boundary_at - SPREAD_S / 2, "replicas started too slowly"
            responses = asyncio.run(_burst(replicas, boundary_at))
        finally:
            _stop_all(replicas)
        receipts = provider.effects()
    _check_burst(pg_url, responses, receipts, boundary, limit)


def _check_burst(
    url: str,
    responses: list[httpx.Response],
    receipts: list[dict[str, Any]],
    boundary: float,
    limit: int,
) -> None:
    """What each side of ``boundary`` admitted, from the answers, the provider's receipts,
    ``effectguard calls --json`` and ``effectguard budgets --period DAY --json``."""
    before, after = periods.label("day", TZ, boundary - 1), periods.label("day", TZ, boundary)
    statuses = Counter(r.status_code for r in responses)
    assert set(statuses) <= {200, 402}, statuses
    calls = {c["call_id"]: c for c in cli_json("calls", "--budget", "fleet", "--ledger", url)}
    assert len(calls) == CLIENTS
    # The day of each call is the day of its admission on the ledger's (database's) clock.
    day = {cid: periods.label("day", TZ, c["created_at"]) for cid, c in calls.items()}
    tried = Counter(day.values())
    assert set(tried) == {before, after}
    # The burst straddled the boundary with more clients than room on each side (else this
    # run cannot show a full day; it says nothing about admission).
    assert tried[before] > ROOM and tried[after] > ROOM, f"did not straddle: {tried}"
    admitted = {r.headers["effectguard-call-id"]: r for r in responses if r.status_code == 200}
    assert Counter(day[cid] for cid in admitted) == {before: ROOM, after: ROOM}
    assert {c["stage"] for cid, c in calls.items() if cid not in admitted} == {"refused"}
    for r in responses:
        if r.status_code == 402:
            assert r.json()["error"]["type"] == "budget_exceeded"
    # Exactly the admitted calls reached the provider, each once.
    sent = sorted(r["tag"] for r in receipts)
    assert sent == sorted(r.request.headers["x-fake-tag"] for r in admitted.values())
    for label in (before, after):
        rows = cli_json("budgets", "--period", label, "--ledger", url)
        (row,) = [b for b in rows if b["path"] == "fleet"]
        assert row["resets"] == "day" and row["tz"] == TZ
        assert Decimal(row["reserved_usd"]) == 0 and Decimal(row["held_usd"]) == 0
        cost = sum(Decimal(calls[cid]["cost_usd"]) for cid in admitted if day[cid] == label)
        assert Decimal(row["spent_usd"]) == cost > 0
        assert Decimal(row["spent_usd"]) <= Decimal(row["limit_usd"]) == Decimal(limit) / 10**9
    verify = cli_json("verify", "--ledger", url)
    assert verify["ok"], verify
