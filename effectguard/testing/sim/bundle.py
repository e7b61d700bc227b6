"""A failing run's bundle: everything needed to look at it, and to run it again.

``DIR/schedule.json`` (feed it back with ``effectguard sim --schedule``),
``actions.json`` (what was done to which process, and when), ``answers.jsonl``
(every client request's answer), ``receipts.jsonl`` (the provider's),
``events.jsonl`` (the ledger's whole log), ``violations.txt``, ``logs/`` (every
process's output) and, for SQLite, the ledger files themselves.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from effectguard.testing.sim.cluster import Cluster
from effectguard.testing.sim.evidence import Evidence
from effectguard.testing.sim.invariants import Violation

__all__ = ["write_bundle"]


def write_bundle(
    target: Path, workdir: Path, cluster: Cluster, evidence: Evidence, violations: list[Violation]
) -> Path:
    """Write the bundle of a run into ``target`` (created); returns ``target``."""
    target.mkdir(parents=True, exist_ok=True)
    (target / "schedule.json").write_text(cluster.schedule.to_json())
    (target / "actions.json").write_text(json.dumps(cluster.actions, indent=1))
    with (target / "answers.jsonl").open("w") as out:
        for answer in evidence.answers:
            out.write(json.dumps(dataclasses.asdict(answer)) + "\n")
    with (target / "events.jsonl").open("w") as out:
        for event in evidence.events:
            out.write(json.dumps(dataclasses.asdict(event)) + "\n")
    (target / "violations.txt").write_text("".join(f"{v}\n" for v in violations))
    (target / "verify.txt").write_text(evidence.verify_output)
    for name in ("receipts.jsonl", "effectguard.toml"):
        if (workdir / name).exists():
            shutil.copy2(workdir / name, target / name)
    for name in ("logs", "ledger", "backups"):
        if (workdir / name).is_dir():
            shutil.copytree(workdir / name, target / name, dirs_exist_ok=True)
    return target
