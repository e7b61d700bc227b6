"""A ledger clock for tests: time moves only when the test says so.

Pass it as ``clock=`` to :func:`effectguard.ledger.open_store` (memory and
SQLite ledgers) and let a lease lapse with :meth:`ManualClock.advance` instead
of sleeping. A PostgreSQL ledger keeps the database's clock.
"""

from __future__ import annotations

import threading
import time


class ManualClock:
    """A clock that starts at the wall-clock time and moves only on :meth:`advance`."""

    def __init__(self, start: float | None = None) -> None:
        self._now = time.time() if start is None else start
        # The store reads the clock on its writer thread; the test advances it on its own.
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        """Move the clock forward by ``seconds`` (never back)."""
        if seconds < 0:
            raise ValueError("a clock does not go back")
        with self._lock:
            self._now += seconds
