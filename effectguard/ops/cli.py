"""The ``effectguard`` command (contract.md §8): the parser, assembled from each command's record.

The commands live in :mod:`~effectguard.ops.views` (reading the ledger),
:mod:`~effectguard.ops.changes` (changing it) and :mod:`~effectguard.ops.servecmd`
(running in the foreground); ``bench`` comes from :mod:`effectguard_bench` when it is
installed. :func:`main` builds only the options of the command it runs, so a
command never imports what another one needs (``effectguard calls`` loads neither
the server nor the fake provider nor the benchmarks).

Exit codes: 0 success; 1 a check failed (``verify``) or nothing matched; 2 bad
usage or configuration; 3 the ledger refused (e.g. reconcile of a call that is
neither ``effect_unknown`` nor ``failed``); 4 the ledger is unavailable.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import re
import sys
from collections.abc import Callable, Collection, Coroutine, Sequence
from typing import Any

from effectguard.errors import (
    CallNotFound,
    ConfigError,
    EffectguardError,
    LedgerError,
    LedgerUnavailable,
    ReconcileError,
)
from effectguard.ledger import Ledger
from effectguard.ops import changes, keycmd, servecmd, views
from effectguard.ops.command import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    Command,
    check_ledger,
    resolve_ledger,
)
from effectguard.ops.release import VersionAction
from effectguard.ops.render import budget_json, call_json, say
from effectguard.ops.verifycopy import migrated_copy, pending_migrations

__all__ = [
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_REFUSED",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "budget_json",
    "build_parser",
    "call_json",
    "commands",
    "main",
]


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    from effectguard_bench import cli as bench

    bench.add_arguments(p)
    p.set_defaults(run=bench.run)


BENCH = Command(
    "bench",
    "measure effectguard against a bare proxy",
    "Benchmark the proxy and transport against a baseline.",
    _bench_arguments,
)


def commands() -> list[Command]:
    """Every top-level command, in ``--help`` order (``bench`` only where it is installed)."""
    found = [
        servecmd.SERVE,
        servecmd.FAKE_PROVIDER,
        servecmd.SIM,
        views.CALLS,
        views.SHOW,
        changes.RECONCILE,
        views.BUDGETS,
        changes.BUDGET,
        views.VERIFY,
        changes.BACKUP,
        changes.ARCHIVE,
        changes.MIGRATE,
        keycmd.KEY,
    ]
    # find_spec on a top-level name looks for it without importing it.
    if importlib.util.find_spec("effectguard_bench") is not None:
        found.append(BENCH)
    return found


def build_parser(only: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The argument parser (every command has help; a test checks it).

    Every command is listed; only those named in ``only`` (all when None) get their
    options, so building the parser for one command imports nothing the others need.
    """
    parser = argparse.ArgumentParser(
        prog="effectguard",
        description="A durable ledger between AI agents and the providers they pay for.",
    )
    parser.add_argument("--version", action=VersionAction)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in commands():
        p = sub.add_parser(command.name, help=command.help, description=command.description)
        if only is None or command.name in only:
            command.arguments(p)
    return parser


def _command_word(argv: Sequence[str]) -> str | None:
    # No option comes before the command, so the first word that is not an option is it.
    return next((a for a in argv if not a.startswith("-")), None)


async def _with_ledger(
    args: argparse.Namespace, job: Callable[[Ledger], Coroutine[Any, Any, int]]
) -> int:
    ledger_url: str = args.ledger
    # A command that only reads reads a SQLite ledger behind this release (the backup an
    # upgrade's step 1 took) through a migrated copy: migrating the file would lose it.
    pending = pending_migrations(ledger_url) if getattr(args, "reads_only", False) else []
    if not pending:
        check_ledger(ledger_url)
    try:
        if pending:
            with migrated_copy(ledger_url, pending, "reading") as copy:
                async with Ledger.open(copy) as ledger:
                    return await job(ledger)
        async with Ledger.open(ledger_url) as ledger:
            return await job(ledger)
    except LedgerUnavailable:
        # SQLite waits for a held write lock inside one C call, where Ctrl-C cannot reach
        # Python: asyncio's handler runs (and cancels this task) only once the wait gave
        # up. The person stopped the command; that is exit 130, not "ledger unavailable".
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise asyncio.CancelledError from None
        raise


def _say(message: object) -> None:
    # One line: a driver's message (psycopg's "Is the server running...") spans several.
    say("effectguard: " + re.sub(r"\s*\n\s*", " ", str(message).strip()), err=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``effectguard`` command."""
    argv = sys.argv[1:] if argv is None else list(argv)
    word = _command_word(argv)
    parser = build_parser(only=() if word is None else (word,))
    args = parser.parse_args(argv)
    problem = args.check(args) if hasattr(args, "check") else None
    if problem:
        getattr(args, "check_parser", parser).error(problem)
    try:
        if getattr(args, "resolve_ledger", False):
            args.ledger = resolve_ledger(args)
        if hasattr(args, "run_ledger"):
            return asyncio.run(_with_ledger(args, lambda ledger: args.run_ledger(args, ledger)))
        result: int = args.run(args)
        return result
    except ConfigError as exc:
        _say(exc)
        return EXIT_USAGE
    except (CallNotFound, ReconcileError) as exc:
        _say(exc)
        return EXIT_REFUSED
    except LedgerUnavailable as exc:
        _say(f"ledger unavailable: {exc}")
        return EXIT_UNAVAILABLE
    except (LedgerError, EffectguardError) as exc:
        _say(exc)
        return EXIT_REFUSED
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader stopped reading (`| head`, `| grep -q`): what it wanted was written.
        # Point stdout at /dev/null so the interpreter's final flush cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
