# ruff: noqa: F811  (the store contract's fixtures are imported by name and used as arguments)
"""Budget periods on every store (memory, SQLite, PostgreSQL): limits per period, charges
kept in the admission's period, past periods queryable, and a boundary under concurrency.

The tests move the ledger's clock to their boundaries (:class:`clockkit.LedgerTime`): a
manual clock on memory and SQLite, the database's clock on PostgreSQL, each test in a
schema of its own. Every ledger here is verified by the independent verifier when its
test ends (the ``ledger`` fixture of the store contract), which re-derives each
admission's periods.
"""

from __future__ import annotations

import asyncio
import sqlite3
from datetime import datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from clockkit import LedgerTime, recorded_at
from test_store_contract import (  # noqa: F401  (fixtures)
    R,
    admit_ok,
    completion,
    lapse,
    ledger,
    ledger_url,
    ns,
    register,
    req,
    store_kind,
)

from effectguard.ledger import Ledger, Writer
from effectguard.ledger.sqliteschema import MIGRATIONS
from effectguard.ops.verify import verify_ledger
from effectguard.rules import periods
from effectguard.rules.budget import BudgetPolicy
from effectguard.rules.budgetview import budget_view, view_periods
from effectguard.testing.clock import ManualClock

BERLIN = "Europe/Berlin"


def local(text: str, tz: str = BERLIN) -> float:
    """A wall-clock time in ``tz`` as an instant."""
    return datetime.fromisoformat(text).replace(tzinfo=ZoneInfo(tz)).timestamp()


#: Where the manual clocks here start: before every date the tests move them to.
CLOCK_START = "2026-01-01T00:00:00"


@pytest.fixture
def clock(store_kind: str) -> ManualClock | None:
    """A manual ledger clock from the start of 2026 (PostgreSQL: the database's clock)."""
    return None if store_kind == "postgres" else ManualClock(local(CLOCK_START))


@pytest.fixture
def moves(clock: ManualClock | None, ledger_url: str) -> LedgerTime:
    """The test's hand on the ledger's clock: the manual one, or the database's."""
    return LedgerTime(clock) if clock is not None else LedgerTime(None, ledger_url)


@pytest.fixture
async def w1(ledger: Ledger, ns: str) -> Writer:
    """A live worker whose lease outlasts every clock jump in these tests."""
    return await register(ledger, f"{ns}-w1", lease_s=10**9)


async def in_period(ledger: Ledger, path: str, label: str) -> tuple[int | None, int, int, int]:
    """``(limit, reserved, spent, held)`` of ``path`` in period ``label``."""
    for n in await ledger.budgets(period=label):
        if n.path == path:
            return n.limit, n.reserved, n.spent, n.held
    raise AssertionError(f"no budget node {path!r} in {label}")


async def test_a_daily_limit_resets_at_local_midnight(
    ledger: Ledger, w1: Writer, ns: str, moves: LedgerTime
) -> None:
    """Room for two calls a day: the third is refused (402 naming the period) until local
    midnight, which on Berlin's last Sunday of October comes 25 hours after the day began:
    still refused 24 hours in, and a millisecond before the 25th hour ends; admitted at it."""
    day_start, next_midnight = local("2026-10-25T00:00:00"), local("2026-10-26T00:00:00")
    moves.set(day_start)
    await ledger.set_policy(BudgetPolicy(ns, 2 * R, "day", BERLIN))
    await admit_ok(ledger, w1, req(ns))
    await admit_ok(ledger, w1, req(ns))
    refused = await ledger.admit(w1, req(ns))
    assert refused.refusal is not None and refused.refusal.status == 402
    assert "2026-10-25" in refused.refusal.message
    moves.advance(24 * 3600)  # a 24-hour day would have ended here (23:00 local)
    late = await ledger.admit(w1, req(ns))
    assert late.refusal is not None and "2026-10-25" in late.refusal.message
    moves.advance(3600 - 0.001)  # 23:59:59.999 local, 25 hours less a millisecond in
    last = await ledger.admit(w1, req(ns))
    decided_at = await recorded_at(ledger, last.call_id)
    # The database's clock runs on past the target; judge the answer by when it was given.
    assert (last.action == "admit") == (decided_at >= next_midnight)
    if moves.exact:  # a clock that stands still is refused exactly here
        assert last.action == "refuse"
    moves.advance(0.001)  # local midnight: 25 hours after the day began
    assert moves.target - day_start == 25 * 3600
    for _ in range(2 - (last.action == "admit")):
        await admit_ok(ledger, w1, req(ns))
    assert (await ledger.admit(w1, req(ns))).action == "refuse"
    assert await in_period(ledger, ns, "2026-10-25") == (2 * R, 2 * R, 0, 0)
    assert await in_period(ledger, ns, "2026-10-26") == (2 * R, 2 * R, 0, 0)


