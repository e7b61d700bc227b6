"""Ledger times back to real time, across the steps of the ledger's clock (``--clock-steps``).

The provider's receipts and the clients' notes carry real time; the ledger's events
carry its clock's, which a step moved by the offset recorded for it. An event stamped
by a clock with offset ``o`` at real time ``t`` reads ``t + o``; so each step's offset
gives one candidate real time, ``at - o``, kept if it falls while that offset was in
force (between the real times around the steps before and after it). A step back gives
some times two candidates; the ledger's order removes what it can: events are stamped
under the write lock, so real times rise with ``seq``. What is left is a range,
``(earliest, latest)``: the invariants that compare an event with a receipt (an
attempt before its receipt, a decision after what it found) take the side that spares
the event, so they judge everything a step leaves comparable and nothing it does not.
Without steps every range is ``(at, at)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

from effectguard.rules.events import StoredEvent

__all__ = ["real_times"]

#: How far a real time read under the lock may run behind the one before it in ``seq``:
#: none should, the margin is for clock reads' own granularity.
_JITTER: Final = 0.005


def real_times(
    events: Sequence[StoredEvent], steps: Sequence[Mapping[str, Any]]
) -> dict[int, tuple[float, float]]:
    """``seq`` -> (earliest, latest) real time each event may have been stamped at, given
    the run's clock ``steps`` (those of a replica host's clock, ``ledger`` false, moved no
    ledger time)."""
    steps = [s for s in steps if s.get("ledger", True)]
    if not steps:
        return {e.seq: (e.at, e.at) for e in events}
    # Segment k: offset, from (real time) - to; each step's before/after bounds both sides.
    offsets = [0.0] + [float(s["offset"]) for s in steps]
    starts = [-math.inf] + [float(s["began"]) for s in steps]
    ends = [float(s["returned"]) for s in steps] + [math.inf]
    candidates: list[list[float]] = []
    for e in events:
        found = [
            e.at - o
            for o, lo, hi in zip(offsets, starts, ends, strict=True)
            if lo - _JITTER <= e.at - o <= hi + _JITTER
        ]
        candidates.append(found or [e.at - o for o in offsets])
    floor = -math.inf
    for i, found in enumerate(candidates):
        kept = [c for c in found if c >= floor - _JITTER] or found
        candidates[i] = kept
        floor = max(floor, min(kept))
    ceiling = math.inf
    for i in range(len(candidates) - 1, -1, -1):
        kept = [c for c in candidates[i] if c <= ceiling + _JITTER] or candidates[i]
        candidates[i] = kept
        ceiling = min(ceiling, max(kept))
    return {e.seq: (min(c), max(c)) for e, c in zip(events, candidates, strict=True)}
