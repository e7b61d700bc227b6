"""Budget periods on a real SQLite ledger, driven by hypothesis across DST changes and
day, week and month boundaries (issue #15), against a model with its own calendar.

Each example opens a fresh ledger whose clock is a :class:`ManualClock` started near one
of the year's awkward weeks (Berlin's 25- and 23-hour Sundays, New York's, a month's
end), then runs admissions, settlements, interrupts (holds) and reconciles, with waits
between them and jumps to a millisecond before, or exactly onto, a node's next period
boundary. After every step the ledger must agree with the model (SPEC §5, per period):

* admission admits exactly when every limited ancestor's own period has room;
* every ``(path, period)`` counter equals the model's fold of what happened;
* no period is over its limit (costs here never exceed the reservation, so
  ``spent + reserved + held <= limit`` holds at every moment);

and at the end every budget event of every call names the periods the call was admitted
in (by the model's calendar, from the admission's time), and ``verify`` passes.
"""

from __future__ import annotations

import asyncio
import math
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_store_contract import observed, register, req

from effectguard.ledger import Ledger, Writer
from effectguard.ops.verify import verify_ledger
from effectguard.rules.budget import BudgetPolicy
from effectguard.rules.events import BudgetSettled, CallCompleted
from effectguard.testing.clock import ManualClock

R = 1_000
ROOT = "org"
#: The tree: a month in Berlin over a day in New York, and a week in Berlin over a day
#: in Berlin and a node without a policy (its counters stay in period ``total``).
POLICIES = {
    "org": BudgetPolicy("org", 16 * R, "month", "Europe/Berlin"),
    "org/a": BudgetPolicy("org/a", 3 * R, "day", "America/New_York"),
    "org/b": BudgetPolicy("org/b", 6 * R, "week", "Europe/Berlin"),
    "org/b/x": BudgetPolicy("org/b/x", 2 * R, "day", "Europe/Berlin"),
}
LEAVES = ["org/a", "org/b/x", "org/b/y"]


def _at(text: str, tz: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=ZoneInfo(tz)).timestamp()


#: Where a run starts: the evening before a DST change, a week's or a month's end.
STARTS = [
    _at("2026-10-24T20:00", "Europe/Berlin"),  # Sun 25 Oct: 25 hours, then a new ISO week
    _at("2026-03-28T20:00", "Europe/Berlin"),  # Sun 29 Mar: 23 hours; 31 Mar -> April
    _at("2026-10-31T17:00", "America/New_York"),  # Berlin's November; New York's 1 Nov: 25 h
    _at("2026-03-07T20:00", "America/New_York"),  # New York's 8 Mar: 23 hours
]


# -- the model's own calendar ------------------------------------------------------------------


def _local_day(tz: str, at: float) -> date:
    # Bounds fall on whole seconds, so the whole second decides.
    return datetime.fromtimestamp(math.floor(at), ZoneInfo(tz)).date()


def model_label(policy: BudgetPolicy, at: float) -> str:
    """The period of ``policy`` containing ``at``: ``2026-10-25``, ``2026-W43``, ``2026-10``."""
    day = _local_day(policy.tz, at)
    if policy.period == "day":
        return day.isoformat()
    if policy.period == "week":
        year, week, _ = day.isocalendar()
        return f"{year}-W{week:02d}"
    return f"{day.year}-{day.month:02d}"


def model_next_start(policy: BudgetPolicy, at: float) -> float:
    """When the period of ``policy`` after the one containing ``at`` begins (local midnight)."""
    day = _local_day(policy.tz, at)
    if policy.period == "day":
        first = day + timedelta(days=1)
    elif policy.period == "week":
        first = day + timedelta(days=7 - day.weekday())
    else:
        first = (day.replace(day=1) + timedelta(days=32)).replace(day=1)
    return datetime(first.year, first.month, first.day, tzinfo=ZoneInfo(policy.tz)).timestamp()


def lineage(path: str) -> list[str]:
    """``path`` and its ancestors, root first."""
    parts = path.split("/")
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


# -- the model -----------------------------------------------------------------------------------


