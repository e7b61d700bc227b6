"""The count of client connections the proxy closed to make room (ingress/roomcap)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

#: Why connections are closed for room (ingress/roomcap.py names them too).
REASONS = ("max_connections", "open_files")


class RoomClosings:
    """``effectguard_connections_closed_for_room_total``, by reason: called with the
    reason and how many were closed."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.total = Counter(
            "effectguard_connections_closed_for_room",
            "Idle client connections the proxy closed to make room, by reason "
            "(max_connections reached, or open_files: no file could be opened).",
            ["reason"],
            registry=registry,
        )
        # Both reasons shown from the start at 0: an alert on an increase needs the series.
        self._children = {reason: self.total.labels(reason) for reason in REASONS}

    def __call__(self, reason: str, count: int) -> None:
        """Count ``count`` idle connections closed to make room, for ``reason``."""
        self._children[reason].inc(count)
