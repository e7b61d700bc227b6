"""A condition that repeats at every turn of a periodic job (the ledger refusing each
heartbeat): said when it starts, at most once a minute while it lasts, and once when it
ends, not at every turn (every ``heartbeat_s``)."""

from __future__ import annotations

from dataclasses import dataclass

#: While the condition lasts, its line is repeated at most this often.
SAY_EVERY_S = 60.0


@dataclass
class Repeating:
    """Since when the condition has held (None: it does not) and when it was last said."""

    since: float | None = None
    said: float = 0.0

    def failed(self, now: float) -> bool:
        """A turn at ``now`` that found the condition: whether a line is due (the first at
        once, then one a minute)."""
        if self.since is None:
            self.since = self.said = now
            return True
        if now - self.said >= SAY_EVERY_S:
            self.said = now
            return True
        return False

    def lasted(self, now: float) -> float:
        """How long the condition has held at ``now`` (0 when it does not)."""
        return 0.0 if self.since is None else now - self.since

    def worked(self, now: float) -> float | None:
        """A turn at ``now`` that did not find it: how long it held, if it had (its end is
        then said), else None."""
        if self.since is None:
            return None
        lasted, self.since = now - self.since, None
        return lasted
