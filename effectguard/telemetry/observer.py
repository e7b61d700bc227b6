"""What the guard reports as it works (implemented by ``effectguard.telemetry.metrics``,
``effectguard.telemetry.logs`` and ``effectguard.telemetry.tracing``).

The guard calls an :class:`Observer`; the default one does nothing, so the
call path does not depend on any metrics, logging format or tracing library.
:class:`Observers` hands every report to several observers in turn.

Two kinds of report: *measurements* (bounded labels: no call ids, no keys — they
become metric series) and *per-request* reports (:class:`CallReport`, incidents),
which name the call and become log lines and trace spans.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from effectguard.telemetry.report import CallReport


class Outgoing(Protocol):
    """An attempt's request before it is sent: an observer may still set its headers."""

    def set_header(self, name: str, value: str) -> None:
        """Set ``name`` to ``value``, replacing any value the request had."""
        ...


class Observer(Protocol):
    """Receives the guard's measurements and per-request reports."""

    def request_done(self, provider: str, model: str, outcome: str) -> None:
        """A request finished with ``outcome`` (completed, failed, refused, replayed …)."""

    def refused(self, provider: str, reason: str) -> None:
        """A request was refused for ``reason`` (budget_exceeded, effect_unknown …)."""

    def settled(
        self, provider: str, model: str, input_tokens: int, output_tokens: int, cost_nanos: int
    ) -> None:
        """A call was settled with this usage and cost."""

    def upstream_seconds(self, provider: str, seconds: float, outcome: str) -> None:
        """Time spent waiting on the upstream for one attempt, whatever its ``outcome``:
        ``answered``, ``timeout`` or ``error`` (callpath/timing)."""

    def overhead_seconds(self, seconds: float) -> None:
        """The guard's own time for one dispatched request (total minus upstream), once."""

    def internal_error(self) -> None:
        """An unexpected exception was answered with a 500 ``internal_error``."""

    def call_started(self, report: CallReport) -> None:
        """A request reached the guard (``report`` holds its provider, endpoint, budget)."""

    def dispatching(self, report: CallReport, outgoing: Outgoing) -> None:
        """An attempt is about to be sent upstream; ``outgoing`` may still gain headers."""

    def call_finished(self, report: CallReport) -> None:
        """A request's outcome is known (streams: at their end). Called once per request."""

    def incident(self, kind: str, call_id: str | None, detail: str) -> None:
        """Something an operator must hear about once: ``observe_failed``, ``interrupted`` …"""


class NullObserver:
    """An observer that records nothing."""

    def request_done(self, provider: str, model: str, outcome: str) -> None:
        pass

    def refused(self, provider: str, reason: str) -> None:
        pass

    def settled(
        self, provider: str, model: str, input_tokens: int, output_tokens: int, cost_nanos: int
    ) -> None:
        pass

    def upstream_seconds(self, provider: str, seconds: float, outcome: str) -> None:
        pass

    def overhead_seconds(self, seconds: float) -> None:
        pass

    def internal_error(self) -> None:
        pass

    def call_started(self, report: CallReport) -> None:
        pass

    def dispatching(self, report: CallReport, outgoing: Outgoing) -> None:
        pass

    def call_finished(self, report: CallReport) -> None:
        pass

    def incident(self, kind: str, call_id: str | None, detail: str) -> None:
        pass


class Observers:
    """Several observers as one: each report goes to every one, in order."""

    def __init__(self, observers: Sequence[Observer]) -> None:
        self.observers = tuple(observers)

    def request_done(self, provider: str, model: str, outcome: str) -> None:
        for o in self.observers:
            o.request_done(provider, model, outcome)

    def refused(self, provider: str, reason: str) -> None:
        for o in self.observers:
            o.refused(provider, reason)

    def settled(
        self, provider: str, model: str, input_tokens: int, output_tokens: int, cost_nanos: int
    ) -> None:
        for o in self.observers:
            o.settled(provider, model, input_tokens, output_tokens, cost_nanos)

    def upstream_seconds(self, provider: str, seconds: float, outcome: str) -> None:
        for o in self.observers:
            o.upstream_seconds(provider, seconds, outcome)

    def overhead_seconds(self, seconds: float) -> None:
        for o in self.observers:
            o.overhead_seconds(seconds)

    def internal_error(self) -> None:
        for o in self.observers:
            o.internal_error()

    def call_started(self, report: CallReport) -> None:
        for o in self.observers:
            o.call_started(report)

    def dispatching(self, report: CallReport, outgoing: Outgoing) -> None:
        for o in self.observers:
            o.dispatching(report, outgoing)

    def call_finished(self, report: CallReport) -> None:
        for o in self.observers:
            o.call_finished(report)

    def incident(self, kind: str, call_id: str | None, detail: str) -> None:
        for o in self.observers:
            o.incident(kind, call_id, detail)


def combine(*observers: Observer | None) -> Observer | None:
    """One observer for the given ones (None left out; None if none is left)."""
    present = [o for o in observers if o is not None]
    if not present:
        return None
    return present[0] if len(present) == 1 else Observers(present)
