"""The simulator's ``rate_limit_exceeded`` invariant on ``tpm`` (``--operator`` sets it
during the load), checked on fabricated evidence: a pure function of the event log."""

from __future__ import annotations

import dataclasses

from eventkit import completion
from test_sim import _evidence, _manifest

from effectguard.rules.events import AttemptStarted, BudgetLimitSet, BudgetReserved, Event
from effectguard.testing.sim.invariants import check
from effectguard.testing.sim.schedule import generate


def _reserved(call: str, at: float, tokens: int) -> list[tuple[float, Event]]:
    """A call admitted under ``team`` at ``at`` with a ``tokens`` estimate (left in flight)."""
    return [
        (at, _manifest(call)),
        (at, BudgetReserved(call=call, budget="team", amount=5, tokens=tokens)),
        (at, AttemptStarted(call=call, attempt=1, worker="w", generation=1)),
    ]


def _settled(call: str, at: float, tokens: int) -> list[tuple[float, Event]]:
    """``call`` answered and settled at ``tokens`` reported tokens."""
    events = completion(call, budget="team", reserved=5, actual=4, body="{}")
    events[1] = dataclasses.replace(events[1], tokens=tokens)  # type: ignore[type-var]
    return [(at, e) for e in events]


def _fired(*events: tuple[float, Event]) -> bool:
    found = check(_evidence(list(events), answers=[], receipts=[]))
    return "rate_limit_exceeded" in {v.invariant for v in found}


def test_an_admission_past_tpm_is_caught() -> None:
    """tpm 100: an estimate of 30 after one of 80 in the minute breaks
    ``rate_limit_exceeded``; not once the 80 settled at 10, nor in the next minute; a call
    admitted before the declaration counted nothing, so its settlement frees nothing."""
    tpm = (600.0, BudgetLimitSet(path="team", limit=None, tpm=100))
    assert _fired(tpm, *_reserved("a", 601.0, 80), *_reserved("b", 602.0, 30))
    assert not _fired(
        tpm, *_reserved("a", 601.0, 80), *_settled("a", 601.5, 10), *_reserved("b", 602.0, 30)
    )
    assert not _fired(tpm, *_reserved("a", 601.0, 80), *_reserved("b", 661.0, 30))
    early = [*_reserved("z", 599.0, 80), tpm, *_reserved("a", 601.0, 80)]
    assert _fired(*early, *_settled("z", 601.5, 0), *_reserved("b", 602.0, 30))
    assert not _fired(*early, *_settled("a", 601.5, 0), *_reserved("b", 602.0, 30))


def test_the_operator_sets_tpm_during_the_load() -> None:
    """``--operator`` schedules ``budget set PATH ... --tpm N`` among its rate changes
    (drawn from a generator of its own: rpm and concurrency are drawn as before)."""
    points = [
        f.point
        for seed in range(20)
        for f in generate(seed, 60.0, operator=True).faults
        if f.kind == "rate_set"
    ]
    tpms = {p.split("tpm=")[1].split()[0] for p in points if "tpm=" in p}
    assert len(tpms) > 3 and "none" in tpms, points
