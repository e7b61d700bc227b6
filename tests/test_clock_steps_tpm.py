"""Token-per-minute windows under a clock that NTP steps (docs/contract.md §5.6), on every
store: the manual clock on memory and SQLite, the database's clock on PostgreSQL (moved by
:func:`effectguard.testing.pgclock.set_ledger_clock`, which runs on by a few milliseconds
between moves: every step here leaves seconds to the next minute).

A settlement corrects the window that counted its attempt, and only that one: a call
admitted after a step back (counted in the minute the window had reached) gives its
estimate back when it settles, and a call counted in a window that a far step back
started over gives nothing back to the new one. Every ledger is verified when its test
ends (the ``ledger`` fixture).
"""

from __future__ import annotations

import time

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from test_clock_steps import SteppedClock
from test_rate_limits import _with_tokens, completion, refused_429
from test_store_contract import admit_ok, ledger, ledger_url, ns, register, req, store_kind

from effectguard.ledger import Ledger, Writer
from effectguard.rules import ratelimit
from effectguard.rules.budget import BudgetPolicy
from effectguard.rules.ratelimit import RateWindow

_ = (ledger, ledger_url, ns, store_kind)  # fixtures


class Moves:
    """Sets the ledger's clock: the stepped clock, or the database's on PostgreSQL."""

    def __init__(self, clock: SteppedClock | None, url: str) -> None:
        self._clock, self._url = clock, url

    def now(self) -> float:
        if self._clock is not None:
            return self._clock()
        from effectguard.testing.pgclock import ledger_clock

        return ledger_clock(self._url)

    def set(self, at: float) -> None:
        if self._clock is not None:
            self._clock.set(at)
            return
        from effectguard.testing.pgclock import set_ledger_clock

        set_ledger_clock(self._url, at)


@pytest.fixture
def clock(store_kind: str) -> SteppedClock | None:
    """The ledger's clock (overrides the store contract's: this one steps back too)."""
    return None if store_kind == "postgres" else SteppedClock(time.time())


@pytest.fixture
def moves(clock: SteppedClock | None, ledger_url: str) -> Moves:
    return Moves(clock, ledger_url)


@pytest.fixture
async def w1(ledger: Ledger, ns: str) -> Writer:
    """A worker whose lease outlasts every step of the clock here."""
    return await register(ledger, f"{ns}-w1", lease_s=10**9)


async def _settle(ledger: Ledger, w1: Writer, ns: str, call_id: str, tokens: int) -> None:
    """Complete ``call_id``'s first attempt; its settlement reports ``tokens``."""
    events = completion(call_id, f"{ns}/run", 500)
    events[1] = _with_tokens(events[1], tokens)
    await ledger.record(w1, call_id, 1, events)


def _thirty_into_a_minute(moves: Moves) -> float:
    """Thirty seconds into the next minute (the step back lands in the minute before)."""
    now = moves.now()
    return now - now % 60 + 60 + 30


async def test_a_call_admitted_after_a_step_back_gives_its_estimate_back(
    ledger: Ledger, w1: Writer, ns: str, moves: Moves
) -> None:
    """tpm 1000, 30 s into minute m: a call estimated at 800 settles at 30. NTP steps the
    clock back 45 s (into minute m-1, counted in m); a second call estimated at 800 settles
    at 30 too. The window holds 60 tokens, so a call of 300 fits. (The settlement of a call
    admitted after the step back was not corrected: its 800 stayed counted and the call of
    300 was refused 429 with a retry-after of 75 s.)"""
    start = _thirty_into_a_minute(moves)
    moves.set(start)
    await ledger.set_policy(BudgetPolicy(ns, tpm=1000))
    first = await admit_ok(ledger, w1, req(ns, tokens=800))
    await _settle(ledger, w1, ns, first.call_id, 30)
    moves.set(start - 45)
    second = await admit_ok(ledger, w1, req(ns, tokens=800))
    await _settle(ledger, w1, ns, second.call_id, 30)
    await admit_ok(ledger, w1, req(ns, tokens=300))


