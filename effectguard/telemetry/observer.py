"""What the guard reports as it works (implemented by ``effectguard.telemetry.metrics``).

The guard calls an :class:`Observer`; the default one does nothing, so the
call path does not depend on any metrics library.
"""

from __future__ import annotations

from typing import Protocol


class Observer(Protocol):
    """Receives the guard's measurements. Labels are bounded: no call ids, no keys."""

    def request_done(self, provider: str, model: str, outcome: str) -> None:
        """A request finished with ``outcome`` (completed, failed, refused, replayed …)."""

    def refused(self, provider: str, reason: str) -> None:
        """A request was refused for ``reason`` (budget_exceeded, effect_unknown …)."""

    def settled(
        self, provider: str, model: str, input_tokens: int, output_tokens: int, cost_nanos: int
    ) -> None:
        """A call was settled with this usage and cost."""

    def upstream_seconds(self, provider: str, seconds: float) -> None:
        """Time spent waiting on the upstream for one attempt."""

    def overhead_seconds(self, seconds: float) -> None:
        """The guard's own time for one request (total minus upstream)."""

    def internal_error(self) -> None:
        """An unexpected exception was answered with a 500 ``internal_error``."""


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

    def upstream_seconds(self, provider: str, seconds: float) -> None:
        pass

    def overhead_seconds(self, seconds: float) -> None:
        pass

    def internal_error(self) -> None:
        pass
