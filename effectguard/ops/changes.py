"""Commands that change the ledger: ``reconcile``, ``budget set``, ``migrate``, ``backup``
(proxy keys: :mod:`effectguard.ops.keycmd`)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import getpass
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from effectguard.config.precedence import overspent
from effectguard.ledger import Ledger, shown_ledger
from effectguard.ledger.versions import migrated
from effectguard.ops.command import (
    EXIT_OK,
    EXIT_USAGE,
    Command,
    applied_versions,
    budget_path,
    call_usd,
    check_ledger_place,
    count,
    ledger_option,
    migrate_ledger,
    path_arg,
    provider_options,
    set_check,
    text_arg,
    upstream_flag,
    upstreams,
    usd,
)
from effectguard.ops.render import budget_json, call_json, emit, money, say
from effectguard.rules import notes
from effectguard.rules.budget import BudgetPolicy, validate_policy
from effectguard.rules.money import nanos_to_usd
from effectguard.rules.periods import PERIOD_KINDS, TOTAL, shared_labels, validate_zone

if TYPE_CHECKING:
    from effectguard.callpath.crash import CrashPoints

#: What ``--rpm``, ``--tpm`` and ``--concurrency`` take to remove a rate limit.
NONE = -1


def count_or_none(value: str) -> int:
    """An argparse type: a :func:`~effectguard.ops.command.count`, or ``none`` (as
    :data:`NONE`)."""
    return NONE if value.strip().lower() == "none" else count(value)


def attempt_number(value: str) -> int:
    """An argparse type: an attempt's number, a :func:`~effectguard.ops.command.count` from 1."""
    number = count(value)
    if number < 1:
        raise argparse.ArgumentTypeError("attempts are numbered from 1")
    return number


