"""A label's distinct values, capped: a client names models (and, without proxy keys,
budgets), so a label that takes the values it invents must stop somewhere (docs/metrics.md)."""

from __future__ import annotations

import threading

#: Distinct values one label may take before further ones are counted as ``other``.
MAX_LABEL_VALUES = 100


class Capped:
    """Admits at most ``limit`` distinct values per scope; later ones become ``other``."""

    def __init__(self, limit: int = MAX_LABEL_VALUES) -> None:
        self._limit = limit
        self._seen: dict[str, set[str]] = {}
        self._lock = threading.Lock()

    def __call__(self, scope: str, value: str) -> str:
        seen = self._seen.get(scope)
        if seen is not None and value in seen:  # the hot path: no lock
            return value
        with self._lock:
            seen = self._seen.setdefault(scope, set())
            if value in seen or len(seen) < self._limit:
                seen.add(value)
                return value
        return "other"

    def values(self, scope: str) -> list[str]:
        with self._lock:
            return sorted(self._seen.get(scope, ()))
