"""Ledger verification of budgets kept per period (docs/contract.md §5.5): seeded corruptions.

The ledger's budgets reset by period: ``team`` daily in UTC, ``team/run`` monthly in
Europe/Paris. Its calls are admitted at 23:30 UTC on 31 March 2024, which is already
1 April in Paris: a calendar that read the instant in the wrong zone would label them
``2024-04-01`` and ``2024-03``, so each wrong label below is one a real bug could write.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest
from eventkit import completion
from test_verify import R, Row, raw, request, reseal, verify

from effectguard.ledger import Ledger, Writer, operations
from effectguard.ops.verify import VerifyReport, verify_ledger
from effectguard.rules.budget import BudgetPolicy
from effectguard.rules.events import StoredEvent
from effectguard.testing.clock import ManualClock

AT = datetime(2024, 3, 31, 23, 30, tzinfo=UTC).timestamp()
#: Each node's period at AT, and the label the wrong zone would give.
PERIODS = {"team": "2024-03-31", "team/run": "2024-04"}
WRONG = {"team": "2024-04-01", "team/run": "2024-03"}


@dataclass(frozen=True)
class Periodic:
    """A ledger whose budgets reset by period, and its calls."""

    path: Path
    completed: str
    reconciled: str
    events: int


@pytest.fixture
async def periodic(tmp_path: Path) -> Periodic:
    """One completed and one reconciled call, charged to two budgets that reset by period."""
    path = tmp_path / "ledger.db"
    async with Ledger.open(str(path), clock=ManualClock(AT)) as ledger:
        await ledger.set_policy(BudgetPolicy("team", 10**9, "day", "UTC"))
        await ledger.set_policy(BudgetPolicy("team/run", None, "month", "Europe/Paris"))
        writer = await ledger.store.write(
            Writer("boot", 0),
            lambda tx: operations.register_worker(tx, worker="w1", host="h", pid=1, lease_s=30),
        )
        done = await ledger.admit(writer, request("a"))
        # The store names the periods the call was admitted in (operations.append).
        events = completion(done.call_id, budget="team/run", reserved=R, actual=700)
        await ledger.record(writer, done.call_id, 1, events)
        unknown = await ledger.admit(writer, request("b"))
        await ledger.interrupt(writer, unknown.call_id, 1, "read timeout")
        await ledger.reconcile(unknown.call_id, applied=True, cost=400, note="seen", by="ann")
        report = await verify_ledger(ledger)
    assert report.ok, report.problems
    with raw(path) as conn:
        stored = set(conn.execute("SELECT path, period FROM budget_periods"))
    assert stored == set(PERIODS.items())  # the fixture is what the tests say it is
    return Periodic(path, done.call_id, unknown.call_id, report.events)


@pytest.mark.parametrize("column", ["spent", "reserved", "held"])
@pytest.mark.parametrize("node", sorted(PERIODS))
async def test_a_period_row_disagreeing_with_the_events_is_named(
    periodic: Periodic, node: str, column: str
) -> None:
    """A counter of a day's or a month's row that is not the fold of the events is named
    by its path and period."""
    with raw(periodic.path) as conn:
        conn.execute(
            f"UPDATE budget_periods SET {column} = {column} + 1 WHERE path = ? AND period = ?",
            (node, PERIODS[node]),
        )
    report = await verify(periodic.path)
    assert not report.ok
    assert len(report.problems) == 1, report.problems
    assert report.problems[0].startswith(f"budget {node!r} period {PERIODS[node]}: stored ")
    assert "but the events give" in report.problems[0]


@pytest.mark.parametrize("node", sorted(PERIODS))
async def test_a_period_row_moved_to_another_period_is_named(periodic: Periodic, node: str) -> None:
    """A row relabelled to the wrong period leaves its own period empty and a period the
    events never charged: both are named."""
    with raw(periodic.path) as conn:
        conn.execute("UPDATE budget_periods SET period = ? WHERE path = ?", (WRONG[node], node))
    report = await verify(periodic.path)
    assert not report.ok
    assert sorted(p.split(":")[0] for p in report.problems) == sorted(
        [f"budget {node!r} period {PERIODS[node]}", f"budget {node!r} period {WRONG[node]}"]
    )
    assert any(p.endswith("but the events give reserved=0 spent=0 held=0") for p in report.problems)


def relabel(
    periodic: Periodic, periods: dict[str, str], kind: str | None = None
) -> list[StoredEvent]:
    """Reseal the ledger with the completed call's events that name periods (only its
    ``kind`` event, if given) naming ``periods`` instead. Returns the resealed chain."""

    def edit(rows: list[Row]) -> list[Row]:
        for row in rows:
            chosen = "periods" in row.data if kind is None else row.kind == kind
            if row.call_id == periodic.completed and chosen:
                row.data["periods"] = periods
        return rows

    return reseal(periodic.path, edit)


async def assert_named_at(
    periodic: Periodic, chain: list[StoredEvent], kind: str, periods: dict[str, str]
) -> VerifyReport:
    """Verify fails first at the completed call's ``kind`` event in ``chain``, naming its
    ``periods`` against those the call was admitted in. Returns the report."""
    seq = next(s.seq for s in chain if s.call_id == periodic.completed and s.kind == kind)
    report = await verify(periodic.path)
    assert not report.ok
    assert report.first_broken_seq == seq
    assert report.problems[0] == (
        f"event {seq}: {kind} names periods {periods} but the call was admitted in {PERIODS}"
    )
    return report


@pytest.mark.parametrize("node", sorted(PERIODS))
async def test_an_event_naming_the_wrong_period_is_named(periodic: Periodic, node: str) -> None:
    """A call whose budget events all name the wrong period for one node, resealed and
    re-projected (so the budget rows agree with the events), is named at its reservation:
    the verifier's own calendar says when it was admitted."""
    wrong = PERIODS | {node: WRONG[node]}
    chain = relabel(periodic, wrong)
    report = await assert_named_at(periodic, chain, "budget.reserved", wrong)
    assert all("names periods" in p for p in report.problems), report.problems


async def test_a_later_event_naming_another_period_than_its_reservation_is_named(
    periodic: Periodic,
) -> None:
    """A settlement charged to a period other than the one its call was admitted in is
    named: a call is charged to the period in which it was admitted (§5.5)."""
    chain = relabel(periodic, WRONG, kind="budget.settled")
    await assert_named_at(periodic, chain, "budget.settled", WRONG)
