"""Rate limits: requests and tokens per minute, calls in flight. Pure.

The window is the **calendar minute of the ledger's clock** (``floor(at / 60)``; the
database's clock on PostgreSQL), fixed, not sliding. A node that declares ``rpm`` or
``tpm`` keeps one :class:`RateWindow`: the minute it counts and, inside that minute, the
attempts admitted and their tokens. An attempt admitted in minute *m* counts in *m*:
one request, and the admission's token estimate (prompt bytes + output bound), corrected
to the tokens the provider reported when it settles — if the window still counts *m*.
The first admission of a later minute starts the window over. A step back of the clock
(NTP, a resumed VM) into the minute before the window's counts in the window's minute, so
a small step back cannot open a minute's count a second time; a clock further back (one
corrected from far ahead) starts the window over, as keeping it would refuse the node
until the clock caught up with the wrong time. The window is read and written in the
admission transaction, so the count is exact across replicas.

A step back makes a window's minute no longer tell which attempts it counted: after a
small one it counts attempts of the minute before, which a window in its minute
otherwise never does; after a far one it starts over in a minute whose earlier attempts
an older window counted. So either records where it happened, ``p`` (the ledger position
before the reservation that stepped back), and a settlement corrects exactly the
attempts the window counted (:func:`counts`). Kept back, the window still counts every
attempt of its own minute, and those of the minute before reserved after ``p``: it
records ``since = -p``. Started over, it counts the attempts reserved after ``p``, in its
minute (or, stepped back again, the one before): ``since = p``, as a declaration records.

A clock stepped back far and then forward again starts a window over in a minute an
earlier window counted, whose attempts may still be in flight: counting its minute whole,
that window would take their corrections. A window that records ``reached``, the highest
minute its node's windows have counted in, knows it: starting over forward into a minute
up to ``reached``, it records ``since = p`` as a far step back does. A node's first
window tracks it (:func:`first`), and so does a window a declaration starts; a window a
release before writer format 6 counted does not (None), nor do the windows after it until
a declaration starts one: there that case is not exact (the window the forward step starts
counts its minute whole, that attempt included).

A window counts the attempts admitted **while its node declares** ``rpm`` or ``tpm``. When a
node gains them (it had neither), its window starts afresh at that declaration, in the
declaration's minute, and records where (``since``: the declaration's ledger position, if
a call under the node was in flight then). An attempt admitted earlier in that minute,
under no limit, was counted in no window, so its settlement corrects nothing: a
settlement corrects a window only if the window counted its attempt (:func:`counts`).

``concurrency`` counts calls under the node that are in flight, read from the calls
themselves in the same transaction (so a crashed worker's calls count until the sweeper
marks them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Final, Literal

from effectguard.rules.budget import BudgetPolicy, ancestors

WINDOW_S: Final = 60
#: ``retry-after`` of a refusal no wait helps (a limit of 0, a ``tpm`` below the attempt's
#: own tokens): only an operator raising the limit does (``budget set``, read at every
#: admission on every replica). A minute, the limits' own period, leaves them time between
#: the SDKs' bounded retries, and the OpenAI and Anthropic SDKs all wait it (their 1.x
#: releases a wait of at most 60 s; openai-python 3 up to 120 s, past which it stops).
UNTIL_RAISED_S: Final = 60
#: How many minutes back a window keeps counting a clock that was stepped back.
KEPT_BACK: Final = 1
Limit = Literal["rpm", "tpm", "concurrency"]


def minute_of(at: float) -> int:
    """The calendar minute (of the epoch) containing instant ``at``."""
    return math.floor(at) // WINDOW_S


@dataclass(frozen=True, slots=True)
class RateWindow:
    """What one node admitted in one minute: attempts and tokens.

    ``since`` is 0 when every attempt of its minute that can still settle was counted,
    and none of another minute. Positive, a ledger position (event ``seq``): the window
    counted exactly the attempts reserved after it (those of its minute, or of the one
    before after a step back); a declaration that started it mid-minute while calls were
    in flight records one, and so does a step back that started it over. Negative, ``-p``:
    the window counted every attempt of its minute that can still settle, and those of
    the minute before reserved after position ``p`` (a step back it kept). None: a window
    a release before writer format 2 counted, which did not record it (read as 0, as that
    release did).

    ``reached`` is the highest minute this node's windows have counted in, carried from
    each window to the next. None: not tracked (a window a release before writer format 6
    counted, and those after it until a declaration starts one; a step forward into a
    minute an earlier window counted records nothing there, as that release did).
    """

    path: str
    minute: int = 0
    requests: int = 0
    tokens: int = 0
    since: int | None = 0
    reached: int | None = None

    def at(self, minute: int) -> RateWindow:
        """This window as seen in ``minute``: itself in its minute and in the one before
        (a clock stepped back reopens no minute), else empty (with the same ``reached``)."""
        if self.minute - KEPT_BACK <= minute <= self.minute:
            return self
        return RateWindow(self.path, minute, reached=self.reached)


def first(path: str) -> RateWindow:
    """The window of ``path`` before its first admission (none kept yet)."""
    return RateWindow(path, reached=0)


@dataclass(frozen=True, slots=True)
class RateExceeded:
    """Admission refused: ``path``'s ``limit`` has no room; ``retry_after`` seconds until it
    may. ``fits`` is False where no wait helps (a limit of 0, or a ``tpm`` below this
    attempt's own tokens): the attempt fits only once an operator raises the limit, and
    ``retry_after`` is then :data:`UNTIL_RAISED_S`."""

    path: str
    limit: Limit
    allowed: int
    retry_after: int
    fits: bool = True


def limited(policies: Mapping[str, BudgetPolicy], path: str) -> list[str]:
    """The ancestors of ``path`` (root first) that declare ``rpm`` or ``tpm``."""
    out = []
    for p in ancestors(path):
        policy = policies.get(p)
        if policy is not None and (policy.rpm is not None or policy.tpm is not None):
            out.append(p)
    return out


def check(
    policies: Mapping[str, BudgetPolicy],
    windows: Mapping[str, RateWindow],
    in_flight: Callable[[str], int],
    path: str,
    at: float,
    tokens: int,
) -> RateExceeded | None:
    """Whether one more attempt of ``tokens`` fits every rate limit on ``path`` at ``at``.

    Returns the root-most node whose limit has no room, or None. ``in_flight(p)`` counts
    the calls in flight under ``p`` (asked only of nodes that limit concurrency).
    """
    minute = minute_of(at)
    for p in ancestors(path):
        policy = policies.get(p)
        if policy is None:
            continue
        window = (windows.get(p) or RateWindow(p)).at(minute)
        # Until the window's minute ends: after a step back, later than this clock's minute.
        next_minute = max(1, math.ceil((window.minute + 1) * WINDOW_S - at))
        if policy.rpm is not None and window.requests + 1 > policy.rpm:
            return _exceeded(p, "rpm", policy.rpm, next_minute, policy.rpm > 0)
        if policy.tpm is not None and window.tokens + tokens > policy.tpm:
            return _exceeded(p, "tpm", policy.tpm, next_minute, tokens <= policy.tpm)
        if policy.concurrency is not None and in_flight(p) + 1 > policy.concurrency:
            return _exceeded(p, "concurrency", policy.concurrency, 1, policy.concurrency > 0)
    return None


def _exceeded(path: str, limit: Limit, allowed: int, room_in: int, fits: bool) -> RateExceeded:
    """The refusal of a full ``limit`` that has room in ``room_in`` seconds, or, where the
    attempt does not ``fit`` it at all, once an operator raises it."""
    return RateExceeded(path, limit, allowed, room_in if fits else UNTIL_RAISED_S, fits)


def admitted(window: RateWindow, at: float, tokens: int, position: int) -> RateWindow:
    """``window`` after an attempt of ``tokens`` was admitted at ``at``, its reservation at
    ledger position ``position``."""
    minute = minute_of(at)
    current = window.at(minute)
    if minute < window.minute and current.since == 0:
        # Stepped back: kept in the later minute, or starting over in an earlier one. A
        # reservation always follows the declaration that gave it limits: position > 1.
        current = replace(current, since=1 - position if current is window else position - 1)
    elif current is not window and window.reached is not None and minute <= window.reached:
        # Stepped forward into a minute an earlier window counted: its attempts of this
        # minute may still be in flight, and this window counts none of them.
        current = replace(current, since=position - 1)
    reached = window.reached
    if reached is not None and minute > reached:
        reached = minute
    # Built directly, not by replace(): this runs on every admission under rpm or tpm.
    c = current
    return RateWindow(c.path, c.minute, c.requests + 1, c.tokens + tokens, c.since, reached)


def gains(before: BudgetPolicy | None, after: BudgetPolicy) -> bool:
    """Whether declaring ``after`` over ``before`` gives a node ``rpm`` or ``tpm`` it had
    neither of (so its window starts: :func:`started`)."""
    return _limits(after) and not (before is not None and _limits(before))


def _limits(policy: BudgetPolicy) -> bool:
    return policy.rpm is not None or policy.tpm is not None


def started(path: str, at: float, since: int, flying: Sequence[float] = ()) -> RateWindow:
    """The window of ``path`` once a declaration at ``at`` gave it rate limits: it counts
    nothing yet, and none of its minute's earlier attempts. ``since`` is the declaration's
    ledger position, or 0 when no call under ``path`` was in flight (none of the earlier
    attempts can settle after it). ``flying``: when the attempts in flight under ``path``
    started; ``reached`` covers their minutes too, since a clock stepped back far before
    the declaration leaves them later than its own, and a window started forward in one
    of them must not count them."""
    minute = minute_of(at)
    return RateWindow(path, minute, since=since, reached=max([minute, *map(minute_of, flying)]))


def counts(window: RateWindow, admitted_at: float, reserved: Callable[[], int]) -> bool:
    """Whether ``window`` counted the attempt admitted at ``admitted_at``, whose
    reservation is at ledger position ``reserved()`` (asked only of a window that records
    a position, and only where its minute does not answer).

    A window that has moved on from the attempt's minute no longer counts it. Otherwise
    as its ``since`` says (:class:`RateWindow`): every attempt of its minute, the attempts
    reserved after a position, or both, the second only in the minute before.
    """
    minute, since = minute_of(admitted_at), window.since
    if not since:
        return window.minute == minute
    if since < 0 and minute == window.minute:
        return True
    return window.minute - KEPT_BACK <= minute <= window.minute and reserved() > abs(since)


def corrected(
    window: RateWindow,
    admitted_at: float,
    estimate: int,
    actual: int,
    reserved: Callable[[], int],
) -> RateWindow:
    """``window`` after an attempt admitted at ``admitted_at`` (reserved at ledger position
    ``reserved()``) settled at ``actual`` tokens: its ``estimate`` is replaced, never below
    0, if the window counted it (:func:`counts`)."""
    if not counts(window, admitted_at, reserved):
        return window
    return replace(window, tokens=max(0, window.tokens + actual - estimate))
