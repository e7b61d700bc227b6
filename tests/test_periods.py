"""Budget periods (issue #15): labels, bounds and DST, and the per-period budget fold. Pure."""

from __future__ import annotations

from datetime import UTC, date, datetime
from zoneinfo import ZoneInfo

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from effectguard.ops.audit.calendar import period_of
from effectguard.rules import budget, periods
from effectguard.rules.budget import BudgetPolicy, check_admission, labels_at, period_nodes
from effectguard.rules.budgetview import budget_view
from effectguard.rules.events import (
    BudgetLimitSet,
    BudgetReserved,
    BudgetSettled,
    Event,
)

#: Zones with DST changes at 02:00 or 03:00, at midnight (Havana, Santiago), by 30 minutes
#: (Lord Howe), south of the equator, and without DST at all.
ZONES = [
    "UTC",
    "Europe/Berlin",
    "America/New_York",
    "America/Havana",
    "America/Santiago",
    "Australia/Lord_Howe",
    "Pacific/Chatham",
    "Asia/Kolkata",
    "America/Sao_Paulo",
]
KINDS: list[periods.PeriodKind] = ["day", "week", "month"]
#: 1995-01-01 .. 2045-01-01
INSTANTS = st.floats(min_value=788_918_400, max_value=2_366_841_600, allow_nan=False)


def at(text: str, tz: str) -> float:
    """A local wall-clock time in ``tz`` as an instant."""
    return datetime.fromisoformat(text).replace(tzinfo=ZoneInfo(tz)).timestamp()


# -- labels ------------------------------------------------------------------------------


def test_labels_name_the_day_the_iso_week_and_the_month() -> None:
    """2026-12-01 12:00 UTC is day 2026-12-01, week 2026-W49, month 2026-12; total is total."""
    t = datetime(2026, 12, 1, 12, tzinfo=UTC).timestamp()
    assert periods.label("day", "UTC", t) == "2026-12-01"
    assert periods.label("week", "UTC", t) == "2026-W49"
    assert periods.label("month", "UTC", t) == "2026-12"
    assert periods.label("total", "UTC", t) == "total"


def test_a_label_is_read_in_the_nodes_timezone() -> None:
    """The same instant is still November 30 in New York while it is December 1 in UTC."""
    t = datetime(2026, 12, 1, 3, tzinfo=UTC).timestamp()
    assert periods.label("day", "UTC", t) == "2026-12-01"
    assert periods.label("day", "America/New_York", t) == "2026-11-30"
    assert periods.label("month", "America/New_York", t) == "2026-11"


def test_iso_weeks_cross_the_year() -> None:
    """2027-01-01 (a Friday) belongs to ISO week 2026-W53."""
    t = datetime(2027, 1, 1, 12, tzinfo=UTC).timestamp()
    assert periods.label("week", "UTC", t) == "2026-W53"


def test_dst_days_are_23_and_25_hours_long() -> None:
    """In Berlin the day DST starts is 23 hours long and the day it ends is 25."""
    start, end = periods.bounds("2026-03-29", "Europe/Berlin")  # type: ignore[misc]
    assert end - start == 23 * 3600
    start, end = periods.bounds("2026-10-25", "Europe/Berlin")  # type: ignore[misc]
    assert end - start == 25 * 3600


def test_a_skipped_midnight_starts_the_day_at_the_change() -> None:
    """Havana skips 00:00-01:00 on 2026-03-08: the day starts at the change, 05:00 UTC."""
    start, _ = periods.bounds("2026-03-08", "America/Havana")  # type: ignore[misc]
    assert start == datetime(2026, 3, 8, 5, tzinfo=UTC).timestamp()
    assert periods.label("day", "America/Havana", start) == "2026-03-08"
    assert periods.label("day", "America/Havana", start - 0.001) == "2026-03-07"


@pytest.mark.parametrize(
    ("text", "kind"), [("2026-12-01", "day"), ("2026-W49", "week"), ("2026-12", "month")]
)
def test_labels_say_their_kind(text: str, kind: str) -> None:
    """A label's form says which kind of period it names."""
    assert periods.kind_of_label(text) == kind
    assert periods.kind_of_label("total") == "total"


