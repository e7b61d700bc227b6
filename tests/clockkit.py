"""The ledger's clock, moved by a test on every store: a :class:`ManualClock` on memory and
SQLite, the database's clock on PostgreSQL (through ``effectguard_now()``'s test-only
offset, :mod:`effectguard.testing.pgclock`).

A manual clock stands still between moves, so a test can put an admission a millisecond
before a boundary. The database's clock keeps running: each move re-anchors it so that it
reads the target *then*, and it has run on by the time the next transaction reads it (a
few milliseconds; never more than the test's next step takes). A test that needs an exact
instant on PostgreSQL therefore judges the outcome by the time the ledger recorded
(:func:`recorded_at`), not by the time it asked for; every other step leaves itself a
margin of seconds to the next boundary.
"""

from __future__ import annotations

from effectguard.ledger import Ledger
from effectguard.testing.clock import ManualClock


class LedgerTime:
    """Moves the ledger's clock forward (``set`` to an instant, ``advance`` by seconds).

    The target is kept here, so moves add up exactly however long the test's steps take.
    """

    def __init__(self, manual: ManualClock | None, pg_url: str | None = None) -> None:
        if (manual is None) == (pg_url is None):
            raise ValueError("give a manual clock or a PostgreSQL ledger URL, not both")
        self.manual = manual
        self._url = pg_url
        self._at = manual() if manual is not None else 0.0

    @property
    def exact(self) -> bool:
        """Whether the clock stands still between moves (memory, SQLite)."""
        return self.manual is not None

    @property
    def target(self) -> float:
        """Where the clock was last moved to."""
        return self._at

    def set(self, at: float) -> None:
        """Move the clock to ``at`` (a manual clock only forwards; the database's anywhere)."""
        self._at = at
        if self.manual is not None:
            self.manual.advance(at - self.manual())
            return
        from effectguard.testing.pgclock import set_ledger_clock

        assert self._url is not None
        set_ledger_clock(self._url, at)

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` past the last target."""
        self.set(self._at + seconds)


async def recorded_at(ledger: Ledger, call_id: str) -> float:
    """When the ledger recorded a call's manifest: the time its admission was decided at."""
    events = await ledger.events(call_id)
    return next(e.at for e in events if e.kind == "call.manifest")
