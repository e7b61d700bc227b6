"""``effectguard budget set`` with periods and rate limits, and ``budgets --period/--at``."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from admitkit import admit_request
from eventkit import completion
from test_cli import run, run_json

from effectguard.ledger import AdmitRequest, Ledger, Writer, operations
from effectguard.rules import periods
from effectguard.rules.budget import BudgetPolicy
from effectguard.testing.clock import ManualClock

USD = 1_000_000_000


def request(budget: str) -> AdmitRequest:
    """A request charged to ``budget`` reserving 3 USD."""
    return admit_request(budget, model="gpt-4o-mini", reserve=3 * USD)


async def spend(
    path: str,
    usd: int,
    at: float | None = None,
    period: periods.PeriodKind = "month",
    tz: str = "UTC",
) -> None:
    """Admit and settle one call of ``usd`` on ``team`` (resetting every ``period`` in
    ``tz``) at ``at`` (default: now)."""
    clock = None if at is None else ManualClock(at)
    async with Ledger.open(path, clock=clock) as ledger:
        await ledger.set_policy(BudgetPolicy("team", 10 * USD, period, tz))
        writer: Writer = await ledger.store.write(
            Writer("boot", 0),
            lambda tx: operations.register_worker(tx, worker="w", host="h", pid=1, lease_s=60),
        )
        call = (await ledger.admit(writer, request("team"))).call_id
        events = completion(call, budget="team", reserved=3 * USD, actual=usd * USD)
        await ledger.record(writer, call, 1, events)


@pytest.fixture
def past_ledger(tmp_path: Path) -> str:
    """A ledger whose monthly budget ``team`` spent 2 USD in February 2020."""
    path = str(tmp_path / "l.db")
    asyncio.run(spend(path, 2, datetime(2020, 2, 15, tzinfo=UTC).timestamp()))
    return path


def test_budgets_show_the_current_period_by_default(
    past_ledger: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``budgets --json`` shows each node in its current period, with its policy fields."""
    (team,) = run_json(capsys, "budgets", "--ledger", past_ledger)
    assert team["period"] == periods.label("month", "UTC", time.time())
    assert (team["spent_usd"], team["limit_usd"]) == ("0.000000000", "10.000000000")
    assert (team["resets"], team["tz"], team["rpm"], team["tpm"]) == ("month", "UTC", None, None)


@pytest.mark.parametrize("flag", [["--period", "2020-02"], ["--at", "2020-02-29"]])
def test_budgets_show_a_past_period(
    past_ledger: str, capsys: pytest.CaptureFixture[str], flag: list[str]
) -> None:
    """``--period YYYY-MM`` and ``--at DATE`` show what February 2020 spent."""
    (team,) = run_json(capsys, "budgets", *flag, "--ledger", past_ledger)
    assert (team["period"], team["spent_usd"]) == ("2020-02", "2.000000000")