async def test_a_far_step_back_starts_a_window_its_older_calls_take_nothing_from(
    ledger: Ledger, w1: Writer, ns: str, moves: Moves
) -> None:
    """tpm 1000: a call estimated at 800 is admitted 30 s into minute m; the clock runs five
    minutes ahead (a call there starts the window in m+5), then NTP steps it back to minute
    m, where a second call of 800 starts the window over. The first call settling at 30
    gives nothing back to that window, which never counted it: a third call of 300 is
    refused. (Its settlement took 770 off the new window's 800, and the third call was
    admitted: 1100 tokens under way in the minute.)"""
    start = _thirty_into_a_minute(moves)
    moves.set(start)
    await ledger.set_policy(BudgetPolicy(ns, tpm=1000))
    first = await admit_ok(ledger, w1, req(ns, tokens=800))
    moves.set(start + 300)
    ahead = await admit_ok(ledger, w1, req(ns, tokens=10))
    await _settle(ledger, w1, ns, ahead.call_id, 10)
    moves.set(start + 5)
    await admit_ok(ledger, w1, req(ns, tokens=800))
    await _settle(ledger, w1, ns, first.call_id, 30)
    await refused_429(ledger, w1, ns, tokens=300)


async def test_a_call_in_flight_across_a_step_back_settles_in_its_window(
    ledger: Ledger, w1: Writer, ns: str, moves: Moves
) -> None:
    """tpm 1000: calls A (estimated 400) and B (500) are admitted 30 s into minute m; NTP
    steps the clock back 45 s; B settles at 30, then C (100) is admitted (counted in m),
    then A, in flight all along, settles at 700 tokens, more than its estimate. The window
    holds 830: a call of 300 is refused, one of 100 fits. (A's settlement, after C had
    stepped back, was not corrected: the window held 530 and admitted the call of 300,
    1130 tokens in the minute.)"""
    start = _thirty_into_a_minute(moves)
    moves.set(start)
    await ledger.set_policy(BudgetPolicy(ns, tpm=1000))
    a = await admit_ok(ledger, w1, req(ns, tokens=400))
    b = await admit_ok(ledger, w1, req(ns, tokens=500, request_hash="hash-2"))
    moves.set(start - 45)
    await _settle(ledger, w1, ns, b.call_id, 30)
    await admit_ok(ledger, w1, req(ns, tokens=100, request_hash="hash-3"))
    await _settle(ledger, w1, ns, a.call_id, 700)
    await refused_429(ledger, w1, ns, tokens=300)
    await admit_ok(ledger, w1, req(ns, tokens=100, request_hash="hash-4"))


async def test_a_forward_step_into_a_counted_minute_starts_a_window_older_calls_leave_alone(
    ledger: Ledger, w1: Writer, ns: str, moves: Moves
) -> None:
    """tpm 1000: a call estimated at 800 is admitted 30 s into minute m; NTP steps the clock
    back three minutes (a call there starts the window over), then forward into m again,
    where a second call of 800 starts the window over once more. The first call settling
    at 30 gives nothing back to that window, which never counted it: a call of 300 is
    refused. (The window counted minute m whole: the settlement took 770 off the second
    call's 800, and the call of 300 was admitted, 1100 tokens under way in the minute.)"""
    start = _thirty_into_a_minute(moves)
    moves.set(start)
    await ledger.set_policy(BudgetPolicy(ns, tpm=1000))
    first = await admit_ok(ledger, w1, req(ns, tokens=800))
    moves.set(start - 180)
    back = await admit_ok(ledger, w1, req(ns, tokens=10))
    await _settle(ledger, w1, ns, back.call_id, 10)
    moves.set(start + 10)
    await admit_ok(ledger, w1, req(ns, tokens=800))
    await _settle(ledger, w1, ns, first.call_id, 30)
    await refused_429(ledger, w1, ns, tokens=300)


