"""``effectguard sim``: run one seed (or a saved schedule), check it, report it."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from effectguard.testing.sim import faketime
from effectguard.testing.sim.bundle import write_bundle
from effectguard.testing.sim.cluster import reset_postgres_schema, running_cluster
from effectguard.testing.sim.evidence import Evidence, collect
from effectguard.testing.sim.invariants import INVARIANTS, Violation, check, overshoots
from effectguard.testing.sim.maintevidence import add_maintenance
from effectguard.testing.sim.operatorchecks import key_summary, late_keys
from effectguard.testing.sim.pgcluster import unavailable_reason
from effectguard.testing.sim.runner import execute, quiesce
from effectguard.testing.sim.schedule import OPERATOR_ACTIONS, Schedule, generate

__all__ = ["PG_DSN_ENV", "SimResult", "render_schedule", "run", "run_schedule"]

PG_DSN_ENV = "EFFECTGUARD_TEST_PG_DSN"
#: The command line's exit code for "the ledger is unavailable" (docs/contract.md, exit
#: codes): how an operator's command may fail while the ledger is full, read-only or down.
EXIT_UNAVAILABLE = 4


@dataclass
class SimResult:
    """One run's outcome."""

    schedule: Schedule
    violations: list[Violation]
    evidence: Evidence
    flags: list[str] = field(default_factory=list)
    actions: list[dict[str, object]] = field(default_factory=list)
    bundle: Path | None = None

    @property
    def ok(self) -> bool:
        """Whether every invariant held."""
        return not self.violations

    def summary(self) -> str:
        """A few lines: what ran, what was injected, what was found."""
        s = self.schedule
        stages = Counter(str(c.stage) for c in self.evidence.calls)
        statuses = Counter(str(a.status or "error") for a in self.evidence.answers)
        done = Counter(str(a["action"]) for a in self.actions)
        lines = [
            f"seed {s.seed}: {s.duration:g} s, {s.ledger}, {s.replicas} replica(s), "
            f"{len(s.calls)} calls, {len(self.evidence.answers)} requests, "
            f"{len(self.evidence.receipts)} receipts, {len(self.evidence.events)} events",
            "  faults scheduled: " + _counts(Counter(f.kind for f in s.faults)),
            "  process actions: " + _counts(done),
            "  client statuses: " + _counts(statuses),
            "  call stages: " + _counts(stages),
            *(["  keys: " + key_summary(self.evidence)] if self.evidence.key_actions else []),
            *self._maintenance_line(),
            *self._clock_line(),
            f"  invariants checked: {len(INVARIANTS)}; overshoots and late keys flagged: "
            f"{len(self.flags)}",
            f"  result: {'ok' if self.ok else f'{len(self.violations)} VIOLATION(S)'}",
        ]
        return "\n".join(lines)

    def _clock_line(self) -> list[str]:
        """``--clock-steps``: each step made, in order (``db``/``host``: the ledger's clock)."""
        steps = [a for a in self.actions if a["action"] == "clock_step"]
        if not steps:
            return []
        shown = [
            f"{a['target']}{'' if a['replica'] is None else a['replica']} {a['step']:+.1f}"
            for a in steps
        ]
        return [f"  clock steps (s): {', '.join(shown)}"]

    def _maintenance_line(self) -> list[str]:
        """``--maintenance``: what the copies, the archives and the authorizations came to."""
        e = self.evidence
        if not (e.backup_checks or e.archive_checks or e.archived_calls):
            return []
        authorized = sum(1 for x in e.events if x.kind == "call.resend_authorized")
        archived = sum(1 for x in e.events if x.call_id in e.archived_calls)
        # On PostgreSQL an archive moves events into the ledger's archive tables, all
        # verified by one `verify --archived`; on SQLite each archive is a file of its own.
        if self.schedule.ledger == "sqlite":
            archives = f"{len(e.archive_checks)} archive files checked"
        else:
            archives = "archive tables " + ("checked" if e.archive_checks else "not checked")
        return [
            f"  maintenance: {len(e.backup_checks)} backups checked, "
            f"{archives} ({len(e.archived_calls)} calls, "
            f"{archived} of their events), {authorized} resends authorized"
        ]


def _counts(counter: Counter[str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counter.items())) or "none"


def run_schedule(
    schedule: Schedule,
    workdir: Path,
    *,
    pg_dsn: str | None = None,
    disk: bool = False,
    ledger_faults: bool = False,
    bundle: Path | None = None,
) -> SimResult:
    """Run ``schedule`` in ``workdir`` and check it; write a bundle there if it fails."""
    env = dict(os.environ)
    env.pop("EFFECTGUARD_CRASH_AT", None)
    with running_cluster(
        schedule, workdir, pg_dsn=pg_dsn, env=env, disk=disk, ledger_faults=ledger_faults
    ) as cluster:
        answers = asyncio.run(execute(cluster))
        answers += asyncio.run(quiesce(cluster, answers))
        # Collected before the cluster goes: an owned PostgreSQL cluster is dropped with it.
        unrecovered = [int(a["replica"]) for a in cluster.actions if a["action"] == "unrecovered"]
        receipts = workdir / "receipts.jsonl"
        failed = _operator_failures(cluster.actions)
        keys = [a for a in cluster.actions if a["action"] in ("key_new", "key_revoke")]
        evidence = asyncio.run(
            collect(cluster.ledger, receipts, answers, unrecovered, failed, keys)
        )
        evidence = add_maintenance(evidence, cluster)
        evidence.clock_steps = [a for a in cluster.actions if a["action"] == "clock_step"]
    violations = check(evidence)
    flags = overshoots(evidence) + late_keys(evidence)
    result = SimResult(schedule, violations, evidence, flags, cluster.actions)
    if violations and bundle is not None:
        result.bundle = write_bundle(bundle, workdir, cluster, evidence, violations)
    if not violations and schedule.ledger == "postgres" and cluster.owned_pg is None:
        reset_postgres_schema(cluster.ledger)  # a passing run leaves no schema behind
    return result


