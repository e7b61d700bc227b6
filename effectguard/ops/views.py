"""Commands that only read the ledger: ``calls``, ``show``, ``budgets``, ``verify``."""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from datetime import UTC, date, datetime
from pathlib import Path

from effectguard.errors import ConfigError
from effectguard.ledger import Ledger
from effectguard.ops import showcall
from effectguard.ops.archivefile import check_archive_against, verify_archive
from effectguard.ops.audit import VerifyReport
from effectguard.ops.command import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    Command,
    budget_path,
    check_ledger,
    count,
    ledger_flags,
    ledger_option,
    path_arg,
    text_arg,
)
from effectguard.ops.render import age, budget_json, call_json, emit, iso, say, table
from effectguard.ops.timeargs import since, since_argument
from effectguard.ops.verify import verify_ledger
from effectguard.ops.verifycopy import migrated_copy, pending_migrations
from effectguard.rules import periods
from effectguard.rules.events import StoredEvent
from effectguard.rules.guidance import next_shown
from effectguard.rules.workstate import STAGES, WorkState

CALL_COLUMNS = [
    "created",
    "age",
    "call_id",
    "stage",
    "effect",
    "next_operation",
    "budget",
    "provider",
    "model",
    "attempts",
    "reserved_usd",
    "cost_usd",
    "held_usd",
]
BUDGET_COLUMNS = [
    "path",
    "period",
    # Whose calendar the period label is in: "2026-12-04" is not the same day everywhere.
    "tz",
    "limit_usd",
    "reserved_usd",
    "spent_usd",
    "held_usd",
    "rpm",
    "tpm",
    "concurrency",
]


async def cmd_calls(args: argparse.Namespace, ledger: Ledger) -> int:
    """``effectguard calls``: calls, newest first (with their time and age)."""
    now = time.time()
    start = None if args.since is None else since(args.since, now)
    calls = await ledger.calls(
        stage=args.state, budget=args.budget, limit=args.limit, provider=args.provider, since=start
    )
    gone = await _gone_owners(args, ledger, calls)
    rows = [{**call_json(c), "owner_gone": gone.get(c.call_id)} for c in calls]
    if args.json:
        emit(args, rows, "")
        return EXIT_OK
    shown = [
        {
            "created": iso(c.created_at),
            "age": age(c.created_at, now),
            **row,
            "next_operation": next_shown(c.next_operation, row["owner_gone"]),
        }
        for c, row in zip(calls, rows, strict=True)
    ]
    emit(args, rows, table(shown, CALL_COLUMNS) if rows else "no calls")
    return EXIT_OK


async def _gone_owners(
    args: argparse.Namespace, ledger: Ledger, calls: list[WorkState]
) -> dict[str, str]:
    """Of ``calls`` in flight, those whose worker will not finish them: call id -> why,
    judged as a sweep would (:mod:`effectguard.callpath.liveness`). A listing with no call
    in flight reads nothing more (and imports no worker machinery): ``calls`` stays cheap."""
    if not any(c.stage == "in_flight" for c in calls):
        return {}
    from effectguard.ops.takeover import gone_owners_here

    return await gone_owners_here(ledger, str(args.ledger), calls)


async def cmd_show(args: argparse.Namespace, ledger: Ledger) -> int:
    """``effectguard show CALL_ID``: the request, attempts, money and the next command."""
    state = await ledger.call(args.call_id)
    events = await ledger.events(args.call_id)
    stored = await ledger.body_size(args.call_id)
    gone = (await _gone_owners(args, ledger, [state])).get(state.call_id)
    lag = _lookup_lag(args, state, events)
    payload = {
        **call_json(state),
        "owner_gone": gone,
        "events": [
            {
                "seq": e.seq,
                "kind": e.kind,
                "at": e.at,
                "at_iso": iso(e.at),
                "worker": e.worker,
                "data": {k: v for k, v in e.data.items() if k not in ("body",)},
            }
            for e in events
        ],
        "request": showcall.request_json(events, stored),
        "attempts_detail": showcall.attempts(events),
        "evidence": showcall.late_answers(events),
        "next_command": showcall.next_commands(
            state, events, ledger_flags(args), gone, time.time(), lag
        ),
    }
    if args.json:
        emit(args, payload, "")
    else:
        text = showcall.render(
            state,
            events,
            full=args.full,
            now=time.time(),
            stored_bytes=stored,
            where=ledger_flags(args),
            owner_gone=gone,
            lookup_s=lag,
        )
        emit(args, payload, text)
    return EXIT_OK


