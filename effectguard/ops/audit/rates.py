"""Rate windows, re-derived by the verifier's own rules (docs/contract.md §5.6).

A node whose policy (as the events had declared it by then) has ``rpm`` or ``tpm`` keeps
one window: the calendar minute of the ledger's clock it counts (``floor(at) // 60``),
and the attempts admitted in that minute with their token estimates. Each
``budget.reserved`` counts one attempt and its estimate (``tokens``) in every such
ancestor, in the minute of the event; a reservation in a later minute starts the window
over; one in the minute before the window's (a clock stepped back) counts in the
window's, and one further back starts the window over too. A
``budget.settled`` that reports ``tokens`` replaces its attempt's estimate (the call's
last reservation) with them, never below 0, in each window that still counts the
minute its attempt started in (the call's last ``attempt.started``); a window that has
moved on is left alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

from effectguard.ops.audit.budgets import NO_POLICY, Policy, lineage

_SECONDS = 60
#: A reservation this many minutes before its window's minute still counts in it.
_KEPT_BACK = 1


class RateRow(NamedTuple):
    """A stored rate window, or one the events give: a node's minute and its counts."""

    path: str
    minute: int
    requests: int
    tokens: int


def minute_of(at: float) -> int:
    """The minute of the epoch containing instant ``at``."""
    return math.floor(at) // _SECONDS


class Rates:
    """Every node's rate window, folded from the events."""

    def __init__(self) -> None:
        self.windows: dict[str, RateRow] = {}
        #: Each call's last reservation's token estimate (what its settlement corrects).
        self.estimates: dict[str, int] = {}
        #: True after a cut whose checkpoint carried no windows: a window is known only
        #: once a reservation after the cut has started a new minute on it.
        self.partial = False
        self.restarted: set[str] = set()
        #: The same windows as releases before writer format 1 counted them: a
        #: reservation in the minute before its window's (a clock stepped back) started
        #: the window over. A stored window may be either (docs/operations.md, "Mixed
        #: versions"): until this release counts in it, it is the older release's.
        self.before: dict[str, RateRow] = {}

    def feed(
        self,
        kind: str,
        data: dict[str, Any],
        at: float,
        call: str,
        started_at: float,
        policies: Mapping[str, Policy],
    ) -> None:
        """Apply one event of ``call`` (whose last attempt started at ``started_at``)."""
        if kind == "budget.reserved":
            tokens = int(data.get("tokens", 0))
            self.estimates[call] = tokens
            minute = minute_of(at)
            for path in _limited(policies, str(data["budget"])):
                if _count(self.windows, path, minute, tokens, _KEPT_BACK):
                    self.restarted.add(path)
                _count(self.before, path, minute, tokens, 0)
        elif kind == "budget.settled" and data.get("tokens") is not None:
            minute = minute_of(started_at)
            change = int(data["tokens"]) - self.estimates.get(call, 0)
            for path in _limited(policies, str(data["budget"])):
                for windows in (self.windows, self.before):
                    window = windows.get(path)
                    if window is not None and window.minute == minute:
                        windows[path] = window._replace(tokens=max(0, window.tokens + change))

    def seed(self, windows: dict[str, RateRow]) -> None:
        """Start from the windows a checkpoint carried."""
        self.windows, self.before = windows, dict(windows)

    def compare(self, rows: list[RateRow]) -> list[str]:
        """What differs between the stored windows and the events' (nothing when equal)."""
        stored = {row.path: row for row in rows}
        problems = []
        for path in sorted(set(stored) | set(self.windows)):
            if self.partial and path not in self.restarted:
                continue  # its window was counted before the cut, in events no longer here
            have, want = stored.get(path), self.windows.get(path)
            if have != want and have != self.before.get(path):
                problems.append(
                    f"rate window {path!r}: stored {_counts(have)} but the events give "
                    f"{_counts(want)}"
                )
        return problems


def _count(windows: dict[str, RateRow], path: str, minute: int, tokens: int, back: int) -> bool:
    """Count a reservation in ``minute`` in ``path``'s window, which keeps counting one
    up to ``back`` minutes before its own; returns whether the window started over."""
    window = windows.get(path)
    restarted = window is None or not window.minute - back <= minute <= window.minute
    if window is None or restarted:
        window = RateRow(path, minute, 0, 0)
    windows[path] = window._replace(requests=window.requests + 1, tokens=window.tokens + tokens)
    return restarted


def _limited(policies: Mapping[str, Policy], budget: str) -> list[str]:
    """``budget`` and its ancestors whose policy declares ``rpm`` or ``tpm``."""
    out = []
    for path in lineage(budget):
        _, _, _, rpm, tpm, _ = policies.get(path, NO_POLICY)
        if rpm is not None or tpm is not None:
            out.append(path)
    return out


def _counts(row: RateRow | None) -> str:
    if row is None:
        return "no window"
    return f"minute={row.minute} requests={row.requests} tokens={row.tokens}"