def _operator_failures(actions: list[dict[str, object]]) -> list[str]:
    """The operator's commands that exited other than 0 or 4 (the ledger unavailable)."""
    failed = {f"{action}_failed" for action in OPERATOR_ACTIONS}
    return [
        f"{a['action']} at {a['at']} s ({a.get('name') or a.get('path') or ''}"
        f"{'=' if a.get('path') else ''}{a.get('limit') or ''}) "
        f"exit {a.get('code')}: {a.get('error')}"
        for a in actions
        if a["action"] in failed and a.get("code") != EXIT_UNAVAILABLE
    ]


def render_schedule(schedule: Schedule) -> str:
    """The schedule, one line per fault and per call (the bundle holds the JSON)."""
    lines = [f"limits (nanos): {schedule.limits}"]
    for f in schedule.faults:
        extra = f.point or (f"{f.seconds:g} s" if f.seconds else "")
        lines.append(f"  fault @{f.at:7.3f} {f.kind:10} replica {f.replica} {extra}".rstrip())
    for c in schedule.calls:
        lines.append(
            f"  call  @{c.at:7.3f} {c.id} {c.route}{' stream' if c.stream else ''} "
            f"key={c.key or '-'} budget={c.budget} retries={c.sdk_retries} "
            f"repeat={c.repeat} via {list(c.replicas)} behaviour={c.behaviour or 'plain'}"
            + (f" resends={c.resends} {c.resend_behaviour or ''}".rstrip() if c.resends else "")
        )
    return "\n".join(lines)


def _ledger_faults_refused(schedule: Schedule) -> str | None:
    """Why this machine cannot inject the ledger faults (None: it can)."""
    if schedule.ledger == "postgres":
        return unavailable_reason()
    if os.geteuid() != 0:
        return "remounting the ledger's tmpfs read-only needs root"
    return None


def _schedule_of(args: argparse.Namespace) -> Schedule:
    """The saved schedule ``--schedule`` names, or the one the seed and options draw."""
    if args.schedule is not None:
        return Schedule.from_json(args.schedule.read_text())
    return generate(
        args.seed,
        args.duration,
        replicas=args.replicas or (3 if args.ledger == "postgres" else 1),
        ledger=args.ledger,
        lease_s=args.lease,
        disk_faults=args.disk_faults,
        ledger_faults=args.ledger_faults,
        answer_faults=args.answer_faults,
        lookups=args.lookups,
        keyless=args.keyless,
        operator=args.operator,
        maintenance=args.maintenance,
        clock_steps=args.clock_steps,
    )


def run(args: argparse.Namespace) -> int:
    """Run one seed; 0 when every invariant held, 1 when one broke (bundle written)."""
    if args.keyless and not args.lookups:
        print("effectguard sim: --keyless goes with --lookups", file=sys.stderr)
        return 2
    schedule = _schedule_of(args)
    reason = _ledger_faults_refused(schedule) if args.ledger_faults else None
    if reason is not None:
        print(f"effectguard sim: --ledger-faults: {reason}", file=sys.stderr)
        return 2
    stepped = any(f.kind == "clock_step" for f in schedule.faults)
    if stepped and (reason := faketime.unavailable_reason()) is not None:
        print(f"effectguard sim: --clock-steps {reason}", file=sys.stderr)
        return 2
    if schedule.ledger == "postgres" and not os.environ.get(PG_DSN_ENV):
        # Checked before anything starts: a traceback from deep in the run said less.
        print(f"effectguard sim: --ledger postgres needs {PG_DSN_ENV} (a DSN)", file=sys.stderr)
        return 2
    bundle = args.bundle or Path(f"sim-bundle-{schedule.seed}")
    if args.keep is not None and args.keep.exists() and any(args.keep.iterdir()):
        print(f"effectguard sim: --keep {args.keep} is not empty", file=sys.stderr)
        return 2
    workdir = args.keep or Path(tempfile.mkdtemp(prefix=f"effectguard-sim-{schedule.seed}-"))
    try:
        result = run_schedule(
            schedule,
            workdir,
            pg_dsn=os.environ.get(PG_DSN_ENV),
            disk=args.disk_faults,
            ledger_faults=args.ledger_faults,
            bundle=bundle,
        )
    finally:
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print(result.summary())
    for flag in result.flags:
        print(f"  flagged: {flag}")
    if result.ok:
        return 0
    print(f"FAILED seed {schedule.seed}; schedule:\n{render_schedule(schedule)}")
    for violation in result.violations:
        print(f"VIOLATION {violation}")
    print(
        f"bundle: {result.bundle}  (replay: effectguard sim --seed {schedule.seed} "
        f"--schedule {result.bundle}/schedule.json)"
    )
    return 1