def test_a_period_of_another_form_lists_no_node(
    past_ledger: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--period 2020-02-15`` (a day) shows only daily budgets: none here."""
    assert run_json(capsys, "budgets", "--period", "2020-02-15", "--ledger", past_ledger) == []


def test_budget_set_changes_period_zone_and_rates_and_keeps_the_rest(
    past_ledger: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Flags not given keep their value; ``none`` removes a rate limit."""
    node = run_json(
        capsys, "budget", "set", "team", "--period", "week", "--tz", "Europe/Paris",
        "--rpm", "60", "--tpm", "100000", "--concurrency", "4", "--ledger", past_ledger,
    )  # fmt: skip
    assert (node["resets"], node["tz"], node["limit_usd"]) == (
        "week",
        "Europe/Paris",
        "10.000000000",
    )
    assert (node["rpm"], node["tpm"], node["concurrency"]) == (60, 100000, 4)
    assert node["period"] == periods.label("week", "Europe/Paris", time.time())
    node = run_json(capsys, "budget", "set", "team", "--rpm", "none", "--ledger", past_ledger)
    assert (node["rpm"], node["tpm"]) == (None, 100000)
    code, _, _ = run(capsys, "verify", "--ledger", past_ledger)
    assert code == 0


def test_budget_set_confirms_the_zone_of_the_period(
    past_ledger: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The confirmation line names the zone whose calendar the period follows (the
    default UTC included), so a forgotten or mistyped --tz shows at once."""
    code, out, _ = run(capsys, "budget", "set", "team", "--period", "day", "--tz",
                       "Asia/Kathmandu", "--ledger", past_ledger)  # fmt: skip
    assert (code, out.strip()) == (0, "team: limit 10.000000000 USD per day (Asia/Kathmandu)")
    code, out, _ = run(capsys, "budget", "set", "new", "--period", "week", "--ledger", past_ledger)
    assert (code, out.strip()) == (0, "new: no limit (period week, UTC)")


@pytest.mark.parametrize(
    "args",
    [["--tz", "Mars/Olympus"], ["--period", "year"], ["--rpm", "-1"], []],
    ids=["unknown-zone", "unknown-period", "negative-rpm", "nothing"],
)
def test_budget_set_refuses_bad_policy_with_exit_2(
    past_ledger: str, capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    """An unknown timezone or period, a negative count, or no change exits 2."""
    code, _, err = run(capsys, "budget", "set", "team", *args, "--ledger", past_ledger)
    assert code == 2, err


def test_a_limit_below_what_the_period_spent_warns_and_is_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Setting a limit below this period's spending warns on stderr and still exits 0."""
    path = str(tmp_path / "l.db")
    asyncio.run(spend(path, 2))
    code, out, err = run(capsys, "budget", "set", "team", "--limit", "1", "--ledger", path)
    assert code == 0
    assert "warning" in err and "2.000000000" in err and "1.000000000" in err
    assert "team" in out
    code, _, err = run(capsys, "budget", "set", "team", "--limit", "5", "--ledger", path)
    assert code == 0 and err == ""


def test_the_warning_for_a_total_budget_says_only_a_higher_limit_helps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ``total`` period never ends: the warning says the node admits nothing until its
    limit is raised, never that waiting for its period to end would help."""
    path = str(tmp_path / "l.db")
    asyncio.run(spend(path, 2, period="total"))
    code, out, err = run(capsys, "budget", "set", "team", "--limit", "1", "--ledger", path)
    assert code == 0
    assert "in period total" in err and "until its limit is raised" in err
    assert "period ends" not in err
    assert "USD in total" in out and "per total" not in out  # it read as a period


def test_a_past_day_stays_visible_after_the_node_moves_to_months(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``budgets --period DAY`` still shows what a node spent that day after ``budget set
    --period month``: changing a period moves no charge, and hides none."""
    path = str(tmp_path / "l.db")
    asyncio.run(spend(path, 2, datetime(2020, 2, 15, 12, tzinfo=UTC).timestamp(), "day"))
    assert run(capsys, "budget", "set", "team", "--period", "month", "--ledger", path)[0] == 0
    (team,) = run_json(capsys, "budgets", "--period", "2020-02-15", "--ledger", path)
    assert (team["period"], team["spent_usd"], team["resets"]) == (
        "2020-02-15",
        "2.000000000",
        "month",
    )


@pytest.mark.parametrize("date", ["2026-12-04", "20261204", "2026-W49-5", "2026W495"])
def test_at_a_date_in_any_iso_form_is_each_nodes_local_date(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], date: str
) -> None:
    """``--at`` with a date alone, in any ISO 8601 form (basic ``20261204`` and week dates
    too), names each node's local date: a daily node in Pago Pago (UTC-11) shows 2026-12-04,
    not the day that holds midnight UTC (it showed 2026-12-03 for the basic form)."""
    ledger = str(tmp_path / "l.db")
    run(capsys, "migrate", "--ledger", ledger)
    args = ["--period", "day", "--tz", "Pacific/Pago_Pago", "--ledger", ledger]
    run_json(capsys, "budget", "set", "west", "--limit", "1", *args)
    (west,) = run_json(capsys, "budgets", "--at", date, "--ledger", ledger)
    assert west["period"] == "2026-12-04"


def test_moving_a_nodes_zone_warns_of_the_labels_it_shares_with_the_old_zone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Counters are kept per label, not per zone (contract §5.5). Moving a daily node that
    spent 2 USD today in Tokyo to Los Angeles (17 hours behind: Tokyo's today is Los
    Angeles' today or tomorrow) warns that the Los Angeles day of that label counts those
    2 USD, charged in another day's hours. Moving it between zones whose days are the same
    hours (Paris and Berlin) shares nothing and says nothing."""
    path = str(tmp_path / "l.db")
    asyncio.run(spend(path, 2, period="day", tz="Asia/Tokyo"))
    label = periods.label("day", "Asia/Tokyo", time.time())
    code, out, err = run(
        capsys, "budget", "set", "team", "--tz", "America/Los_Angeles", "--ledger", path
    )
    assert code == 0 and "America/Los_Angeles" in out
    assert "warning" in err and label in err and "2.000000000" in err, err
    assert "Asia/Tokyo" in err
    asyncio.run(spend(path, 1, period="day", tz="Europe/Paris"))
    code, _, err = run(capsys, "budget", "set", "team", "--tz", "Europe/Berlin", "--ledger", path)
    assert code == 0 and err == ""