def _lookup_lag(
    args: argparse.Namespace, state: WorkState, events: list[StoredEvent]
) -> float | None:
    """The search lag of the lookup that could decide an effect-unknown call (None: none
    is declared here, or the call is not effect-unknown), read from the bundled
    declarations and ``--providers``, as ``reconcile --auto`` reads them. Only such a call
    loads them: ``show`` of any other stays a read of the ledger alone."""
    if state.stage != "effect_unknown":
        return None
    from effectguard.providers import load_providers, lookup_lag

    manifest = next((e.data for e in events if e.kind == "call.manifest"), {})
    providers = load_providers([Path(p) for p in args.providers or ()])
    if state.provider not in providers:
        # Else no lookup offered reads as none declared (as reconcile --auto says too).
        say(
            f"effectguard: provider {state.provider!r} is not declared here: pass "
            "--providers DIR as serve does, to see its lookup",
            err=True,
        )
    method, path = str(manifest.get("method", "POST")), str(manifest.get("endpoint", ""))
    return lookup_lag(providers, state.provider, method, path)


async def cmd_budgets(args: argparse.Namespace, ledger: Ledger) -> int:
    """``effectguard budgets``: every budget node (or a subtree's) in its current (or a
    chosen) period."""
    on, at = _when(args.at)
    policies = await ledger.policies()
    nodes = await ledger.budgets(at=at, on=on, period=args.period, under=args.under)
    rows = [budget_json(n, policies.get(n.path)) for n in nodes]
    emit(args, rows, table(rows, BUDGET_COLUMNS) if rows else "no budgets")
    return EXIT_OK


def _when(text: str | None) -> tuple[date | None, float | None]:
    """``--at``: a local date (each node's own calendar) or an ISO instant (UTC if naive)."""
    if text is None:
        return None, None
    try:  # a date alone, in any ISO form (20261204 and 2026-W49-5 too): a local date
        return date.fromisoformat(text), None
    except ValueError:
        pass  # a date and a time: an instant
    moment = datetime.fromisoformat(text)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return None, moment.timestamp()


