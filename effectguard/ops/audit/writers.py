"""Who may write: registered workers at their current generation, and operators.

Rules (docs/contract.md §7), checked from the events alone:

* a worker exists from its ``worker.registered`` event on, at the generation that
  event gives it; generations strictly increase across the whole ledger;
* registering the same worker id again supersedes its older generation, and a
  ``worker.taken_over`` fences that generation: neither writes again;
* generation 0 is an operator tool (CLI reconcile, budget set, key commands, the
  operator page, ``effectguard archive``), never a worker: every tool writes there as
  the one operator identity (:data:`OPERATOR_WORKER`), and only operator decisions
  (:data:`OPERATOR_KINDS`). A worker registers at a generation the ledger gives it,
  never 0, so an event at generation 0 by any other name has no writer the ledger knows.
"""

from __future__ import annotations

from typing import Final

from effectguard.rules.events import StoredEvent

#: The worker name every operator tool writes under at generation 0 (the store's
#: ``ledger.base.OPERATOR``; spelled out here because the verifier shares no code with it).
OPERATOR_WORKER: Final = "operator"
#: What an operator (generation 0) may write: limits, proxy keys, reconcile decisions, and
#: marking an attempt interrupted (``Ledger.interrupt``): the conservative move, it claims
#: no effect; and an archive's checkpoint (``effectguard archive``).
OPERATOR_KINDS: Final = frozenset(
    {
        "budget.limit_set",
        "key.created",
        "key.revoked",
        "call.reconciled",
        "call.resend_authorized",
        "budget.unheld",
        "budget.corrected",
        "attempt.interrupted",
        "budget.held",
        "ledger.archived",
    }
)


class Writers:
    """Registered workers and fenced generations, as the events declare them."""

    def __init__(self) -> None:
        self.current: dict[str, int] = {}
        self.registered_at: dict[tuple[str, int], int] = {}
        self.fenced_at: dict[tuple[str, int], int] = {}
        self.top_generation = 0

    def feed(self, stored: StoredEvent) -> list[str]:
        """Check that ``stored`` had a right to be written, then note what it declares."""
        seq, worker, generation = stored.seq, stored.worker, stored.generation
        where = f"event {seq}"
        if stored.kind == "worker.registered":
            return self._register(stored)
        if generation == 0:
            if worker != OPERATOR_WORKER:
                return [
                    f"{where}: {stored.kind} written at generation 0 by {worker!r}, which is "
                    f"not the operator ({OPERATOR_WORKER!r}): no such writer"
                ]
            if stored.kind not in OPERATOR_KINDS:
                return [f"{where}: {stored.kind} written by operator {worker!r}, not a worker"]
            return []
        problems = self._check_writer(where, worker, generation)
        if stored.kind == "worker.taken_over":
            target = (str(stored.data.get("worker")), int(stored.data.get("generation", -1)))
            if target not in self.registered_at:
                problems.append(
                    f"{where}: takes over {target[0]} generation {target[1]}, "
                    "which was never registered"
                )
            elif target == (worker, generation):
                problems.append(f"{where}: worker {worker} takes itself over")
            self.fenced_at.setdefault(target, seq)
        return problems

    def _register(self, stored: StoredEvent) -> list[str]:
        where, worker, generation = f"event {stored.seq}", stored.worker, stored.generation
        problems = []
        if (stored.data.get("worker"), stored.data.get("generation")) != (worker, generation):
            problems.append(f"{where}: worker.registered names a worker other than its writer")
        if generation <= self.top_generation:
            problems.append(
                f"{where}: generation {generation} of {worker} is not above generation "
                f"{self.top_generation} (generations strictly increase)"
            )
        self.top_generation = max(self.top_generation, generation)
        self.current[worker] = generation
        self.registered_at[(worker, generation)] = stored.seq
        return problems

    def _check_writer(self, where: str, worker: str, generation: int) -> list[str]:
        key = (worker, generation)
        if key not in self.registered_at:
            return [
                f"{where}: written by unknown worker {worker!r} (generation {generation}): "
                "no worker.registered for it"
            ]
        if key in self.fenced_at:
            return [
                f"{where}: written by fenced generation {generation} of worker {worker!r} "
                f"(taken over at event {self.fenced_at[key]})"
            ]
        if self.current[worker] != generation:
            return [
                f"{where}: written by fenced generation {generation} of worker {worker!r} "
                f"(superseded by generation {self.current[worker]})"
            ]
        return []

    def rows(self) -> dict[str, tuple[int, bool]]:
        """Each worker's current generation and whether it is fenced (the workers table)."""
        return {w: (g, (w, g) in self.fenced_at) for w, g in self.current.items()}
