"""``--clock-steps``: wall-clock steps, as NTP makes them, drawn from the seed.

A step is a :class:`~effectguard.testing.sim.schedule.Fault` of kind ``clock_step``
whose ``point`` is ``TARGET SPEC``:

- ``TARGET``: ``host`` (SQLite: the one host's clock, which every process that writes
  the ledger reads: the replicas and the operator's commands), ``replica`` (PostgreSQL:
  the host clock of the fault's replica alone) or ``db`` (PostgreSQL: the database's
  clock, which is the ledger's);
- ``SPEC``: ``+S`` or ``-S`` (a step of S seconds), ``minute-S`` (back across the
  start of the minute the clock is in, to S seconds before it: a rate window's minute
  kept) or ``minute+S`` (forward, S seconds past the start of the next minute).

The minute steps are resolved against the clock when they are made (:func:`delta`),
since the schedule cannot know the time of day a run starts at. Drawn from a generator
of its own, so a schedule drawn without the option is unchanged.
"""

from __future__ import annotations

import random
from typing import Final

__all__ = ["CLOCK_TARGETS", "delta", "draw"]

#: Where a step lands (see the module's docstring).
CLOCK_TARGETS: Final = ("host", "replica", "db")
_MINUTE: Final = 60.0


def draw(seed: int, duration: float, replicas: int, ledger: str) -> list[tuple[float, int, str]]:
    """``(at, replica, point)`` of each step: every 3-8 s of the load, back and forward,
    seconds to two and a half minutes; the first two across a minute's start on the
    ledger's clock (back, then forward), so a rate window's minute is kept and then left."""
    rng = random.Random(f"clock {seed}")
    ledger_target = "host" if ledger == "sqlite" else "db"
    out: list[tuple[float, int, str]] = []
    at = round(rng.uniform(1.5, 4.0), 3)
    while at < duration * 0.85:
        n = len(out)
        replica, target = 0, ledger_target
        if ledger != "sqlite" and n >= 2 and rng.random() < 0.5:
            replica, target = rng.randrange(replicas), "replica"
        if n == 0:
            spec = f"minute-{round(rng.uniform(0.5, 15.0), 3)}"
        elif n == 1:
            spec = f"minute+{round(rng.uniform(0.5, 15.0), 3)}"
        else:
            size = rng.choice(
                [rng.uniform(0.5, 10.0), rng.uniform(10.0, 59.0), rng.uniform(61, 150)]
            )
            spec = f"{rng.choice('+-')}{round(size, 3)}"
        out.append((at, replica, f"{target} {spec}"))
        at = round(at + rng.uniform(3.0, 8.0), 3)
    return out


def delta(spec: str, clock_now: float) -> float:
    """How far to step a clock that reads ``clock_now`` for ``spec`` (seconds, signed)."""
    into = clock_now % _MINUTE
    if spec.startswith("minute-"):
        return -(into + float(spec.removeprefix("minute-")))
    if spec.startswith("minute+"):
        return _MINUTE - into + float(spec.removeprefix("minute+"))
    return float(spec)
