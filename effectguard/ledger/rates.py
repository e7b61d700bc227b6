"""Rate limits inside the admission transaction (see :mod:`effectguard.rules.ratelimit`).

:func:`rate_refusal` checks a new attempt against every ``rpm``, ``tpm`` and
``concurrency`` limit on its budget path; :func:`fold_rates` keeps each limited node's
minute window as budget events are appended (a reservation counts its attempt, a
settlement corrects the token estimate of an attempt its window counted) and
:func:`fold_declared` starts a node's window when a declaration gives it rate limits, so
the windows move with the events that caused them, in the same transaction.
"""

from __future__ import annotations

from collections.abc import Mapping

from effectguard.errors import Refusal
from effectguard.ledger.base import Tx
from effectguard.rules import ratelimit
from effectguard.rules.budget import BudgetPolicy, ancestors, policy_of
from effectguard.rules.events import BudgetLimitSet, BudgetReserved, BudgetSettled, Event
from effectguard.rules.workstate import WorkState

_WHAT = {"rpm": "requests per minute", "tpm": "tokens per minute", "concurrency": "calls in flight"}


def rate_refusal(
    tx: Tx,
    policies: Mapping[str, BudgetPolicy],
    budget: str,
    call_id: str,
    tokens: int,
    now: float,
) -> Refusal | None:
    """Why one more attempt on ``budget`` would break a rate limit (429), or None."""
    if not any(p.rate_limited for p in policies.values()):
        return None
    windows = tx.get_windows(ratelimit.limited(policies, budget))
    exceeded = ratelimit.check(policies, windows, tx.count_in_flight, budget, now, tokens)
    if exceeded is None:
        return None
    return Refusal(
        429,
        "rate_limited",
        _message(exceeded),
        call_id=call_id,
        retryable=True,  # every one (contract §5.6): the SDKs retry a bounded number of times
        retry_after=exceeded.retry_after,
    )


def _message(exceeded: ratelimit.RateExceeded) -> str:
    said = f"budget {exceeded.path!r} allows {exceeded.allowed} {_WHAT[exceeded.limit]}; "
    if exceeded.fits:
        return said + f"retry in {exceeded.retry_after} s"
    return said + (
        "this request does not fit that limit as it is set now: an operator must raise it "
        f"(effectguard budget set {exceeded.path} --{exceeded.limit} N) before a retry "
        f"(in {exceeded.retry_after} s) can pass"
    )


def fold_rates(tx: Tx, event: Event, seq: int, state: WorkState, now: float) -> None:
    """Count a reservation (event ``seq``) in its nodes' windows; correct them when it
    settles."""
    if isinstance(event, BudgetReserved):
        limited = _limited(tx, event.budget)
        for window in _windows(tx, limited):
            tx.put_window(ratelimit.admitted(window, now, event.tokens, seq))
    elif isinstance(event, BudgetSettled) and event.tokens is not None:
        windows = _windows(tx, _limited(tx, event.budget))
        if windows:
            _correct(tx, windows, state, event.tokens)


def _correct(tx: Tx, windows: list[ratelimit.RateWindow], state: WorkState, tokens: int) -> None:
    """Replace the estimate of ``state``'s attempt with ``tokens`` in the windows that
    counted it."""
    reserved = _Reserved(tx, state.call_id)
    for window in windows:
        fixed = ratelimit.corrected(window, state.last_attempt_at, state.tokens, tokens, reserved)
        if fixed != window:
            tx.put_window(fixed)


def fold_declared(tx: Tx, event: BudgetLimitSet, seq: int, now: float) -> None:
    """A declaration (event ``seq``) that gives its node ``rpm`` or ``tpm`` starts the
    node's window afresh: run before the new policy is stored, to see the old one.

    Only a call in flight under the node now can settle later having been reserved
    before the declaration, so with none the window records no position (``since`` 0):
    its settlements then read nothing to tell the two apart. The window's ``reached``
    covers the minutes those calls' attempts started in (one may be later than now,
    after a far step back of the clock).
    """
    after = policy_of(event)
    if ratelimit.gains(tx.get_policies([event.path]).get(event.path), after):
        flying = [s.last_attempt_at for s in tx.flying_under(event.path)]
        tx.put_window(ratelimit.started(event.path, now, seq if flying else 0, flying))


class _Reserved:
    """The ledger position of a call's last reservation, read from its events once, and
    only if a window that records a position asks (one a declaration started mid-minute,
    or a step back of the clock touched: never on the common path)."""

    def __init__(self, tx: Tx, call_id: str) -> None:
        self._tx, self._call_id, self._seq = tx, call_id, -1

    def __call__(self) -> int:
        if self._seq < 0:
            events = self._tx.events_of(self._call_id)
            self._seq = max((e.seq for e in events if e.kind == BudgetReserved.kind), default=0)
        return self._seq


def _limited(tx: Tx, budget: str) -> list[str]:
    return ratelimit.limited(tx.get_policies(ancestors(budget)), budget)


def _windows(tx: Tx, paths: list[str]) -> list[ratelimit.RateWindow]:
    if not paths:
        return []
    kept = tx.get_windows(paths)
    return [kept.get(p) or ratelimit.first(p) for p in paths]
