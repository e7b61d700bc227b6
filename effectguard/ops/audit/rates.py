"""Rate windows, re-derived by the verifier's own rules (docs/contract.md §5.6).

A node whose policy (as the events had declared it by then) has ``rpm`` or ``tpm`` keeps
one window: the calendar minute of the ledger's clock it counts (``floor(at) // 60``),
and the attempts admitted in that minute with their token estimates. Each
``budget.reserved`` counts one attempt and its estimate (``tokens``) in every such
ancestor, in the minute of the event; a reservation in a later minute starts the window
over; one in the minute before the window's (a clock stepped back) counts in the
window's, and one further back starts the window over too. A ``budget.limit_set`` that
gives a node ``rpm`` or ``tpm`` it had neither of starts its window afresh in the event's
minute, recording the event's ``seq`` (``since``) if a call under the node is in flight
then (0 if none): the attempts of that minute reserved before it were counted in no
window. A ``budget.settled`` that reports ``tokens``
replaces its attempt's estimate (the call's last reservation) with them, never below 0,
in each window that counted that attempt: one that still counts the minute its attempt
started in (the call's last ``attempt.started``) and, if a declaration started it in that
minute, only for a reservation after the declaration. A window that has moved on is left
alone. A step back of the clock (a reservation in a minute before its window's) records
``p``, the position before it, in a window that recorded none: counted in the window,
``since = -p`` (the window counts its minute whole, and the reservations of the minute
before after ``p``); starting it over, ``since = p`` (it counts exactly the reservations
after ``p``, of its minute or the one before, as after a declaration). A window records
``reached``, the highest minute its node's windows counted in (from its first window, or
the declaration that started the window's lineage, with the minutes the attempts then in
flight under the node started in), and one that starts over in a later
minute up to ``reached`` (a clock stepped back far, then forward) records ``since = p``
too: attempts an earlier window counted in that minute may settle after it.

Older releases counted differently, and a stored window may be theirs (docs/operations.md,
"Mixed versions"): before writer format 1 a reservation in the minute before its window's
started the window over; before writer format 2 a declaration started nothing (its
windows have ``since`` NULL); up to writer format 4 a step back recorded no position;
up to writer format 5 a window recorded no ``reached`` (NULL), and this release tracks
none in the windows after it until a declaration starts one.
So the verifier folds the events six ways and accepts a window that is one of them: one
with ``reached`` only as this release counts it, one with ``since`` NULL only as the
releases before format 2 counted it (either, without ``reached``, after an archive cut
unjudged until it starts over: the cut's checkpoint carries the windows as this release
counts them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

from effectguard.ops.audit.budgets import NO_POLICY, Policy, lineage, policy_from

_SECONDS = 60
#: The events that end an attempt in flight (its call is no longer ``in_flight``).
_LANDED = frozenset({"attempt.observed", "attempt.not_sent", "attempt.interrupted"})
#: A reservation this many minutes before its window's minute still counts in it.
_KEPT_BACK = 1
#: Whether a step back of the clock records its position in the window (this release).
_MARKS = True
#: Whether a window records the highest minute it reached (this release).
_TRACKS = True


class RateRow(NamedTuple):
    """A stored rate window, or one the events give: a node's minute and its counts, and
    ``since``: the ``seq`` of the declaration that started it mid-minute, or where a step
    back of the clock came (negative if the window kept counting; 0: neither; None: a
    window a release before writer format 2 counted, which did not record it). ``reached``:
    the highest minute the node's windows counted in (None: not tracked, as before writer
    format 6)."""

    path: str
    minute: int
    requests: int
    tokens: int
    since: int | None = 0
    reached: int | None = None


def minute_of(at: float) -> int:
    """The minute of the epoch containing instant ``at``."""
    return math.floor(at) // _SECONDS


class _Fold:
    """The windows as one release's rules count them: with the kept-back minute (writer
    format 1) or without, started by a declaration (format 2) or not, and recording
    where the clock stepped back (format 5) or not, tracking ``reached`` (this release)
    or not."""

    def __init__(
        self, kept_back: bool, declared: bool, marks: bool = False, tracks: bool = False
    ) -> None:
        self.kept_back, self.declared, self.marks = kept_back, declared, marks
        self.tracks = tracks
        self.windows: dict[str, RateRow] = {}

    def reserve(self, paths: list[str], minute: int, tokens: int, seq: int) -> list[str]:
        """Count reservation ``seq`` in ``minute``; returns the paths whose window started
        over."""
        back = _KEPT_BACK if self.kept_back else 0
        restarted = []
        for path in paths:
            window = self.windows.get(path)
            earlier = window is not None and minute < window.minute
            kept = window is not None and window.minute - back <= minute <= window.minute
            reached = (0 if self.tracks else None) if window is None else window.reached
            if window is None or not kept:
                window = RateRow(path, minute, 0, 0, reached=reached)
                restarted.append(path)
                if not earlier and reached is not None and minute <= reached:
                    # Forward into a minute an earlier window counted (a clock stepped
                    # back far, then forward): its attempts may settle after this.
                    window = window._replace(since=seq - 1)
            if self.marks and earlier and window.since == 0:
                window = window._replace(since=1 - seq if kept else seq - 1)
            if reached is not None and minute > reached:
                window = window._replace(reached=minute)
            self.windows[path] = window._replace(
                requests=window.requests + 1, tokens=window.tokens + tokens
            )
        return restarted

    def settle(self, paths: list[str], minute: int, reserved: int, change: int) -> None:
        """Correct by ``change`` the windows that counted an attempt started in ``minute``
        and reserved at ``reserved``."""
        for path in paths:
            window = self.windows.get(path)
            if window is not None and self._counted(window, minute, reserved):
                self.windows[path] = window._replace(tokens=max(0, window.tokens + change))

    def _counted(self, window: RateRow, minute: int, reserved: int) -> bool:
        if not (self.declared and window.since):
            return window.minute == minute
        if self.marks:
            since = window.since
            if since < 0 and minute == window.minute:
                return True  # a step back kept it counting its minute whole
            return window.minute - _KEPT_BACK <= minute <= window.minute and reserved > abs(since)
        # Reserved after the declaration that started this window, in its minute.
        return window.minute == minute and reserved > window.since

    def declare(self, path: str, minute: int, since: int, reached: int) -> None:
        """A declaration gave ``path`` rate limits (``since``: its ``seq``, or 0;
        ``reached``: the latest minute of it and of the attempts in flight under it)."""
        if self.declared:
            self.windows[path] = RateRow(
                path, minute, 0, 0, since, reached if self.tracks else None
            )


class Rates:
    """Every node's rate window, folded from the events."""

    def __init__(self) -> None:
        self._now = _Fold(kept_back=True, declared=True, marks=_MARKS, tracks=_TRACKS)
        #: As releases of writer format 5 counted, and this one counts a window whose
        #: lineage they started (``reached`` NULL): no highest minute tracked.
        self._unreached = _Fold(kept_back=True, declared=True, marks=_MARKS)
        #: As releases up to writer format 4 counted a clock stepped back: no position
        #: recorded (a window one of them wrote beside this release may carry that count).
        self._unmarked = _Fold(kept_back=True, declared=True)
        #: As releases before writer format 1 counted a clock stepped back: the window
        #: started over (a checkpoint or a window may carry that count).
        self._stepless = _Fold(kept_back=False, declared=True)
        #: As releases before writer format 2 counted (either step-back rule): a
        #: declaration started nothing. Only windows they wrote are judged by these.
        self._undeclared = (
            _Fold(kept_back=True, declared=False),
            _Fold(kept_back=False, declared=False),
        )
        self._folds = (
            self._now,
            self._unreached,
            self._unmarked,
            self._stepless,
            *self._undeclared,
        )
        #: Each call's last reservation: its ``seq`` and its token estimate (what its
        #: settlement corrects).
        self.reserved: dict[str, tuple[int, int]] = {}
        #: The budget of each call in flight (reserved, its attempt not yet ended), and
        #: when its last attempt started.
        self.flying: dict[str, str] = {}
        self.flying_at: dict[str, float] = {}
        #: True after a cut whose checkpoint carried no windows: a window is known only
        #: once a reservation or declaration after the cut has started it anew.
        self.partial = False
        #: True after a cut: a checkpoint carries the windows as this release counts
        #: them, not as an older release did.
        self.seeded = False
        self.restarted: set[str] = set()

    @property
    def windows(self) -> dict[str, RateRow]:
        """The windows as this release counts them."""
        return self._now.windows

    def feed(
        self,
        seq: int,
        kind: str,
        data: dict[str, Any],
        at: float,
        call: str,
        started_at: float,
        policies: Mapping[str, Policy],
    ) -> None:
        """Apply event ``seq`` of ``call`` (whose last attempt started at ``started_at``)."""
        if kind in _LANDED:
            self.flying.pop(call, None)
            self.flying_at.pop(call, None)
        elif kind == "budget.reserved":
            tokens = int(data.get("tokens", 0))
            self.reserved[call] = (seq, tokens)
            self.flying[call] = str(data["budget"])
            paths = _limited(policies, str(data["budget"]))
            self.restarted.update(self._now.reserve(paths, minute_of(at), tokens, seq))
            for fold in self._folds[1:]:
                fold.reserve(paths, minute_of(at), tokens, seq)
        elif kind == "budget.settled" and data.get("tokens") is not None:
            reserved, estimate = self.reserved.get(call, (0, 0))
            paths = _limited(policies, str(data["budget"]))
            for fold in self._folds:
                fold.settle(paths, minute_of(started_at), reserved, int(data["tokens"]) - estimate)
        if call in self.flying:
            self.flying_at[call] = started_at  # as the call's state has it (last_attempt_at)

    def declare(
        self, seq: int, data: dict[str, Any], at: float, policies: Mapping[str, Policy]
    ) -> None:
        """Apply ``budget.limit_set`` ``seq`` (before ``policies`` take it in)."""
        path = str(data["path"])
        if _rated(policy_from(data)) and not _rated(policies.get(path, NO_POLICY)):
            # With no call in flight under it, no earlier attempt can settle after this.
            under = path + "/"
            busy = [
                minute_of(self.flying_at.get(call, at))
                for call, b in self.flying.items()
                if b == path or b.startswith(under)
            ]
            self.restarted.add(path)
            for fold in self._folds:
                fold.declare(path, minute_of(at), seq if busy else 0, max([minute_of(at), *busy]))

    def seed(self, windows: dict[str, RateRow]) -> None:
        """Start from the windows a checkpoint carried."""
        for fold in self._folds:
            untracked = {p: w._replace(reached=None) for p, w in windows.items()}
            fold.windows = dict(windows) if fold.tracks else untracked
        self.seeded = True

    def exports(self) -> list[list[list[Any]]]:
        """The windows as a checkpoint may carry them: as this release or an older one
        counted them, with ``since`` or (before writer format 2) without."""
        out = []
        for fold in self._folds:
            out.append(export(fold.windows))
            out.append(sorted(list(row[:4]) for row in fold.windows.values()))
        return out

    def compare(self, rows: list[RateRow]) -> list[str]:
        """What differs between the stored windows and the events' (nothing when equal)."""
        stored = {row.path: row for row in rows}
        problems = []
        for path in sorted(set(stored) | set(self.windows)):
            if self.partial and path not in self.restarted:
                continue  # its window was counted before the cut, in events no longer here
            have = stored.get(path)
            if have not in self._accepted(path, have):
                problems.append(
                    f"rate window {path!r}: stored {_counts(have)} but the events give "
                    f"{_counts(self.windows.get(path))}"
                )
        return problems

    def _accepted(self, path: str, have: RateRow | None) -> list[RateRow | None]:
        """What a stored window of ``path`` may be: one with ``reached`` as this release
        counts it; one without, as this release counts a lineage it does not track (or
        with a release before format 5's, or format 1's, step-back rule); one whose
        ``since`` is NULL, or none, as a release before format 2 counted it too."""
        if have is not None and have.reached is not None:
            return [self._now.windows.get(path)]
        folds = (self._now, self._unreached, self._unmarked, self._stepless)
        now = [fold.windows.get(path) for fold in folds]
        if have is not None and have.since is not None:
            carried = now[0]
            if self.seeded and path not in self.restarted and carried and carried.reached:
                # Counted before the cut in a lineage this release does not track, which
                # the cut's checkpoint carries as tracked: how, nothing left says.
                return [have]
            return now
        if have is not None and self.seeded and path not in self.restarted:
            return [have]  # an older release's count from before the cut, which left no trace
        older = [fold.windows.get(path) for fold in self._undeclared]
        return [*now, *(None if w is None else w._replace(since=None) for w in older)]


def export(windows: Mapping[str, RateRow]) -> list[list[Any]]:
    """Windows as a checkpoint carries them: ``[path, minute, requests, tokens, since,
    reached]``, without ``reached`` where it is NULL (as a release before writer format 6
    wrote them) and without ``since`` too where that is (before format 2)."""
    return sorted(list(row[: _carried(row)]) for row in windows.values())


def _carried(row: RateRow) -> int:
    return 4 if row.since is None else 5 if row.reached is None else 6


def _rated(policy: Policy) -> bool:
    _, _, _, rpm, tpm, _ = policy
    return rpm is not None or tpm is not None


def _limited(policies: Mapping[str, Policy], budget: str) -> list[str]:
    """``budget`` and its ancestors whose policy declares ``rpm`` or ``tpm``."""
    return [path for path in lineage(budget) if _rated(policies.get(path, NO_POLICY))]


def _counts(row: RateRow | None) -> str:
    if row is None:
        return "no window"
    since = f" since={row.since}" if row.since else ""
    reached = f" reached={row.reached}" if row.reached is not None else ""
    return f"minute={row.minute} requests={row.requests} tokens={row.tokens}{since}{reached}"