async def test_a_settlement_after_the_boundary_lands_in_the_admission_period(
    ledger: Ledger, w1: Writer, ns: str, moves: LedgerTime
) -> None:
    """Calls admitted in the last minute of a day and settled, interrupted or reconciled
    after midnight (on the night DST starts) are charged to the day they were admitted;
    the new day starts empty."""
    moves.set(local("2026-03-28T23:59:00"))
    await ledger.set_policy(BudgetPolicy(ns, 10 * R, "day", BERLIN))
    settled = await admit_ok(ledger, w1, req(ns))
    unknown = await admit_ok(ledger, w1, req(ns))
    moves.advance(3600)
    await ledger.record(w1, settled.call_id, 1, completion(settled.call_id, f"{ns}/run", 700))
    await ledger.interrupt(w1, unknown.call_id, 1, "reset")
    assert await in_period(ledger, ns, "2026-03-28") == (10 * R, 0, 700, R)
    await ledger.reconcile(unknown.call_id, applied=True, cost=300, note="n", by="ann")
    assert await in_period(ledger, ns, "2026-03-28") == (10 * R, 0, 1000, 0)
    assert await in_period(ledger, ns, "2026-03-29") == (10 * R, 0, 0, 0)
    now = {n.path: n for n in await ledger.budgets()}
    assert (now[ns].period, now[ns].spent) == ("2026-03-29", 0)


async def test_each_ancestor_is_checked_in_its_own_period(
    ledger: Ledger, w1: Writer, ns: str, moves: LedgerTime
) -> None:
    """A monthly root in UTC and a daily child in New York: a new day frees the child, but
    the month's room is shared by both days; the refusal names the node that is full."""
    moves.set(local("2026-11-30T23:59:00", "America/New_York"))
    await ledger.set_policy(BudgetPolicy(ns, 3 * R, "month", "UTC"))
    await ledger.set_policy(BudgetPolicy(f"{ns}/run", 2 * R, "day", "America/New_York"))
    first = await admit_ok(ledger, w1, req(ns))
    await admit_ok(ledger, w1, req(ns))
    day_full = await ledger.admit(w1, req(ns))
    assert day_full.refusal is not None and f"'{ns}/run'" in day_full.refusal.message
    moves.advance(60)  # New York's Dec 1 (05:00 UTC)
    await admit_ok(ledger, w1, req(ns))  # December: a new month in UTC as well
    events = await ledger.events(first.call_id)
    reserved = next(e for e in events if e.kind == "budget.reserved")
    assert reserved.data["periods"] == {ns: "2026-12", f"{ns}/run": "2026-11-30"}
    assert await in_period(ledger, ns, "2026-12") == (3 * R, 3 * R, 0, 0)


async def test_the_root_month_holds_across_days(
    ledger: Ledger, w1: Writer, ns: str, moves: LedgerTime
) -> None:
    """A daily child with room left is still refused when its monthly parent is full."""
    moves.set(local("2026-12-10T12:00:00", "UTC"))
    await ledger.set_policy(BudgetPolicy(ns, 3 * R, "month", "UTC"))
    await ledger.set_policy(BudgetPolicy(f"{ns}/run", 2 * R, "day", "UTC"))
    await admit_ok(ledger, w1, req(ns))
    await admit_ok(ledger, w1, req(ns))
    moves.advance(86400)
    await admit_ok(ledger, w1, req(ns))
    month_full = await ledger.admit(w1, req(ns))
    assert month_full.refusal is not None and f"budget '{ns}' " in month_full.refusal.message
    assert "2026-12" in month_full.refusal.message


