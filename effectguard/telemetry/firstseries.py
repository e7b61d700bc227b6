"""The counter series a process exposes at 0 before it first counts them (docs/metrics.md).

Prometheus takes a series' first sample as where it starts: a counter first exposed at 1
adds nothing to ``rate()`` or ``increase()``. So ``serve`` makes these series at 0 for
every declared provider and priced model before its first request
(:meth:`~effectguard.telemetry.metrics.Metrics.declare`), and the first count of a
provider or model not declared (a dated snapshot's name) makes the others named here for
it: their own first counts then show. That count itself is still born at 1. Pure: which
series, not how.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

#: Every ``outcome`` of ``effectguard_requests_total`` (docs/metrics.md, Label values).
OUTCOMES: Final = (
    "completed",
    "failed",
    "not_processed",
    "not_sent",
    "effect_unknown",
    "observe_failed",
    "fenced",
    "replayed",
    "joined",
)
DIRECTIONS: Final = ("input", "output")
#: How an attempt ended (``effectguard_upstream_duration_seconds``' ``outcome``).
ENDINGS: Final = ("answered", "timeout", "error")
#: The refusal reasons shown at 0: those the shipped panels single out, and admission's
#: answers about a call already made (a key's call in flight, reused for another request,
#: or decided). Others (malformed requests, forbidden budgets) start at 1.
WATCHED_REASONS: Final = (
    "budget_exceeded",
    "rate_limited",
    "effect_unknown",
    "in_progress",
    "idempotency_key_reused",
    "reconciled_applied",
    "late_answer_applied",
)

#: (family, label values) of one series; the family is the name of its counter's
#: attribute on :class:`~effectguard.telemetry.metrics.MetricsObserver`.
Series = tuple[str, tuple[str, ...]]


def of_model(provider: str, model: str) -> Iterator[Series]:
    """A provider's model's series: requests by every outcome, tokens, cost."""
    for outcome in OUTCOMES:
        yield "requests", (provider, model, outcome)
    for direction in DIRECTIONS:
        yield "tokens", (provider, model, direction)
    yield "cost", (provider, model)


def of_provider(provider: str) -> Iterator[Series]:
    """A provider's series: replays, attempts by every ending, the watched refusals."""
    yield "replays", (provider,)
    for ending in ENDINGS:
        yield "upstream", (provider, ending)
    for reason in WATCHED_REASONS:
        yield "refusals", (provider, reason)