def zone_name(value: str) -> str:
    """An argparse type: an IANA timezone (:func:`~effectguard.rules.periods.validate_zone`)."""
    try:
        return validate_zone(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def one_line(what: str) -> Callable[[str], str]:
    """An argparse type: one line of printable text that is not blank, named ``what``."""

    def check(value: str) -> str:
        if not value.strip():
            raise argparse.ArgumentTypeError(f"{what} cannot be blank")
        if (bad := notes.unprintable(value)) is not None:
            raise argparse.ArgumentTypeError(
                f"{what} is one line of printable text; it holds {bad!r}"
            )
        return value

    return check


def _usage(message: str) -> int:
    say(f"effectguard: {message}", err=True)
    return EXIT_USAGE


async def cmd_reconcile(args: argparse.Namespace, ledger: Ledger) -> int:
    """``effectguard reconcile``: decide one effect-unknown call, or ``--auto`` all that can be."""
    from effectguard.callpath.crash import from_environment

    # Read before any decision: a misspelt point must stop the command with nothing
    # written (contract §11.1), not answer exit 2 for a decision it has just committed.
    crash = from_environment()
    if args.auto:
        decided = (args.applied, args.not_applied, args.resend, args.accept_evidence)
        # A person's words (--attempt, --by) would be dropped: each decision is about the
        # attempt its lookup asked after, and is recorded by lookup:<provider>.
        personal = (args.cost, args.note, args.attempt, args.by)
        if args.call_id or any(decided) or any(v is not None for v in personal):
            return _usage(
                "reconcile --auto takes no CALL_ID, --note, --attempt, --by or decision "
                "flags: it decides each unknown call by its provider's lookup"
            )
        return await _reconcile_auto(args, ledger, crash)
    args.by = args.by or _login_name()
    if args.by is None:
        return _usage("your login name is no name --by would take; give --by NAME")
    if args.resend:
        return await _reconcile_resend(args, ledger)
    if args.accept_evidence:
        return await _reconcile_by_evidence(args, ledger, crash)
    if not args.call_id or args.applied == args.not_applied:
        return _usage(
            "reconcile needs CALL_ID and exactly one of --applied / --not-applied (or --auto)"
        )
    if not args.note:
        return _usage("reconcile needs --note TEXT saying how you know")
    if args.cost is not None and not args.applied:
        return _usage("--cost goes with --applied")
    await _take_over_gone(args, ledger)
    state = await ledger.reconcile(
        args.call_id,
        applied=args.applied,
        cost=args.cost,
        note=args.note,
        by=args.by,
        attempt=args.attempt,
    )
    crash.hit("after:reconcile")
    emit(args, call_json(state), f"{state.call_id}: {state.stage}")
    return EXIT_OK


def _login_name() -> str | None:
    """The default of ``--by``: the login name, if ``--by`` would take it (None if not: it
    comes from $LOGNAME or $USER, and may hold anything, a byte no ledger can hold too)."""
    try:
        return one_line("a name")(getpass.getuser())
    except (argparse.ArgumentTypeError, OSError):
        return None


async def _take_over_gone(args: argparse.Namespace, ledger: Ledger) -> None:
    """Calls in flight whose worker is gone become effect_unknown first, as the next start
    of ``serve`` would make them: after a crash, the call to decide is still in flight.
    The call named is refused (exit 3) when its owner may still be running."""
    from effectguard.ops.takeover import refuse_deciding_at_once, say_taken_over, take_over_gone

    marked = await take_over_gone(ledger, str(args.ledger))
    say_taken_over(marked)
    if args.call_id:
        refuse_deciding_at_once(marked, args.call_id)


async def _reconcile_resend(args: argparse.Namespace, ledger: Ledger) -> int:
    if args.accept_evidence or args.applied or args.not_applied or args.cost is not None:
        return _usage(
            "reconcile --resend goes with no --applied/--not-applied/--cost/--accept-evidence"
        )
    if not args.call_id:
        return _usage("reconcile --resend needs CALL_ID")
    if not args.note:
        return _usage("reconcile --resend needs --note TEXT saying why the risk is accepted")
    await _take_over_gone(args, ledger)
    state = await ledger.authorize_resend(
        args.call_id, note=args.note, by=args.by, attempt=args.attempt
    )
    emit(args, call_json(state), f"{state.call_id}: one resend authorized (held until it settles)")
    return EXIT_OK


async def _reconcile_by_evidence(
    args: argparse.Namespace, ledger: Ledger, crash: CrashPoints
) -> int:
    if not args.call_id or args.applied or args.not_applied or args.cost is not None:
        return _usage(
            "reconcile --accept-evidence needs CALL_ID, and no --applied/--not-applied/--cost "
            "(the late answer decides them)"
        )
    await _take_over_gone(args, ledger)
    state = await ledger.accept_evidence(
        args.call_id, note=args.note, by=args.by, attempt=args.attempt
    )
    crash.hit("after:reconcile")
    emit(args, call_json(state), f"{state.call_id}: {state.stage} (on its late answer)")
    return EXIT_OK


async def _reconcile_auto(args: argparse.Namespace, ledger: Ledger, crash: CrashPoints) -> int:
    from effectguard.ops.reconcile import reconcile_auto, undeclared_providers
    from effectguard.providers import load_providers

    dirs = [Path(p) for p in args.providers or ()]
    providers = load_providers(dirs, upstreams(args), name_upstream=upstream_flag)
    await _take_over_gone(args, ledger)
    results = await reconcile_auto(ledger, providers, crash=crash)
    for name, passed in sorted((await undeclared_providers(ledger, providers)).items()):
        # Else "no effect-unknown calls with a lookup path" reads as nothing to look up.
        say(
            f"effectguard: {passed} effect-unknown call(s) of provider {name!r} not looked up: "
            "no declaration of it is loaded here; give `reconcile --auto` the --providers "
            "DIR (and --upstream NAME=URL) that `serve` runs with",
            err=True,
        )
    # The note says what the lookup answered and why it decides, or why it does not.
    text = "\n".join(f"{r['call_id']}: {r['result']} ({r['note']})" for r in results)
    emit(args, results, text or "no effect-unknown calls with a lookup path")
    return EXIT_OK


async def cmd_budget_set(args: argparse.Namespace, ledger: Ledger) -> int:
    """``effectguard budget set PATH``: set a node's limit, period and rate limits.

    What is not given keeps its current value. A limit below what the node has already
    spent in its current period is set all the same, with a warning on stderr.
    """
    path: str = args.path
    changes = _policy_changes(args)
    try:
        validate_policy(dataclasses.replace(BudgetPolicy(path), **changes))
    except ValueError as exc:
        return _usage(str(exc))
    before = (await ledger.policies()).get(path)
    # Only the fields given are written, onto the policy as the write's own transaction
    # reads it: another operator's change to another field, made since, is kept.
    policy = await ledger.change_policy(path, changes)
    # The node alone: its subtree down to its own depth.
    (node,) = await ledger.budgets(under=path, depth=path.count("/") + 1)
    warnings = [overspent(node), *await _zone_moved(ledger, before, policy)]
    for warning in warnings:
        if warning is not None:
            say(f"effectguard: warning: {warning}", err=True)
    payload = budget_json(node, policy)
    emit(args, payload, _policy_line(path, money(node.limit), policy))
    return EXIT_OK


async def _zone_moved(
    ledger: Ledger, before: BudgetPolicy | None, after: BudgetPolicy
) -> list[str]:
    """The warnings for a node moved to another zone: each period of the new zone, not
    yet over, that already holds what the old zone charged under its label."""
    if before is None or before.period != after.period:
        return []
    now = await ledger.store.clock_now()
    out = []
    for label in shared_labels(after.period, before.tz, after.tz, now):
        depth = after.path.count("/") + 1
        for node in await ledger.budgets(period=label, under=after.path, depth=depth):
            if node.path == after.path and node.committed:
                out.append(
                    f"budget {after.path!r} moves from {before.tz} to {after.tz}: counters "
                    f"are kept per period label, so its {label} in {after.tz} counts the "
                    f"{nanos_to_usd(node.committed)} USD (spent, reserved and held) charged "
                    f"to {label} in {before.tz}, whose {label} runs at other hours"
                )
    return out


def _policy_line(path: str, limit: str | None, policy: BudgetPolicy) -> str:
    """``team: limit 5.000000000 USD per month (UTC); rpm 60``, or ``team: no limit
    (period month, UTC)`` (rate limits only where set, so a ``--rpm`` alone is not
    confirmed as if nothing had changed)."""
    names = ("rpm", "tpm", "concurrency")
    rates = [f"{n} {v}" for n in names if (v := getattr(policy, n)) is not None]
    # A day, week or month is one of a zone's calendar: the line names the zone, so an
    # operator who forgot --tz (UTC) sees it. A total period has no calendar.
    zone = "" if policy.period == TOTAL else f", {policy.tz}"
    if limit is None:
        shown = f"{path}: no limit (period {policy.period}{zone})"
    else:
        # A total period never resets: "per total" would read as a period that does.
        per = "in total" if policy.period == TOTAL else f"per {policy.period} ({policy.tz})"
        shown = f"{path}: limit {limit} USD {per}"
    return "; ".join([shown, ", ".join(rates)]) if rates else shown


def _policy_changes(args: argparse.Namespace) -> dict[str, Any]:
    changes: dict[str, Any] = {}
    if args.limit is not None or args.no_limit:
        changes["limit"] = None if args.no_limit else args.limit
    for name in ("period", "tz", "rpm", "tpm", "concurrency"):
        value = getattr(args, name)
        if value is not None:
            changes[name] = None if value == NONE else value
    return changes


def check_budget_set(args: argparse.Namespace) -> str | None:
    """The usage problem of a ``budget set`` invocation, if any."""
    if args.limit is not None and args.no_limit:
        return "budget set takes one of --limit USD / --no-limit, not both"
    if not _policy_changes(args):
        return (
            "budget set needs --limit USD or --no-limit, or one of --period, --tz, --rpm, "
            "--tpm, --concurrency"
        )
    return None


def cmd_migrate(args: argparse.Namespace) -> int:
    """``effectguard migrate``: create or upgrade the ledger's tables."""
    check_ledger_place(args.ledger)  # a directory or a foreign file: exit 2, not a migration

    # What this process applied: another starting at the same moment (a replica, a second
    # migrate) may apply them first. Read before and after, both said "created".
    applied = migrate_ledger(args.ledger)

    async def job() -> None:
        async with Ledger.open(args.ledger):
            pass  # the store opens as serve's does (nothing left to apply)

    asyncio.run(job())
    after = applied_versions(args.ledger)
    before = [version for version in after if version not in applied]
    say(f"ledger {shown_ledger(args.ledger)}: {migrated(before, after)}")
    return EXIT_OK


def _reconcile_arguments(p: argparse.ArgumentParser) -> None:
    ledger_option(p)
    p.add_argument("call_id", nargs="?", type=text_arg, help="the call id")
    p.add_argument("--applied", action="store_true", help="the effect happened")
    p.add_argument("--not-applied", action="store_true", help="the effect did not happen")
    p.add_argument("--cost", type=call_usd, help="actual cost in USD (with --applied)")
    p.add_argument("--note", type=one_line("a note"), help="how you know (required)")
    p.add_argument(
        "--attempt",
        type=attempt_number,
        help="decide (or authorize a resend) only if the call's last attempt is still N "
        "(as show printed it)",
    )
    p.add_argument(
        "--by",
        type=one_line("a name"),
        help="who decides (default: login name)",
    )
    p.add_argument("--auto", action="store_true", help="ask providers' declared lookup paths")
    p.add_argument(
        "--resend",
        action="store_true",
        help="authorize one new attempt of an effect_unknown call, accepting a duplicate",
    )
    p.add_argument(
        "--accept-evidence",
        action="store_true",
        help="decide an effect_unknown call as its recorded late answer proves (see show)",
    )
    provider_options(p, long_help=False)
    p.set_defaults(run_ledger=cmd_reconcile)


def _budget_arguments(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="budget_command", required=True, metavar="ACTION")
    q = actions.add_parser("set", help="set a budget's limit", description="Set a budget's limit.")
    ledger_option(q)
    q.add_argument("path", type=budget_path, help="budget path, e.g. team-a/run-42")
    q.add_argument("--limit", type=usd, help="limit in USD")
    q.add_argument("--no-limit", action="store_true", help="remove the limit")
    q.add_argument(
        "--period",
        choices=PERIOD_KINDS,
        help="the limit resets each calendar day, week or month (total: never; the default)",
    )
    q.add_argument(
        "--tz", type=zone_name, help="IANA timezone of the period's calendar (default UTC)"
    )
    for name, what in (
        ("rpm", "requests per minute"),
        ("tpm", "tokens per minute (admission estimate, corrected at settlement)"),
        ("concurrency", "calls in flight"),
    ):
        q.add_argument(f"--{name}", type=count_or_none, metavar="N", help=f"{what}; 'none' removes")
    q.set_defaults(run_ledger=cmd_budget_set)
    set_check(q, check_budget_set)


def _migrate_arguments(p: argparse.ArgumentParser) -> None:
    ledger_option(p, json_flag=False)
    p.set_defaults(run=cmd_migrate)


RECONCILE = Command(
    "reconcile",
    "decide an effect-unknown or failed call",
    "Record whether an effect-unknown call took effect, or correct a failed call (an error "
    "answer booked as applied): --applied [--cost USD] sets what it cost, --not-applied "
    "gives its charge back and frees its Idempotency-Key.",
    _reconcile_arguments,
)
BUDGET = Command("budget", "change a budget", "Change a budget node.", _budget_arguments)
MIGRATE = Command(
    "migrate",
    "create or upgrade the ledger's tables",
    "Create or upgrade the ledger's tables (run once per "
    "deployment before starting replicas; serve also does it).",
    _migrate_arguments,
)


def _backup(args: argparse.Namespace) -> int:
    from effectguard.ops.backup import cmd_backup

    return cmd_backup(args)


def _backup_arguments(p: argparse.ArgumentParser) -> None:
    ledger_option(p)
    p.add_argument("path", type=path_arg, help="where to write the copy (must not exist)")
    p.set_defaults(run=_backup)


def _archive(args: argparse.Namespace) -> int:
    from effectguard.ops.archivecmd import cmd_archive

    return cmd_archive(args)


def _archive_arguments(p: argparse.ArgumentParser) -> None:
    ledger_option(p)
    p.add_argument(
        "--before",
        metavar="DATE",
        help="archive final calls resolved before this ISO date/time or duration ago "
        "(30d); default: [retention] keep_bodies_days from --config",
    )
    p.add_argument(
        "--out",
        type=path_arg,
        metavar="FILE",
        help="the archive file of a SQLite ledger (default: next to the ledger); further "
        "steps' files go beside it, their range before the extension",
    )
    from effectguard.ops.archivecmd import step_events_arg
    from effectguard.rules.retention import STEP_EVENTS

    p.add_argument(
        "--step-events",
        type=step_events_arg,
        default=STEP_EVENTS,
        metavar="N",
        help="archive in steps of at most N events, each its own transaction, "
        f"checkpoint and file (default {STEP_EVENTS})",
    )
    p.set_defaults(run=_archive)


ARCHIVE = Command(
    "archive",
    "move final calls' events to an archive file or table",
    "Move the events of final calls resolved before DATE out of the live ledger: a SQLite "
    "ledger's into a gzip'd archive file, a PostgreSQL ledger's into its archived_events "
    "table; either leaves a ledger.archived checkpoint that verify follows.",
    _archive_arguments,
)


BACKUP = Command(
    "backup",
    "copy a SQLite ledger while it serves",
    "Take a consistent online copy of a SQLite ledger (SQLite backup API).",
    _backup_arguments,
)