@dataclass
class Call:
    """One admitted call as the model sees it."""

    call_id: str
    budget: str
    reserve: int
    admitted_at: float
    #: The period of each node on the call's path (``total`` where the node has none).
    periods: dict[str, str]
    stage: str = "in_flight"


@dataclass
class Model:
    """Each ``(path, period)``'s counters, folded by the SPEC §5.4 table."""

    counters: dict[tuple[str, str], list[int]] = field(
        default_factory=lambda: defaultdict(lambda: [0, 0, 0])  # reserved, spent, held
    )
    calls: list[Call] = field(default_factory=list)

    def periods_at(self, budget: str, at: float) -> dict[str, str]:
        return {
            p: model_label(POLICIES[p], at) if p in POLICIES else "total" for p in lineage(budget)
        }

    def fits(self, periods: dict[str, str], amount: int) -> bool:
        for path, label in periods.items():
            limit = POLICIES[path].limit if path in POLICIES else None
            if limit is not None and sum(self.counters[(path, label)]) + amount > limit:
                return False
        return True

    def move(self, call: Call, reserved: int = 0, spent: int = 0, held: int = 0) -> None:
        for key in call.periods.items():
            row = self.counters[key]
            row[0], row[1], row[2] = row[0] + reserved, row[1] + spent, row[2] + held

    def pick(self, stage: str, index: int) -> Call | None:
        found = [c for c in self.calls if c.stage == stage]
        return found[index % len(found)] if found else None


# -- the steps -------------------------------------------------------------------------------------

ADMIT = st.tuples(st.just("admit"), st.sampled_from(LEAVES), st.integers(1, 4))
SETTLE = st.tuples(st.just("settle"), st.integers(0, 50), st.integers(0, 4))
INTERRUPT = st.tuples(st.just("interrupt"), st.integers(0, 50))
RECONCILE = st.tuples(st.just("reconcile"), st.integers(0, 50), st.booleans(), st.integers(0, 4))
WAIT = st.tuples(st.just("wait"), st.one_of(st.floats(0, 120), st.floats(0, 30 * 3600)))
EDGE = st.tuples(st.just("edge"), st.sampled_from(sorted(POLICIES)), st.sampled_from([-0.001, 0.0]))
#: Each kind of step with its weight: admissions and settlements come up more often than
#: the rest, so that periods fill up and refuse.
KINDS = {"admit": (ADMIT, 4), "settle": (SETTLE, 2), "interrupt": (INTERRUPT, 1)}
KINDS |= {"reconcile": (RECONCILE, 1), "wait": (WAIT, 1), "edge": (EDGE, 2)}
STEPS = st.sampled_from([k for k, (_, weight) in KINDS.items() for _ in range(weight)]).flatmap(
    lambda kind: KINDS[kind][0]
)