@pytest.mark.parametrize("text", ["2026-13", "2026-02-30", "2026-W54", "26-12", "yesterday"])
def test_a_malformed_label_is_refused(text: str) -> None:
    """A label that names no period raises ValueError."""
    with pytest.raises(ValueError):
        periods.kind_of_label(text)


def test_an_unknown_timezone_is_refused() -> None:
    """A timezone that is not in the IANA database raises ValueError."""
    with pytest.raises(ValueError, match="timezone"):
        budget.validate_policy(BudgetPolicy("a", tz="Mars/Olympus"))


# -- properties ----------------------------------------------------------------------------


@settings(max_examples=400, deadline=None)
@given(t=INSTANTS, tz=st.sampled_from(ZONES), kind=st.sampled_from(KINDS))
def test_every_instant_lies_inside_its_periods_bounds(
    t: float, tz: str, kind: periods.PeriodKind
) -> None:
    """start <= t < end for the period containing t; the instant before start is the
    previous period and end is the next one (DST changes included)."""
    text = periods.label(kind, tz, t)
    bounds = periods.bounds(text, tz)
    assert bounds is not None
    start, end = bounds
    assert start <= t < end
    assert periods.label(kind, tz, start) == text
    assert periods.label(kind, tz, start - 0.001) < text
    assert periods.label(kind, tz, end) > text
    assert periods.first_day(periods.label(kind, tz, end)) == periods.next_first_day(text)


@settings(max_examples=400, deadline=None)
@given(t=INSTANTS, dt=st.floats(0, 90 * 86400), tz=st.sampled_from(ZONES))
def test_labels_never_go_back_in_time(t: float, dt: float, tz: str) -> None:
    """A later instant is never in an earlier period (labels sort as their periods)."""
    for kind in KINDS:
        assert periods.label(kind, tz, t) <= periods.label(kind, tz, t + dt)


@settings(max_examples=400, deadline=None)
@given(t=INSTANTS, tz=st.sampled_from(ZONES), kind=st.sampled_from([*KINDS, "total"]))
@example(t=1_183_420_799.9999995, tz="UTC", kind="day")  # rounds up to midnight in datetime
def test_the_verifiers_calendar_agrees_with_the_stores(t: float, tz: str, kind: str) -> None:
    """The verifier's own label arithmetic (strftime) gives the store's label."""
    assert period_of(kind, tz, t) == periods.label(periods.validate_kind(kind), tz, t)


# -- the per-period fold ---------------------------------------------------------------------

DAY_LIMIT = 5_000
MONTH_LIMIT = 40_000
POLICIES = {
    "org": BudgetPolicy("org", MONTH_LIMIT, "month", "Europe/Berlin"),
    "org/team": BudgetPolicy("org/team", DAY_LIMIT, "day", "America/New_York"),
}
#: 2026-10-24 12:00 UTC: Berlin's 25-hour day and New York's last week of DST ahead.
START = datetime(2026, 10, 24, 12, tzinfo=UTC).timestamp()

