"""Commands that only read the ledger: ``calls``, ``show``, ``budgets``, ``verify``."""

from __future__ import annotations

import argparse

from effectguard.ledger import Ledger
from effectguard.ops.command import EXIT_FAILED, EXIT_OK, Command, ledger_option
from effectguard.ops.render import budget_json, call_json, emit, table
from effectguard.ops.verify import verify_ledger
from effectguard.rules.workstate import STAGES

CALL_COLUMNS = [
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
BUDGET_COLUMNS = ["path", "limit_usd", "reserved_usd", "spent_usd", "held_usd"]


async def cmd_calls(args: argparse.Namespace, ledger: Ledger) -> int:
    """``effectguard calls``: calls, newest first."""
    calls = await ledger.calls(stage=args.state, budget=args.budget, limit=args.limit)
    rows = [call_json(c) for c in calls]
    emit(args, rows, table(rows, CALL_COLUMNS) if rows else "no calls")
    return EXIT_OK


async def cmd_show(args: argparse.Namespace, ledger: Ledger) -> int:
    """``effectguard show CALL_ID``: a call's state and its events (bodies left out)."""
    state = await ledger.call(args.call_id)
    events = await ledger.events(args.call_id)
    payload = {
        **call_json(state),
        "events": [
            {
                "seq": e.seq,
                "kind": e.kind,
                "at": e.at,
                "worker": e.worker,
                "data": {k: v for k, v in e.data.items() if k not in ("body",)},
            }
            for e in events
        ],
    }
    lines = [f"{k}: {v}" for k, v in call_json(state).items()]
    lines.append("events:")
    lines += [f"  #{e.seq} {e.kind} by {e.worker}" for e in events]
    emit(args, payload, "\n".join(lines))
    return EXIT_OK


async def cmd_budgets(args: argparse.Namespace, ledger: Ledger) -> int:
    """``effectguard budgets``: every budget node."""
    rows = [budget_json(n) for n in await ledger.budgets()]
    emit(args, rows, table(rows, BUDGET_COLUMNS) if rows else "no budgets")
    return EXIT_OK


async def cmd_verify(args: argparse.Namespace, ledger: Ledger) -> int:
    """``effectguard verify``: exit 1 naming the first broken event."""
    report = await verify_ledger(ledger)
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
    p.add_argument("--budget", help="only calls under this budget path")
    p.add_argument("--limit", type=int, default=1000, help="at most this many (default 1000)")
    p.set_defaults(run_ledger=cmd_calls)


def _show_arguments(p: argparse.ArgumentParser) -> None:
    ledger_option(p)
    p.add_argument("call_id", help="the call id (Effectguard-Call-Id)")
    p.set_defaults(run_ledger=cmd_show)


def _budgets_arguments(p: argparse.ArgumentParser) -> None:
    ledger_option(p)
    p.set_defaults(run_ledger=cmd_budgets)


def _verify_arguments(p: argparse.ArgumentParser) -> None:
    ledger_option(p)
    p.set_defaults(run_ledger=cmd_verify)


CALLS = Command("calls", "list calls", "List calls, newest first.", _calls_arguments)
SHOW = Command("show", "show one call", "Show a call's events and state.", _show_arguments)
BUDGETS = Command("budgets", "list budgets", "List budget nodes.", _budgets_arguments)
VERIFY = Command(
    "verify",
    "verify the ledger",
    "Check the hash chain, counters and projections.",
    _verify_arguments,
)