async def test_a_resumed_call_is_charged_to_its_admission_period(
    ledger: Ledger, w1: Writer, ns: str, moves: LedgerTime
) -> None:
    """A not-sent call resumed under its key the next day reserves in the day it was
    admitted (and against that day's room)."""
    from effectguard.rules.events import AttemptNotSent, BudgetReleased

    moves.set(local("2026-12-01T23:00:00", "UTC"))
    await ledger.set_policy(BudgetPolicy(ns, 5 * R, "day", "UTC"))
    first = await admit_ok(ledger, w1, req(ns, key="k1"))
    await ledger.record(
        w1,
        first.call_id,
        1,
        [
            AttemptNotSent(call=first.call_id, attempt=1, reason="connect error"),
            BudgetReleased(call=first.call_id, budget=f"{ns}/run", amount=R),
        ],
    )
    moves.advance(7200)
    again = await ledger.admit(w1, req(ns, key="k1"))
    assert (again.action, again.call_id) == ("attempt", first.call_id)
    reserved = [e for e in await ledger.events(first.call_id) if e.kind == "budget.reserved"]
    assert periods.label("day", "UTC", reserved[-1].at) == "2026-12-02"  # reserved the next day
    assert await in_period(ledger, ns, "2026-12-01") == (5 * R, R, 0, 0)
    assert await in_period(ledger, ns, "2026-12-02") == (5 * R, 0, 0, 0)


async def test_a_period_and_its_limit_apply_on_every_store(
    ledger: Ledger, w1: Writer, ns: str
) -> None:
    """On every store (PostgreSQL with its own clock) a daily limit is checked against the
    day the database says it is, and the call is charged there."""
    await ledger.set_policy(BudgetPolicy(ns, 2 * R, "day", "UTC"))
    call = await admit_ok(ledger, w1, req(ns))
    reserved = next(e for e in await ledger.events(call.call_id) if e.kind == "budget.reserved")
    day = reserved.data["periods"][ns]
    assert day == periods.label("day", "UTC", reserved.at)
    await ledger.record(w1, call.call_id, 1, completion(call.call_id, f"{ns}/run", 1500))
    assert await in_period(ledger, ns, day) == (2 * R, 0, 1500, 0)
    refused = await ledger.admit(w1, req(ns))
    if periods.label("day", "UTC", reserved.at + 1) == day:  # not at a boundary by chance
        assert refused.action == "refuse"


async def test_the_limit_keeps_the_rest_of_the_policy(ledger: Ledger, ns: str) -> None:
    """Setting only a limit (as the config file does) keeps the period, zone and rates."""
    await ledger.set_policy(BudgetPolicy(ns, R, "week", BERLIN, rpm=5))
    await ledger.set_limit(ns, 2 * R)
    assert (await ledger.policies())[ns] == BudgetPolicy(ns, 2 * R, "week", BERLIN, rpm=5)


async def test_a_restart_changes_no_counter(ledger_url: str, ns: str, store_kind: str) -> None:
    """Closing and reopening the ledger gives every (path, period) counter back unchanged."""
    if store_kind == "memory":
        pytest.skip("a memory ledger does not outlive its process")
    clock = None if store_kind == "postgres" else ManualClock(local("2026-12-01T10:00:00"))
    async with Ledger.open(ledger_url, clock=clock) as led:
        writer = await register(led, f"{ns}-w", lease_s=10**9)
        await led.set_policy(BudgetPolicy(ns, 10 * R, "day", BERLIN, rpm=100))
        a = await admit_ok(led, writer, req(ns))
        await admit_ok(led, writer, req(ns))
        await led.record(writer, a.call_id, 1, completion(a.call_id, f"{ns}/run", 400))
        before = (await led.store.budget_nodes(), await led.policies())
    async with Ledger.open(ledger_url, clock=clock) as led:
        assert (await led.store.budget_nodes(), await led.policies()) == before
        report = await verify_ledger(led)
        assert report.ok, report.problems


