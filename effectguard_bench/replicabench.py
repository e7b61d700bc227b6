"""PostgreSQL replicas × callers: admit+settle pairs per second of a fleet on one ledger.

For each replica count R and caller count C, R processes each open the ledger (their
own writer, reader and batch lock turns, as ``effectguard serve`` replicas do),
register a worker and run C callers of the ledger benchmark's loop
(:func:`effectguard_bench.ledgerbench.measure_pairs`), all on budgets under one shared
root, starting at the same instant. The fleet's pairs per second is the sum of the
replicas'. Replicas are not pinned: they share the machine's CPUs with the database.

A replica process is ``python -m effectguard_bench.replicabench DSN CALLERS DURATION
START``: it prints its :class:`~effectguard_bench.ledgerbench.LedgerSample` as JSON.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from effectguard_bench.ledgerbench import LedgerSample, measure_pairs
from effectguard_bench.processes import child_env, python_module

#: Seconds for every replica process to start and register before the common start.
_START_AFTER = 2.0
_PER_REPLICA = 0.5


@dataclass(frozen=True, slots=True)
class FleetSample:
    """What ``replicas`` processes with ``callers`` callers each did together."""

    replicas: int
    callers: int
    samples: tuple[LedgerSample, ...]

    def to_json(self) -> dict[str, Any]:
        """The fleet's figures as a JSON-ready dict."""
        commits = sum(s.commits or 0 for s in self.samples)
        ops = sum(s.operations or 0 for s in self.samples)
        return {
            "replicas": self.replicas,
            "callers_per_replica": self.callers,
            "callers": self.replicas * self.callers,
            "pairs_per_second": round(sum(s.pairs_per_second for s in self.samples), 1),
            "pair_p50_ms": round(max(s.p50_ms for s in self.samples), 3),
            "pair_p99_ms": round(max(s.p99_ms for s in self.samples), 3),
            "operations_per_commit": round(ops / commits, 2) if commits else None,
        }


def run(dsn: str, replicas: Sequence[int], callers: Sequence[int], duration: float) -> list[Any]:
    """Every (replicas, callers) point on the ledger at ``dsn``, as JSON-ready dicts."""
    return [fleet(dsn, r, c, duration).to_json() for r in replicas for c in callers]


def fleet(dsn: str, replicas: int, callers: int, duration: float) -> FleetSample:
    """Run ``replicas`` replica processes of ``callers`` callers each, from one instant."""
    start = time.time() + _START_AFTER + _PER_REPLICA * replicas
    args = [dsn, str(callers), str(duration), str(start)]
    processes = [
        subprocess.Popen(
            python_module(__name__, *args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=child_env(),
        )
        for _ in range(replicas)
    ]
    samples = []
    for process in processes:
        out, err = process.communicate(timeout=duration + 120)
        if process.returncode != 0:
            raise RuntimeError(f"a ledger replica failed: {err.decode(errors='replace')[-2000:]}")
        samples.append(LedgerSample(**json.loads(out)))
    return FleetSample(replicas, callers, tuple(samples))


async def _replica(dsn: str, callers: int, duration: float, start: float) -> LedgerSample:
    async def at_start() -> None:
        await asyncio.sleep(max(0.0, start - time.time()))

    return await measure_pairs(dsn, "postgresql", callers, duration, at_start)


def main(argv: list[str]) -> int:
    """One replica: measure, print the sample as JSON."""
    dsn, callers, duration, start = argv
    sample = asyncio.run(_replica(dsn, int(callers), float(duration), float(start)))
    print(json.dumps(dataclasses.asdict(sample)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