calls = st.lists(
    st.tuples(
        st.floats(0, 3 * 86400),  # when the call is admitted, after START
        st.floats(0, 2 * 86400),  # how long until it settles
        st.integers(0, 2_000),  # its reservation
        st.integers(0, 2_500),  # its actual cost
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(schedule=calls)
def test_each_call_settles_in_the_periods_it_was_admitted_in(
    schedule: list[tuple[float, float, int, int]],
) -> None:
    """Admission fits exactly when each ancestor's own period has room (in its timezone);
    settlements land in the admission's periods even after the boundary; the fold equals an
    independent model per (path, period)."""
    events: list[Event] = [
        BudgetLimitSet(path=p.path, limit=p.limit, period=p.period, tz=p.tz)
        for p in POLICIES.values()
    ]
    tree = budget.fold(events)
    timeline = []
    for n, (admit_dt, settle_dt, _, _) in enumerate(schedule):
        timeline.append((START + admit_dt, 0, n))
        timeline.append((START + admit_dt + settle_dt, 1, n))
    # The model: what each call holds in each (path, period), from the test's own calendar.
    holds: dict[int, int] = {}
    admitted: dict[int, dict[str, str]] = {}
    for when, settling, n in sorted(timeline):
        _, _, reserve, actual = schedule[n]
        if not settling:
            labels = labels_at(POLICIES, "org/team", when)
            own = {p: period_of(POLICIES[p].period, POLICIES[p].tz, when) for p in POLICIES}
            assert labels == own
            fits = all(
                sum(holds[m] for m in holds if admitted[m][p] == own[p]) + reserve
                <= (POLICIES[p].limit or 0)
                for p in POLICIES
            )
            nodes = period_nodes(POLICIES, tree.nodes, "org/team", labels)
            assert (check_admission(nodes, "org/team", reserve) is None) == fits
            if not fits:
                continue
            admitted[n], holds[n] = labels, reserve
            event: Event = BudgetReserved(
                call=f"c{n}", budget="org/team", amount=reserve, periods=labels
            )
        elif n in admitted:
            holds[n] = actual
            event = BudgetSettled(
                call=f"c{n}",
                budget="org/team",
                reserved=reserve,
                actual=actual,
                periods=admitted[n],
            )
        else:
            continue
        events.append(event)
        tree.apply(event)
    assert budget.fold(events) == tree
    for (path, label), node in tree.nodes.items():
        assert node.reserved == 0  # every admitted call settled
        assert node.spent == sum(holds[m] for m in admitted if admitted[m][path] == label)


def test_a_view_shows_each_node_in_its_own_period() -> None:
    """By default each node shows its period containing now; --period and --at pick others."""
    tree = budget.fold(
        [
            BudgetLimitSet(path="org", limit=100, period="month", tz="UTC"),
            BudgetLimitSet(path="org/team", limit=10, period="day", tz="UTC"),
            BudgetReserved(
                call="c",
                budget="org/team",
                amount=7,
                periods={"org": "2026-11", "org/team": "2026-11-30"},
            ),
        ]
    )
    now = datetime(2026, 12, 1, 9, tzinfo=UTC).timestamp()
    view = {n.path: n for n in budget_view(tree.policies, tree.nodes.values(), now)}
    assert (view["org"].period, view["org"].reserved) == ("2026-12", 0)
    assert (view["org/team"].period, view["org/team"].limit) == ("2026-12-01", 10)
    past = budget_view(tree.policies, tree.nodes.values(), now, label="2026-11-30")
    assert [(n.path, n.reserved) for n in past] == [("org/team", 7)]
    on = budget_view(tree.policies, tree.nodes.values(), now, on=date(2026, 11, 30))
    assert [(n.path, n.period, n.reserved) for n in on] == [
        ("org", "2026-11", 7),
        ("org/team", "2026-11-30", 7),
    ]


def test_a_named_period_shows_a_node_charged_in_it_under_an_earlier_policy() -> None:
    """A node moved from ``day`` to ``month`` still shows its past day's charges when that
    day is named; a node never charged in it and resetting monthly is not listed."""
    tree = budget.fold(
        [
            BudgetLimitSet(path="team", limit=10, period="day", tz="Asia/Kathmandu"),
            BudgetReserved(call="c", budget="team", amount=7, periods={"team": "2026-12-03"}),
            BudgetLimitSet(path="team", limit=300, period="month", tz="Asia/Kathmandu"),
            BudgetLimitSet(path="other", limit=5, period="month", tz="UTC"),
        ]
    )
    now = datetime(2026, 12, 5, tzinfo=UTC).timestamp()
    past = budget_view(tree.policies, tree.nodes.values(), now, label="2026-12-03")
    assert [(n.path, n.period, n.reserved) for n in past] == [("team", "2026-12-03", 7)]


def test_a_moved_zone_shares_the_labels_the_old_zone_has_begun() -> None:
    """Tokyo to Los Angeles on Los Angeles' 5 December evening: Tokyo has begun both the
    5th and the 6th, which Los Angeles has still to count. Back the other way, Los Angeles
    has begun neither of Tokyo's days to come; zones whose days are the same hours share
    nothing (their periods are the same)."""
    at = datetime(2026, 12, 5, 17, tzinfo=ZoneInfo("America/Los_Angeles")).timestamp()
    tokyo, la = "Asia/Tokyo", "America/Los_Angeles"
    assert periods.shared_labels("day", tokyo, la, at) == ["2026-12-05", "2026-12-06"]
    assert periods.shared_labels("day", la, tokyo, at) == []
    assert periods.shared_labels("month", tokyo, la, at) == ["2026-12"]
    assert periods.shared_labels("day", "Europe/Paris", "Europe/Berlin", at) == []
    assert periods.shared_labels("total", tokyo, la, at) == []