async def test_concurrent_clients_across_the_boundary_admit_each_periods_room(
    tmp_path: Path, ns: str
) -> None:
    """Two ledgers on one SQLite file, 160 concurrent admissions, the clock crossing midnight
    in the middle: each day admits exactly its room, no more, wherever the boundary falls."""
    url = str(tmp_path / "l.db")
    c = ManualClock(local("2026-10-25T23:59:59.5"))
    room = 10
    async with Ledger.open(url, clock=c) as a, Ledger.open(url, clock=c) as b:
        await a.set_policy(BudgetPolicy(ns, room * R, "day", BERLIN))
        wa = await register(a, f"{ns}-a", lease_s=10**9)
        wb = await register(b, f"{ns}-b", lease_s=10**9)
        done_before = asyncio.Event()
        finished = 0

        async def client(led: Ledger, writer: Writer) -> str:
            nonlocal finished
            result = await led.admit(writer, req(ns))
            finished += 1
            if finished == 40:
                done_before.set()
            return result.action

        async def cross_midnight() -> list[str]:
            await done_before.wait()
            c.advance(0.5)  # midnight, while the first wave may still be committing
            return await asyncio.gather(
                *(client(led, w) for _ in range(40) for led, w in ((a, wa), (b, wb)))
            )

        first = [client(led, w) for _ in range(40) for led, w in ((a, wa), (b, wb))]
        results = await asyncio.gather(*first, cross_midnight())
        assert len(results) == 81
        assert await in_period(a, ns, "2026-10-25") == (room * R, room * R, 0, 0)
        assert await in_period(a, ns, "2026-10-26") == (room * R, room * R, 0, 0)
        report = await verify_ledger(a)
        assert report.ok, report.problems


def test_an_old_ledger_keeps_its_counters_as_total(tmp_path: Path) -> None:
    """Migrating a ledger made before periods moves each node's counters to period total
    and keeps its limit as a policy."""
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as conn:
        for statement in MIGRATIONS[0][2]:
            conn.execute(statement)
        conn.execute(
            "CREATE TABLE migrations (version INTEGER PRIMARY KEY, name TEXT, applied_at REAL)"
        )
        conn.execute("INSERT INTO migrations VALUES (1, 'v1', 0)")
        conn.execute("INSERT INTO budgets VALUES ('a', 100, 0, 7, 2)")

    async def reopen() -> None:
        async with Ledger.open(str(path)) as led:
            nodes = await led.store.budget_nodes()
            assert [(n.path, n.period, n.reserved, n.spent, n.held) for n in nodes] == [
                ("a", "total", 0, 7, 2)
            ]
            assert (await led.policies())["a"] == BudgetPolicy("a", 100)

    asyncio.run(reopen())


async def test_a_clock_stepped_back_across_midnight_keeps_charging_the_new_day(
    ledger: Ledger, w1: Writer, ns: str, moves: LedgerTime, store_kind: str
) -> None:
    """On PostgreSQL (the one clock a test can step back here): a day with room for one
    call spends it just after Berlin midnight; the database's clock then steps back 20 s.
    The next call is refused in the new day, not charged to the old day's room."""
    if store_kind != "postgres":
        pytest.skip("a manual clock only moves forward; test_clock_steps steps SQLite's")
    midnight = local("2026-03-10T00:00:00")
    moves.set(midnight + 5)
    await ledger.set_policy(BudgetPolicy(ns, R, "day", BERLIN))
    await admit_ok(ledger, w1, req(ns))
    moves.set(midnight - 20)
    refused = await ledger.admit(w1, req(ns))
    assert refused.refusal is not None and "2026-03-10" in refused.refusal.message
    assert await in_period(ledger, ns, "2026-03-09") == (R, 0, 0, 0)