async def test_a_call_in_flight_across_a_declaration_in_an_earlier_minute_is_left_alone(
    ledger: Ledger, w1: Writer, ns: str, moves: Moves
) -> None:
    """A call estimated at 800 is admitted 30 s into minute m while the node has no rate
    limit; NTP steps the clock back three minutes, where ``tpm 1000`` is declared (the
    call still in flight) and a call of 10 is admitted; the clock steps forward into m,
    where a call of 800 starts the window over. The first call settling at 30 gives
    nothing back to that window, which never counted it: a call of 300 is refused. (The
    window's highest minute started at the declaration's, so the forward step counted
    minute m whole: the settlement took 770 off, and the call of 300 was admitted.)"""
    start = _thirty_into_a_minute(moves)
    moves.set(start)
    first = await admit_ok(ledger, w1, req(ns, tokens=800))
    moves.set(start - 180)
    await ledger.set_policy(BudgetPolicy(ns, tpm=1000))
    back = await admit_ok(ledger, w1, req(ns, tokens=10))
    await _settle(ledger, w1, ns, back.call_id, 10)
    moves.set(start + 10)
    await admit_ok(ledger, w1, req(ns, tokens=800))
    await _settle(ledger, w1, ns, first.call_id, 30)
    await refused_429(ledger, w1, ns, tokens=300)


@given(
    steps=st.lists(
        st.tuples(st.floats(-59, 40, allow_nan=False), st.integers(0, 400), st.booleans()),
        min_size=1,
        max_size=60,
    )
)
def test_a_clock_never_a_minute_behind_itself_keeps_the_window_exact(
    steps: list[tuple[float, int, bool]],
) -> None:
    """Pure rules: admissions and settlements at a clock that moves forward or back, never
    more than 59 s behind the latest time it showed. After each, the window's tokens are
    exactly those of the attempts it counted: each one's estimate, or its reported tokens
    once settled (tracked here by which window instance counted which call)."""
    window, latest, at, position = RateWindow("a"), 600.0, 600.0, 1
    counted: dict[int, int] = {}  # call (its reservation position) -> tokens counted
    flying: dict[int, tuple[float, int]] = {}  # call -> admitted at, estimate
    for move, tokens, settle in steps:
        at = max(at + move, latest - 59)
        latest = max(latest, at)
        position += 1
        if settle and flying:
            call = sorted(flying)[tokens % len(flying)]
            started, estimate = flying.pop(call)
            window = ratelimit.corrected(window, started, estimate, tokens, lambda c=call: c)
            if call in counted:
                counted[call] = tokens
        else:
            window = ratelimit.admitted(window, at, tokens, position)
            if window.requests == 1:
                counted = {}  # the window started over
            counted[position] = tokens
            flying[position] = (at, tokens)
        assert window.tokens == sum(counted.values())


@given(
    steps=st.lists(
        st.tuples(
            # Steps of a few minutes either way, and a few that land near a boundary.
            st.one_of(st.sampled_from([0, -180, 180, -61, 61]), st.floats(-400, 400)),
            st.integers(0, 400),
            st.one_of(st.none(), st.integers(0, 3)),
        ),
        min_size=1,
        max_size=60,
    )
)
# The case the contract once called inexact: a call at 600 s, a far step back to 420 s, a
# forward step to 600 s, and the first call settling at 1 token after its estimate of 0.
@example(steps=[(0, 0, None), (-180, 0, None), (180, 0, None), (0, 1, 0)])
def test_a_clock_stepped_any_way_keeps_a_window_that_records_its_highest_minute_exact(
    steps: list[tuple[float, int, int | None]],
) -> None:
    """Pure rules: as above, but the clock steps back and forward by up to almost seven
    minutes, so a far step back and a forward step into a minute an earlier window counted
    happen with calls of that minute in flight. A window that records the highest minute
    it reached holds exactly the tokens of the attempts it counted. (Without it, the window
    started by that forward step took the correction of a call of that minute the earlier
    window counted: in the example, 1 token in a window whose only call estimated 0.)"""
    window, at, position = ratelimit.first("a"), 600.0, 1
    counted: dict[int, int] = {}
    flying: dict[int, tuple[float, int]] = {}
    for move, tokens, settles in steps:
        at = max(at + move, 0.0)
        position += 1
        if settles is not None and flying:
            call = sorted(flying)[min(settles, len(flying) - 1)]  # the oldest, most often
            started, estimate = flying.pop(call)
            window = ratelimit.corrected(window, started, estimate, tokens, lambda c=call: c)
            if call in counted:
                counted[call] = tokens
        else:
            window = ratelimit.admitted(window, at, tokens, position)
            if window.requests == 1:
                counted = {}
            counted[position] = tokens
            flying[position] = (at, tokens)
        assert window.tokens == sum(counted.values())
