"""Rate limits inside the admission transaction (see :mod:`effectguard.rules.ratelimit`).

:func:`rate_refusal` checks a new attempt against every ``rpm``, ``tpm`` and
``concurrency`` limit on its budget path; :func:`fold_rates` keeps each limited node's
minute window as budget events are appended (a reservation counts its attempt, a
settlement corrects the token estimate), so the windows move with the events that
caused them, in the same transaction.
"""

from __future__ import annotations

from collections.abc import Mapping

from effectguard.errors import Refusal
from effectguard.ledger.base import Tx
from effectguard.rules import ratelimit
from effectguard.rules.budget import BudgetPolicy, ancestors
from effectguard.rules.events import BudgetReserved, BudgetSettled, Event
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
    never = exceeded.retry_after is None  # no wait helps: an SDK must not retry forever
    return Refusal(
        429,
        "rate_limited",
        f"budget {exceeded.path!r} allows {exceeded.allowed} {_WHAT[exceeded.limit]}; "
        + ("this request never fits" if never else f"retry in {exceeded.retry_after} s"),
        call_id=call_id,
        retryable=not never,
        retry_after=exceeded.retry_after,
    )


def fold_rates(tx: Tx, event: Event, state: WorkState, now: float) -> None:
    """Count a reservation in its nodes' windows; correct them when it settles."""
    if isinstance(event, BudgetReserved):
        limited = _limited(tx, event.budget)
        for window in _windows(tx, limited):
            tx.put_window(ratelimit.admitted(window, now, event.tokens))
    elif isinstance(event, BudgetSettled) and event.tokens is not None:
        limited = _limited(tx, event.budget)
        for window in _windows(tx, limited):
            fixed = ratelimit.corrected(window, state.last_attempt_at, state.tokens, event.tokens)
            if fixed != window:
                tx.put_window(fixed)


def _limited(tx: Tx, budget: str) -> list[str]:
    return ratelimit.limited(tx.get_policies(ancestors(budget)), budget)


def _windows(tx: Tx, paths: list[str]) -> list[ratelimit.RateWindow]:
    if not paths:
        return []
    kept = tx.get_windows(paths)
    return [kept.get(p) or ratelimit.RateWindow(p) for p in paths]
