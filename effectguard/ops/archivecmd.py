"""``effectguard archive [--before DATE] [--ledger L] [--out FILE] [--step-events N] [--json]``:
the command's edge (arguments, output), over :mod:`.archive` (SQLite) and
:mod:`.pgarchive` (PostgreSQL)."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from effectguard.callpath.crash import from_environment
from effectguard.errors import ConfigError
from effectguard.ops.render import say
from effectguard.rules.counts import parse_count
from effectguard.rules.guidance import show_command
from effectguard.rules.retention import remedy

if TYPE_CHECKING:
    from effectguard.ops.archiveplan import ArchiveResult, Step

#: The largest ``--step-events``: past it one step is one unbounded transaction again.
MOST_STEP_EVENTS = 10_000_000


def step_events_arg(value: str) -> int:
    """An argparse type: the events one archive step takes at most (1 or more)."""
    count = parse_count(value, MOST_STEP_EVENTS)
    if count is None or not 1 <= count <= MOST_STEP_EVENTS:
        raise argparse.ArgumentTypeError(
            f"--step-events is a number from 1 to {MOST_STEP_EVENTS}, not {value!r}"
        )
    return count


def cmd_archive(args: argparse.Namespace) -> int:
    """Archive in steps; without ``--json``, one line per step as it commits."""
    ledger: str = args.ledger
    if ledger.startswith("memory://"):
        raise ConfigError("a memory ledger has nothing to archive")
    crash = from_environment()  # an unknown point stops here, before anything is written
    before = _before(args)
    say = None if args.json else _say
    if ledger.startswith(("postgresql://", "postgres://")):
        if args.out:
            raise ConfigError("a PostgreSQL ledger archives into its archived_events table")
        from effectguard.ops.pgarchive import archive_postgres

        result = archive_postgres(
            ledger, before=before, size=args.step_events, say=say, crash=crash
        )
    else:
        from effectguard.ops.archive import archive_sqlite

        out = None if args.out is None else Path(args.out)
        result = archive_sqlite(
            ledger, before=before, out=out, size=args.step_events, say=say, crash=crash
        )
    if args.json:
        print(json.dumps(asdict(result), indent=2))
    else:
        _summary(result)
    return 0


def _say(step: Step) -> None:
    say(
        f"archive {step.path}: events {step.first_seq}..{step.last_seq} "
        f"({step.events} events, {step.calls} calls, {step.keys} keys kept); "
        f"checkpoint event {step.checkpoint_seq}",
        flush=True,
    )


def _summary(result: ArchiveResult) -> None:
    if result.events == 0:
        say("archive: nothing to archive yet (see the retention rules)")
    elif result.steps > 1:
        say(
            f"archive: {result.steps} steps, events {result.first_seq}..{result.last_seq} "
            f"({result.events} events, {result.calls} calls, {result.keys} keys kept)"
        )
    if result.held_by is not None:
        # The archive is a prefix of the chain: this call holds back every call after it.
        say(
            f"archive: the cut stops at call {result.held_by} ({result.held_because}); "
            f"{remedy(result.held_because or '')} (`{show_command(result.held_by)}`)"
        )


def _before(args: argparse.Namespace) -> float:
    from effectguard.config.settings import config_retention
    from effectguard.ops.timeargs import since

    now = time.time()
    if args.before is not None:
        try:
            return since(args.before, now)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
    cutoff = config_retention(Path(args.config) if args.config else None).cutoff(now)
    if cutoff is None:
        raise ConfigError("give --before DATE, or [retention] keep_bodies_days in --config")
    return cutoff
