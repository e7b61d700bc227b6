"""Events a test records for a call, with the fields the test does not look at filled in.

Many tests need a call that simply went well: attempt 1 answered 200, the reservation
settled, the call completed. :func:`completion` builds those three events; the test
names only what it cares about (the budget, the amounts, and the answer where it matters).
"""

from __future__ import annotations

from effectguard.rules.events import (
    AttemptLateAnswer,
    AttemptObserved,
    BudgetSettled,
    CallCompleted,
    Event,
)


def completion(
    call: str,
    *,
    budget: str,
    reserved: int,
    actual: int,
    body: str = "{}",
    body_encoding: str = "utf8",
    usage: dict[str, int] | None = None,
    usage_problem: str | None = None,
) -> list[Event]:
    """Attempt 1 of ``call`` answered 200 with ``body`` (no headers, no usage unless
    given), ``budget`` settled ``reserved`` for ``actual``, and the call completed."""
    observed = AttemptObserved(
        call=call,
        attempt=1,
        status=200,
        not_processed=False,
        usage=usage,
        usage_problem=usage_problem,
        headers={},
        body=body,
        body_encoding=body_encoding,
    )
    settled = BudgetSettled(call=call, budget=budget, reserved=reserved, actual=actual)
    return [observed, settled, CallCompleted(call=call, outcome="completed")]


def late_200(
    call: str, attempt: int = 1, *, observed_by: str = "w", generation: int = 1
) -> AttemptLateAnswer:
    """A late 200 kept for ``attempt`` of ``call`` (sent by ``observed_by``, generation
    ``generation``): the provider says it applied the call."""
    return AttemptLateAnswer(
        call=call,
        attempt=attempt,
        status=200,
        effect="applied",
        body_digest="sha256:00",
        body_bytes=2,
        usage=None,
        usage_problem=None,
        cost=None,
        observed_by=observed_by,
        generation=generation,
        reason="fenced",
    )