def _period(text: str) -> str:
    """An argparse type: a period label (``YYYY-MM-DD``, ``YYYY-Www``, ``YYYY-MM``, ``total``)."""
    try:
        periods.kind_of_label(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


#: The instants whose local date every zone's calendar holds (UTC offsets stay within a
#: day): from 0001-01-02 to 9999-12-30 UTC.
_FIRST_INSTANT = datetime(1, 1, 2, tzinfo=UTC).timestamp()
_END_INSTANT = datetime(9999, 12, 31, tzinfo=UTC).timestamp()


def _instant(text: str) -> str:
    """An argparse type: ``--at`` as a date or an ISO date and time."""
    try:
        _, at = _when(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a date or time: {text!r} (use YYYY-MM-DD or YYYY-MM-DDTHH:MM[+ZONE])"
        ) from None
    # The whole second decides, as it does for a period's label (periods.label).
    if at is not None and not _FIRST_INSTANT <= math.floor(at) < _END_INSTANT:
        raise argparse.ArgumentTypeError(
            f"{text!r} is out of range: an instant from 0001-01-02 to 9999-12-30 UTC "
            "(or a date alone, to the calendar's ends)"
        )
    return text


def cmd_verify_entry(args: argparse.Namespace) -> int:
    """``effectguard verify [--archive FILE | --archived]``: the ledger, or an archive
    (a file, or a PostgreSQL ledger's archive table) on its own."""
    ledger_url: str = args.ledger
    has_ledger = "://" in ledger_url or Path(ledger_url).exists()
    if args.archive is not None and not Path(args.archive).is_file():
        raise ConfigError(f"no archive file at {args.archive}")
    # A SQLite ledger behind this release (a backup taken before an upgrade) is verified
    # through a migrated copy, not refused: migrating it would lose the rollback copy.
    pending = pending_migrations(ledger_url) if has_ledger else []
    if has_ledger and not pending:
        check_ledger(ledger_url)
    if args.archived:
        if not ledger_url.startswith(("postgresql://", "postgres://")):
            say(
                "effectguard: --archived verifies a PostgreSQL ledger's archive table; "
                "a SQLite ledger's archives are files (--archive FILE)",
                err=True,
            )
            return EXIT_USAGE
        from effectguard.ops.pgarchive import verify_archived

        return _report(args, verify_archived(ledger_url))
    if args.archive is None and not has_ledger:
        say(
            f"effectguard: no ledger at {ledger_url} (use --ledger; `effectguard serve` or "
            "`effectguard migrate` creates one)",
            err=True,
        )
        return EXIT_USAGE

    async def run() -> int:
        if not has_ledger:
            return _report(args, verify_archive(Path(args.archive)))
        if pending:
            with migrated_copy(ledger_url, pending) as copy:
                async with Ledger.open(copy) as ledger:
                    return await cmd_verify(args, ledger)
        async with Ledger.open(ledger_url) as ledger:
            return await cmd_verify(args, ledger)

    return asyncio.run(run())


async def cmd_verify(args: argparse.Namespace, ledger: Ledger) -> int:
    """``effectguard verify``: exit 1 naming the first broken event."""
    if args.archive is not None:
        report = verify_archive(Path(args.archive))
        await check_archive_against(ledger, Path(args.archive), report)
    else:
        report = await verify_ledger(ledger)
    return _report(args, report)


def _report(args: argparse.Namespace, report: VerifyReport) -> int:
    payload = {
        "ok": report.ok,
        "events": report.events,
        "calls": report.calls,
        "budgets": report.budgets,
        "first_broken_seq": report.first_broken_seq,
        "problems": report.problems,
    }
    if report.ok:
        text = f"ok: {report.events} events, {report.calls} calls, {report.budgets} budgets"
    else:
        text = "\n".join([f"BROKEN at event {report.first_broken_seq}:", *report.problems[:20]])
    emit(args, payload, text)
    return EXIT_OK if report.ok else EXIT_FAILED


def _calls_arguments(p: argparse.ArgumentParser) -> None:
    ledger_option(p)
    p.add_argument("--state", choices=STAGES, help="only calls in this stage")
    p.add_argument("--budget", type=budget_path, help="only calls under this budget path")
    p.add_argument("--provider", type=text_arg, help="only calls to this provider")
    p.add_argument(
        "--since",
        type=since_argument,
        metavar="WHEN",
        help="only calls created since WHEN: an ISO date/time (UTC unless it says) "
        "or a duration back from now (90s, 30m, 2h, 7d, 2w)",
    )
    p.add_argument("--limit", type=count, default=1000, help="at most this many (default 1000)")
    p.set_defaults(run_ledger=cmd_calls, reads_only=True)


def _show_arguments(p: argparse.ArgumentParser) -> None:
    ledger_option(p)
    p.add_argument("call_id", type=text_arg, help="the call id (Effectguard-Call-Id)")
    p.add_argument(
        "--full",
        action="store_true",
        help="print the whole request "
        f"(else its first {showcall.REQUEST_PREVIEW_CHARS} characters)",
    )
    p.add_argument(
        "--providers",
        action="append",
        type=path_arg,
        metavar="DIR",
        help="extra provider declarations (repeatable), as serve and reconcile --auto "
        "take them: an effect-unknown call whose lookup is declared there is offered it",
    )
    p.set_defaults(run_ledger=cmd_show, reads_only=True)


def _budgets_arguments(p: argparse.ArgumentParser) -> None:
    ledger_option(p)
    when = p.add_mutually_exclusive_group()
    when.add_argument(
        "--period",
        type=_period,
        metavar="LABEL",
        help="show this past or current period: YYYY-MM-DD (day), YYYY-Www (week), YYYY-MM "
        "(month) or total (the nodes whose period has labels of that form)",
    )
    when.add_argument(
        "--at",
        type=_instant,
        metavar="DATE",
        help="show each node's period containing DATE (YYYY-MM-DD, or an ISO date and time)",
    )
    p.add_argument(
        "--under",
        type=budget_path,
        metavar="PATH",
        help="only the node at PATH and the nodes below it (a path, not a pattern)",
    )
    p.set_defaults(run_ledger=cmd_budgets, reads_only=True)


def _verify_arguments(p: argparse.ArgumentParser) -> None:
    ledger_option(p)
    # One choice, as the usage line says: a file or the table, never both silently.
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--archive",
        type=path_arg,
        metavar="FILE",
        help="verify an archive file on its own (and against the ledger's checkpoint, "
        "when the ledger exists)",
    )
    which.add_argument(
        "--archived",
        action="store_true",
        help="verify a PostgreSQL ledger's archive table on its own, range by range, "
        "and against the checkpoints in its chain",
    )
    p.set_defaults(run=cmd_verify_entry)


CALLS = Command("calls", "list calls", "List calls, newest first.", _calls_arguments)
SHOW = Command(
    "show",
    "show one call",
    "Show a call: its request, every attempt and how it ended, the money, and the "
    "command to run next.",
    _show_arguments,
)
BUDGETS = Command("budgets", "list budgets", "List budget nodes.", _budgets_arguments)
VERIFY = Command(
    "verify",
    "verify the ledger",
    "Check the hash chain, counters and projections.",
    _verify_arguments,
)
