"""What verification found."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class VerifyReport:
    """What verification found. ``ok`` when ``problems`` is empty.

    ``problems`` are in the order found (the chain first, then each event's
    meaning, then the stored projections); ``first_broken_seq`` is the lowest
    event number any problem names.
    """

    events: int = 0
    calls: int = 0
    budgets: int = 0
    problems: list[str] = field(default_factory=list)
    first_broken_seq: int | None = None

    @property
    def ok(self) -> bool:
        """Whether the ledger passed every check."""
        return not self.problems

    def broken(self, seq: int, problem: str) -> None:
        """Record ``problem``, found at event ``seq``."""
        if self.first_broken_seq is None or seq < self.first_broken_seq:
            self.first_broken_seq = seq
        self.problems.append(problem)