async def test_a_view_reads_only_its_periods_and_shows_what_every_row_would(
    ledger: Ledger, w1: Writer, ns: str, moves: LedgerTime
) -> None:
    """A view of one period reads, of a node with a policy, only that period's counters (a
    daily node gains a row a day; a page of today read every past day), and shows exactly
    what the view of every stored row shows: for today, a past instant, a local date, a
    day's, a month's and the total's label, at every depth. A node moved from daily to
    monthly keeps its past days visible by label; a node with no policy keeps its rows."""
    moves.set(local("2026-11-29T22:30:00", "UTC"))
    await ledger.set_policy(BudgetPolicy(ns, 100 * R, "month", BERLIN))
    await ledger.set_policy(BudgetPolicy(f"{ns}/a", 10 * R, "day", "UTC"))
    await ledger.set_policy(BudgetPolicy(f"{ns}/k", 10 * R, "day", "Asia/Kathmandu"))
    await ledger.set_policy(BudgetPolicy(f"{ns}/moved", 10 * R, "day", "UTC"))
    for _ in range(3):  # three days, charged on each node and one without a policy
        for budget in ("a", "k", "moved", "a/run"):
            await admit_ok(ledger, w1, req(ns, budget=f"{ns}/{budget}"))
        moves.advance(86400)
    await ledger.set_policy(BudgetPolicy(f"{ns}/moved", 10 * R, "month", "UTC"))
    policies = await ledger.policies()
    every_row = await ledger.store.budget_nodes()
    at = await ledger.store.clock_now()
    views: list[dict[str, object]] = [
        {"at": at},
        {"at": local("2026-11-30T12:00:00", "UTC")},
        {"on": datetime(2026, 11, 30).date()},
        {"period": "2026-11-30"},
        {"period": "2026-12"},
        {"period": "total"},
    ]
    for view in views:
        for depth in (None, 1, 2):
            shown = await ledger.budgets(depth=depth, **view)  # type: ignore[arg-type]
            kept = {p: v for p, v in policies.items() if depth is None or p.count("/") < depth}
            rows = [n for n in every_row if depth is None or n.path.count("/") < depth]
            when = view.get("at", at)
            expected = budget_view(kept, rows, when, view.get("period"), view.get("on"))  # type: ignore[arg-type]
            assert shown == expected, (view, depth)
    today = await ledger.store.budget_nodes(None, view_periods(policies, at))
    assert {n.key for n in today} < {n.key for n in every_row}
    assert {n.key for n in every_row if n.path == f"{ns}/a/run"} <= {n.key for n in today}
    past_days = {n.period for n in every_row if n.path == f"{ns}/a"} - {n.period for n in today}
    assert len(past_days) == 3  # its three past days' rows were not read (today has none)
    subtree = await ledger.budgets(under=f"{ns}/a")
    assert [n.path for n in subtree] == [f"{ns}/a", f"{ns}/a/run"]
    assert await ledger.budgets(under=f"{ns}/_") == await ledger.budgets(under=f"{ns}/%") == []
    moved = {n.path: n for n in await ledger.budgets(period="2026-11-30")}
    assert moved[f"{ns}/moved"].reserved == R  # a past day of a node now monthly


async def test_a_subtree_is_a_path_compared_whole_with_its_case(
    ledger: Ledger, w1: Writer, ns: str
) -> None:
    """``team`` is not ``TEAM``: SQLite's ``LIKE`` ignores ASCII case, so a concurrency
    limit on one node counted the other's calls in flight, and listings mixed them."""
    await ledger.set_policy(BudgetPolicy(f"{ns}/a", concurrency=1))
    upper = await admit_ok(ledger, w1, req(ns, budget=f"{ns}/A/run"))  # stays in flight
    lower = await admit_ok(ledger, w1, req(ns, budget=f"{ns}/a/run", request_hash="h2"))
    assert [c.call_id for c in await ledger.calls(budget=f"{ns}/a")] == [lower.call_id]
    assert [c.call_id for c in await ledger.calls(budget=f"{ns}/A")] == [upper.call_id]
    assert [n.path for n in await ledger.budgets(under=f"{ns}/a")] == [f"{ns}/a", f"{ns}/a/run"]
    full = await ledger.admit(w1, req(ns, budget=f"{ns}/a/run", request_hash="h3"))
    assert full.refusal is not None and full.refusal.status == 429  # its own call counts