@dataclass
class Run:
    """A ledger, its clock and its worker, with the model beside them."""

    ledger: Ledger
    clock: ManualClock
    writer: Writer
    model: Model = field(default_factory=Model)
    #: Settlements, holds and reconciles that came after their call's periods had ended.
    crossed: int = 0
    refused: int = 0

    async def admit(self, budget: str, halves: int) -> None:
        amount, now = halves * R // 2, self.clock()
        periods = self.model.periods_at(budget, now)
        expected = self.model.fits(periods, amount)
        result = await self.ledger.admit(self.writer, req(ROOT, reserve=amount, budget=budget))
        assert (result.action == "admit") == expected, (budget, amount, periods, result.refusal)
        if result.action == "admit":
            call = Call(result.call_id, budget, amount, now, periods)
            self.model.calls.append(call)
            self.model.move(call, reserved=amount)
        else:
            assert result.refusal is not None and result.refusal.status == 402
            self.refused += 1

    async def settle(self, index: int, quarters: int) -> None:
        call = self.model.pick("in_flight", index)
        if call is None:
            return
        actual = call.reserve * quarters // 4  # never above the reservation
        await self.ledger.record(
            self.writer,
            call.call_id,
            1,
            [
                observed(call.call_id),
                BudgetSettled(
                    call=call.call_id, budget=call.budget, reserved=call.reserve, actual=actual
                ),
                CallCompleted(call=call.call_id, outcome="completed"),
            ],
        )
        call.stage = "completed"
        self.crossed += self.model.periods_at(call.budget, self.clock()) != call.periods
        self.model.move(call, reserved=-call.reserve, spent=actual)

    async def interrupt(self, index: int) -> None:
        call = self.model.pick("in_flight", index)
        if call is None:
            return
        await self.ledger.interrupt(self.writer, call.call_id, 1, "connection reset")
        call.stage = "effect_unknown"
        self.crossed += self.model.periods_at(call.budget, self.clock()) != call.periods
        self.model.move(call, reserved=-call.reserve, held=call.reserve)

    async def reconcile(self, index: int, applied: bool, quarters: int) -> None:
        call = self.model.pick("effect_unknown", index)
        if call is None:
            return
        cost = call.reserve * quarters // 4 if applied else 0
        await self.ledger.reconcile(
            call.call_id, applied=applied, cost=cost if applied else None, note="n", by="ann"
        )
        call.stage = "reconciled"
        self.crossed += self.model.periods_at(call.budget, self.clock()) != call.periods
        self.model.move(call, spent=cost, held=-call.reserve)

    def wait_until_edge(self, path: str, offset: float) -> None:
        target = model_next_start(POLICIES[path], self.clock()) + offset
        if target > self.clock():
            self.clock.advance(target - self.clock())

    async def check_counters(self) -> None:
        stored = {
            n.key: (n.reserved, n.spent, n.held) for n in await self.ledger.store.budget_nodes()
        }
        zero = (0, 0, 0)
        for key in set(stored) | set(self.model.counters):
            assert stored.get(key, zero) == tuple(self.model.counters.get(key, zero)), key
            limit = POLICIES[key[0]].limit if key[0] in POLICIES else None
            if limit is not None:  # no period over its limit
                assert sum(stored.get(key, zero)) <= limit, (key, stored[key])

    async def check_calls(self) -> None:
        for call in self.model.calls:
            events = await self.ledger.events(call.call_id)
            (manifest,) = [e for e in events if e.kind == "call.manifest"]
            assert manifest.at == call.admitted_at
            limited = {p: label for p, label in call.periods.items() if label != "total"}
            for stored in events:
                if stored.kind.startswith("budget."):
                    assert stored.data["periods"] == limited, (stored.kind, stored.data)


async def drive(url: str, start: float, steps: list[tuple[object, ...]]) -> None:
    clock = ManualClock(start)
    async with Ledger.open(url, clock=clock) as ledger:
        for policy in POLICIES.values():
            await ledger.set_policy(policy)
        run = Run(ledger, clock, await register(ledger, "w", lease_s=10**9))
        for step in steps:
            kind, *args = step
            if kind == "wait":
                clock.advance(float(args[0]))  # type: ignore[arg-type]
            elif kind == "edge":
                run.wait_until_edge(str(args[0]), float(args[1]))  # type: ignore[arg-type]
            else:
                await getattr(run, str(kind))(*args)
            await run.check_counters()
        await run.check_calls()
        # What the example covered (pytest --hypothesis-show-statistics).
        event(f"calls admitted: {min(len(run.model.calls), 10) // 5 * 5}+")
        event(f"admissions refused: {min(run.refused, 10) // 5 * 5}+")
        event(f"settled, held or reconciled after their periods: {min(run.crossed, 3)}+")
        report = await verify_ledger(ledger)
        assert report.ok, report.problems


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(start=st.sampled_from(STARTS), steps=st.lists(STEPS, min_size=20, max_size=50))
def test_every_period_of_a_real_ledger_folds_like_the_model_across_boundaries(
    start: float, steps: list[tuple[object, ...]]
) -> None:
    """Admissions, settlements, holds and reconciles on a SQLite ledger whose clock crosses
    DST changes and day, week and month boundaries: each admission is decided by its own
    periods' room, each period's counters equal the model's and stay within the limit,
    every call's budget events land in its admission's periods, and verify passes."""
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(drive(str(Path(tmp) / "l.db"), start, steps))
