"""The fault simulator: seeded random load and faults against real processes.

``effectguard sim --seed N --duration S [--replicas K] [--ledger sqlite|postgres]
[--bundle DIR]`` generates a :class:`~effectguard.testing.sim.schedule.Schedule`
from the seed, runs it against a fake provider and K ``effectguard serve``
replicas, brings everything back and quiet, and checks the invariants of
:mod:`effectguard.testing.sim.invariants` against the provider's receipts and
the clients' answers. A failing run prints its seed and schedule and writes a
bundle (:mod:`effectguard.testing.sim.bundle`). docs/simulator.md has the rest.

This is the testing layer: it reads the ledger through :mod:`effectguard.ledger`
and runs ``effectguard verify`` as a subprocess, never importing the operator tools.
"""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``effectguard sim`` options."""
    parser.add_argument("--seed", type=int, required=True, help="the schedule's seed")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of load (default 20)")
    parser.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="serve processes (default 1 on SQLite, 3 on PostgreSQL)",
    )
    parser.add_argument(
        "--ledger",
        choices=["sqlite", "postgres"],
        default="sqlite",
        help="ledger engine (postgres: $EFFECTGUARD_TEST_PG_DSN, schema sim_<seed>_<pid>)",
    )
    parser.add_argument("--bundle", type=Path, help="where a failing run writes its bundle")
    parser.add_argument("--schedule", type=Path, help="run this schedule.json instead")
    parser.add_argument(
        "--disk-faults",
        action="store_true",
        help="SQLite on a small tmpfs that the run fills up at times (needs root)",
    )
    parser.add_argument(
        "--ledger-faults",
        action="store_true",
        help="SQLite: remount the ledger's tmpfs read-only at times; PostgreSQL: run on a "
        "cluster of the run's own and stop it at times (needs root)",
    )
    parser.add_argument(
        "--clock-steps",
        action="store_true",
        help="step wall clocks back and forward during the load, as NTP does: SQLite the "
        "host's (every process writing the ledger), PostgreSQL the database's or one "
        "replica's host's (needs libfaketime)",
    )
    _load_options(parser)
    parser.add_argument("--lease", type=float, default=2.0, help="worker lease seconds")
    parser.add_argument("--keep", type=Path, help="keep the run's working directory here")


def _load_options(parser: argparse.ArgumentParser) -> None:
    """The options that add load or operators' work to the schedule, each drawn apart."""
    parser.add_argument(
        "--answer-faults",
        action="store_true",
        help="the provider answers some calls without end (past the run's max_answer_bytes) "
        "and pads others to half of it",
    )
    parser.add_argument(
        "--lookups",
        action="store_true",
        help="add a payments tool whose lost calls a lookup decides, resent by several "
        "copies at once",
    )
    parser.add_argument(
        "--keyless",
        action="store_true",
        help="with --lookups: pay calls without a key too, whose copies are SDK retries "
        "matched by the request's hash",
    )
    parser.add_argument(
        "--operator",
        action="store_true",
        help="an operator changes limits (`budget set`), rotates the clients' proxy keys "
        "(`key revoke`, `key new`) and sets rate limits (--rpm, --tpm, --concurrency) during "
        "the load",
    )
    parser.add_argument(
        "--maintenance",
        action="store_true",
        help="an operator runs `backup` (SQLite only), `archive` and `reconcile --resend` of "
        "an unknown call (then its resends) during the load, every 1-3 s",
    )


def main(args: argparse.Namespace) -> int:
    """Run ``effectguard sim`` (the simulator's modules load only now)."""
    from effectguard.testing.sim.command import run

    return run(args)
