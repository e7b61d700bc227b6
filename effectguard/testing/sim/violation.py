"""One broken invariant: what every checker returns (:mod:`.invariants`,
:mod:`.operatorchecks`, :mod:`.maintchecks`)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Violation"]


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken invariant, with enough detail to find the call."""

    invariant: str
    detail: str

    def __str__(self) -> str:
        return f"{self.invariant}: {self.detail}"
