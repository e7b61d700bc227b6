"""``--clock-steps`` (docs/simulator.md): wall-clock steps drawn from the seed, and the
invariants judging a run whose ledger clock was stepped (fabricated evidence)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from eventkit import completion
from test_sim import _evidence, _manifest, _paid, _reserved

from effectguard.rules.events import (
    AttemptStarted,
    BudgetLimitSet,
    BudgetReserved,
    CallReconciled,
    Event,
)
from effectguard.rules.workstate import replace
from effectguard.testing.sim import clocksteps
from effectguard.testing.sim.clockmap import real_times
from effectguard.testing.sim.cluster import Cluster
from effectguard.testing.sim.invariants import check
from effectguard.testing.sim.schedule import generate


def _without_steps(seed: int, ledger: str, replicas: int, **options: bool) -> str:
    stepped = generate(seed, 40.0, replicas=replicas, ledger=ledger, clock_steps=True, **options)
    kept = tuple(f for f in stepped.faults if f.kind != "clock_step")
    return dataclasses.replace(stepped, faults=kept).to_json()


def test_clock_steps_are_drawn_only_when_asked() -> None:
    """Without the option no step is drawn, and with it the rest of the schedule is the
    one drawn without; the first steps cross a minute's start of the ledger's clock, back
    then forward, the others go both ways, some past a minute, and on PostgreSQL some
    step one replica's host instead of the database."""
    for seed in range(30):
        for ledger, replicas in (("sqlite", 1), ("postgres", 3)):
            plain = generate(seed, 40.0, replicas=replicas, ledger=ledger, operator=True)
            assert not [f for f in plain.faults if f.kind == "clock_step"]
            assert _without_steps(seed, ledger, replicas, operator=True) == plain.to_json()
    sqlite = [
        f.point or ""
        for s in range(10)
        for f in generate(s, 40.0, clock_steps=True).faults
        if f.kind == "clock_step"
    ]
    assert sqlite and all(p.startswith("host ") for p in sqlite)
    pg = [
        f
        for s in range(10)
        for f in generate(s, 40.0, replicas=3, ledger="postgres", clock_steps=True).faults
        if f.kind == "clock_step"
    ]
    specs = [(f.point or "").split()[1] for f in pg]
    assert {(f.point or "").split()[0] for f in pg} == {"db", "replica"}
    assert any(s.startswith("-") for s in specs) and any(s.startswith("+") for s in specs)
    assert any(abs(float(s)) > 60 for s in specs if not s.startswith("minute"))
    steps = [f for f in generate(7, 40.0, clock_steps=True).faults if f.kind == "clock_step"]
    assert (steps[0].point or "").startswith("host minute-")
    assert (steps[1].point or "").startswith("host minute+")


def test_a_minute_step_crosses_the_minute_start() -> None:
    """``minute-S`` lands S s before the start of the clock's minute, ``minute+S`` S s
    after the start of the next one."""
    assert clocksteps.delta("minute-2.5", 6010.0) == pytest.approx(-12.5)  # 10 s in
    assert clocksteps.delta("minute+1.5", 6010.0) == pytest.approx(51.5)
    assert clocksteps.delta("-90", 6010.0) == -90.0


def _step(real: float, offset: float) -> dict[str, Any]:
    return {"began": real, "returned": real, "offset": offset}


def _admitted(call: str, at: float) -> list[tuple[float, Event]]:
    return [
        (at, _manifest(call)),
        (at, BudgetReserved(call=call, budget="team", amount=5)),
        (at, AttemptStarted(call=call, attempt=1, worker="w", generation=1)),
    ]


def test_ledger_times_map_back_to_real_time_in_the_ledger_order() -> None:
    """After a step back of 30 s at real time 10.5, a time the clock read both before and
    after it is placed by the events' order: one stamped after an event of real time 10
    is the later reading."""
    events = _evidence([*_admitted("a", 10.0), *_admitted("b", -19.0)]).events
    times = real_times(events, [_step(10.5, -30.0)])
    assert times[1] == (10.0, 10.0)
    assert times[4] == pytest.approx((11.0, 11.0))
    unmoved = {e.seq: (e.at, e.at) for e in events}
    assert real_times(events, []) == unmoved
    assert real_times(events, [_step(10.5, -30.0) | {"ledger": False}]) == unmoved


def test_a_receipt_is_judged_in_real_time_across_a_forward_step() -> None:
    """The ledger's clock stepped 30 s forward before the attempt: its receipt, 0.2 s of
    real time later, reads 29.8 s "before" the attempt. With the step recorded, no
    ``receipt_without_attempt``; unrecorded, it fires (the check compares real times)."""
    events = [*_admitted("c1", 41.0)]
    events += [(43.0, e) for e in completion("c1", budget="team", reserved=5, actual=4, body="")]
    receipt = {"seq": 1, "ts": 11.2, "body_sha256": _evidence([]).receipts[0]["body_sha256"]}
    evidence = _evidence(events, receipts=[receipt | {"deduped": False}], answers=[])
    assert "receipt_without_attempt" in {v.invariant for v in check(evidence)}
    evidence.clock_steps = [_step(10.5, 30.0)]
    assert check(evidence) == []


def test_a_decision_is_judged_in_real_time_across_a_step_back() -> None:
    """A lookup decided a call applied 0.8 s (real) after the provider applied it, on a
    ledger clock stepped 30 s back in between: the decision reads as made before the
    receipt unless the step is taken out."""
    events = [*_admitted("c1", 10.0)]
    decision = CallReconciled(call="c1", applied=True, cost=5, note="n", by="lookup:payments")
    evidence = _evidence([*events, (-18.0, decision)], receipts=[_paid(1, 11.2)], answers=[])
    (state,) = evidence.calls
    evidence.calls = [replace(state, stage="reconciled_applied", held=0)]
    assert {v.invariant for v in check(evidence)} == {"decision_contradicts_receipts"}
    evidence.clock_steps = [_step(10.5, -30.0)]
    assert check(evidence) == []


def _fired(*events: tuple[float, Event]) -> set[str]:
    return {v.invariant for v in check(_evidence(list(events), answers=[], receipts=[]))}


def test_a_far_step_back_starts_the_rate_window_over() -> None:
    """rpm 1 (contract §5.6): a clock stepped back into the minute before the window's
    keeps counting in the window's minute, so a second admission there breaks the limit;
    stepped back further, the window starts over and one more admission is allowed."""
    rpm = (600.0, BudgetLimitSet(path="team", limit=None, rpm=1))
    assert "rate_limit_exceeded" in _fired(rpm, *_reserved("a", 661.0), *_reserved("b", 655.0))
    assert "rate_limit_exceeded" not in _fired(rpm, *_reserved("a", 661.0), *_reserved("b", 590.0))
    assert "rate_limit_exceeded" in _fired(
        rpm, *_reserved("a", 661.0), *_reserved("b", 590.0), *_reserved("c", 591.0)
    )


def test_a_database_clock_step_while_the_database_is_down_is_noted(tmp_path: Path) -> None:
    """A step of the database's clock while it is stopped (``--ledger-faults``) is noted
    ``clock_step_failed``, and the run goes on (it ended the whole run, exit 4)."""
    schedule = generate(316, 10.0, replicas=2, ledger="postgres", clock_steps=True)
    down = "postgresql://postgres@127.0.0.1:1/test?schema=sim_down"  # nothing listens
    cluster = Cluster(schedule, tmp_path, down, fake=None, env={})  # type: ignore[arg-type]
    cluster.step_clock(0, "db -5")
    assert [a["action"] for a in cluster.actions] == ["clock_step_failed"]
