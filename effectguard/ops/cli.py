"""The ``effectguard`` command (SPEC §8).

Exit codes: 0 success; 1 a check failed (``verify``) or nothing matched; 2 bad
usage or configuration; 3 the ledger refused (e.g. reconcile of a call that is
not ``effect_unknown``); 4 the ledger is unavailable.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import os
import secrets
import sys
from collections.abc import Callable, Coroutine, Sequence
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from effectguard.config import defaults
from effectguard.errors import (
    CallNotFound,
    ConfigError,
    EffectguardError,
    LedgerError,
    LedgerUnavailable,
    ReconcileError,
)
from effectguard.ledger import Ledger
from effectguard.ops.verify import verify_ledger
from effectguard.rules.budget import BudgetNode
from effectguard.rules.money import check_amount, nanos_to_usd, usd_to_nanos
from effectguard.rules.workstate import STAGES, WorkState

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_REFUSED, EXIT_UNAVAILABLE = 0, 1, 2, 3, 4


def _default_ledger() -> str:
    return defaults.ledger_from(os.environ)


def _usd(value: str) -> int:
    try:
        amount = Decimal(value)
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"not a USD amount: {value!r}") from None
    if amount < 0:
        raise argparse.ArgumentTypeError("amounts cannot be negative")
    try:
        return check_amount(usd_to_nanos(amount))  # a counter must be able to hold it
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _money(nanos: int | None) -> str | None:
    return None if nanos is None else nanos_to_usd(nanos)


def call_json(state: WorkState) -> dict[str, Any]:
    """A call as the SPEC §8 JSON object."""
    return {
        "call_id": state.call_id,
        "idempotency_key": state.idempotency_key,
        "stage": state.stage,
        "effect": state.effect,
        "next_operation": state.next_operation,
        "budget": state.budget,
        "provider": state.provider,
        "model": state.model,
        "attempts": state.attempts,
        "reserved_usd": nanos_to_usd(state.reserved_at_admission),
        "cost_usd": _money(state.cost),
        "held_usd": nanos_to_usd(state.held),
        "status": state.status,
        "flagged": state.flagged,
        "created_at": state.created_at,
    }


def budget_json(node: BudgetNode) -> dict[str, Any]:
    """A budget node as the SPEC §8 JSON object."""
    return {
        "path": node.path,
        "limit_usd": _money(node.limit),
        "reserved_usd": nanos_to_usd(node.reserved),
        "spent_usd": nanos_to_usd(node.spent),
        "held_usd": nanos_to_usd(node.held),
    }


def _table(rows: list[dict[str, Any]], columns: Sequence[str]) -> str:
    cells = [[("-" if r.get(c) is None else str(r.get(c))) for c in columns] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(line.rstrip() for line in lines)


def _emit(args: argparse.Namespace, payload: Any, text: str) -> None:
    print(json.dumps(payload, indent=2) if args.json else text)


async def _with_ledger(
    args: argparse.Namespace, job: Callable[[Ledger], Coroutine[Any, Any, int]]
) -> int:
    ledger_url: str = args.ledger
    if "://" not in ledger_url and not Path(ledger_url).exists():
        print(f"effectguard: no ledger at {ledger_url} (use --ledger)", file=sys.stderr)
        return EXIT_USAGE
    async with Ledger.open(ledger_url) as ledger:
        return await job(ledger)


# -- commands ----------------------------------------------------------------
async def cmd_calls(args: argparse.Namespace, ledger: Ledger) -> int:
    calls = await ledger.calls(stage=args.state, budget=args.budget, limit=args.limit)
    rows = [call_json(c) for c in calls]
    columns = [
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
    _emit(args, rows, _table(rows, columns) if rows else "no calls")
    return EXIT_OK


async def cmd_show(args: argparse.Namespace, ledger: Ledger) -> int:
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
    _emit(args, payload, "\n".join(lines))
    return EXIT_OK


async def cmd_reconcile(args: argparse.Namespace, ledger: Ledger) -> int:
    if args.auto:
        from effectguard.callpath.crash import from_environment
        from effectguard.ops.reconcile import reconcile_auto

        results = await reconcile_auto(ledger, _providers(args), crash=from_environment())
        _emit(
            args,
            results,
            "\n".join(f"{r['call_id']}: {r['result']}" for r in results)
            or "no effect-unknown calls with a lookup path",
        )
        return EXIT_OK
    if not args.call_id or args.applied == args.not_applied:
        print(
            "effectguard: reconcile needs CALL_ID and exactly one of --applied / "
            "--not-applied (or --auto)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if not args.note:
        print("effectguard: reconcile needs --note TEXT saying how you know", file=sys.stderr)
        return EXIT_USAGE
    if args.cost is not None and not args.applied:
        print("effectguard: --cost goes with --applied", file=sys.stderr)
        return EXIT_USAGE
    state = await ledger.reconcile(
        args.call_id, applied=args.applied, cost=args.cost, note=args.note, by=args.by
    )
    from effectguard.callpath.crash import from_environment

    from_environment().hit("after:reconcile")
    _emit(args, call_json(state), f"{state.call_id}: {state.stage}")
    return EXIT_OK


async def cmd_budgets(args: argparse.Namespace, ledger: Ledger) -> int:
    rows = [budget_json(n) for n in await ledger.budgets()]
    columns = ["path", "limit_usd", "reserved_usd", "spent_usd", "held_usd"]
    _emit(args, rows, _table(rows, columns) if rows else "no budgets")
    return EXIT_OK


async def cmd_budget_set(args: argparse.Namespace, ledger: Ledger) -> int:
    await ledger.set_limit(args.path, None if args.no_limit else args.limit)
    nodes = {n.path: n for n in await ledger.budgets()}
    node = nodes[args.path]
    _emit(args, budget_json(node), f"{node.path}: limit {_money(node.limit) or 'none'} USD")
    return EXIT_OK


async def cmd_verify(args: argparse.Namespace, ledger: Ledger) -> int:
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
    _emit(args, payload, text)
    return EXIT_OK if report.ok else EXIT_FAILED


def _providers(args: argparse.Namespace) -> dict[str, Any]:
    from effectguard.providers import load_providers

    return load_providers([Path(p) for p in args.providers or ()], _upstreams(args))


def _upstreams(args: argparse.Namespace) -> dict[str, str]:
    out = {}
    for item in getattr(args, "upstream", None) or ():
        name, sep, url = item.partition("=")
        if not sep:
            raise ConfigError(f"--upstream takes NAME=URL, got {item!r}")
        out[name] = url
    return out


def cmd_serve(args: argparse.Namespace) -> int:
    from effectguard.config.settings import load_settings
    from effectguard.ingress.server import serve

    settings = load_settings(
        config=Path(args.config) if args.config else None,
        ledger=args.ledger,
        host=args.host,
        port=args.port,
        provider_dirs=[Path(p) for p in args.providers or ()],
        upstreams=_upstreams(args),
    )
    metrics = None
    try:
        from effectguard.telemetry.metrics import Metrics

        metrics = Metrics()
    except ImportError:  # pragma: no cover - metrics ship with the package
        metrics = None
    serve(settings, metrics=metrics)
    return EXIT_OK


def cmd_migrate(args: argparse.Namespace) -> int:
    async def job() -> None:
        async with Ledger.open(args.ledger):
            pass  # opening a store applies its pending migrations, each in its own transaction

    asyncio.run(job())
    print(f"ledger {args.ledger}: migrations applied")
    return EXIT_OK


def cmd_key_new(args: argparse.Namespace) -> int:
    from effectguard.config.settings import hash_key

    key = "eg-" + secrets.token_urlsafe(24)
    print(f"key (give it to the tenant; it is not stored): {key}")
    print("config:")
    print(
        f'[[keys]]\nname = "{args.root}"\nsha256 = "{hash_key(key)}"\nbudget_root = "{args.root}"'
    )
    return EXIT_OK


def _backup(args: argparse.Namespace) -> int:
    from effectguard.ops.backup import cmd_backup

    return cmd_backup(args)


# -- parser --------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The argument parser (every command has help; a test checks it)."""
    parser = argparse.ArgumentParser(
        prog="effectguard",
        description="A durable ledger between AI agents and the providers they pay for.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def ledger_opts(p: argparse.ArgumentParser, json_flag: bool = True) -> None:
        p.add_argument(
            "--ledger",
            default=_default_ledger(),
            help="ledger PATH or DSN (default ./effectguard.db or $EFFECTGUARD_LEDGER)",
        )
        if json_flag:
            p.add_argument("--json", action="store_true", help="machine-readable JSON output")

    p = sub.add_parser("serve", help="run the proxy", description="Run the HTTP proxy.")
    p.add_argument("--ledger", default=None, help="ledger PATH or DSN (default ./effectguard.db)")
    p.add_argument("--host", default=None, help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default 8787)")
    p.add_argument(
        "--providers",
        action="append",
        metavar="DIR",
        help="extra provider declarations (repeatable)",
    )
    p.add_argument(
        "--upstream",
        action="append",
        metavar="NAME=URL",
        help="override a provider's base URL (repeatable)",
    )
    p.add_argument("--config", metavar="FILE", help="TOML config (budgets, keys, limits)")
    p.set_defaults(run=cmd_serve)

    p = sub.add_parser(
        "fake-provider",
        help="run the synthetic provider for tests",
        description="Run a synthetic OpenAI/Anthropic-compatible provider.",
    )
    from effectguard.testing import fakeprovider

    fakeprovider.add_arguments(p)
    p.set_defaults(run=fakeprovider.run)

    p = sub.add_parser("calls", help="list calls", description="List calls, newest first.")
    ledger_opts(p)
    p.add_argument("--state", choices=STAGES, help="only calls in this stage")
    p.add_argument("--budget", help="only calls under this budget path")
    p.add_argument("--limit", type=int, default=1000, help="at most this many (default 1000)")
    p.set_defaults(run_ledger=cmd_calls)

    p = sub.add_parser("show", help="show one call", description="Show a call's events and state.")
    ledger_opts(p)
    p.add_argument("call_id", help="the call id (Effectguard-Call-Id)")
    p.set_defaults(run_ledger=cmd_show)

    p = sub.add_parser(
        "reconcile",
        help="decide an effect-unknown call",
        description="Record whether an effect-unknown call took effect.",
    )
    ledger_opts(p)
    p.add_argument("call_id", nargs="?", help="the call id")
    p.add_argument("--applied", action="store_true", help="the effect happened")
    p.add_argument("--not-applied", action="store_true", help="the effect did not happen")
    p.add_argument("--cost", type=_usd, help="actual cost in USD (with --applied)")
    p.add_argument("--note", help="how you know (required)")
    p.add_argument("--by", default=getpass.getuser(), help="who decides (default: login name)")
    p.add_argument("--auto", action="store_true", help="ask providers' declared lookup paths")
    p.add_argument("--providers", action="append", metavar="DIR", help="extra declarations")
    p.add_argument("--upstream", action="append", metavar="NAME=URL", help="base URL override")
    p.set_defaults(run_ledger=cmd_reconcile)

    p = sub.add_parser("budgets", help="list budgets", description="List budget nodes.")
    ledger_opts(p)
    p.set_defaults(run_ledger=cmd_budgets)

    p = sub.add_parser("budget", help="change a budget", description="Change a budget node.")
    bsub = p.add_subparsers(dest="budget_command", required=True, metavar="ACTION")
    q = bsub.add_parser("set", help="set a budget's limit", description="Set a budget's limit.")
    ledger_opts(q)
    q.add_argument("path", help="budget path, e.g. team-a/run-42")
    q.add_argument("--limit", type=_usd, help="limit in USD")
    q.add_argument("--no-limit", action="store_true", help="remove the limit")
    q.set_defaults(run_ledger=cmd_budget_set)

    p = sub.add_parser(
        "verify",
        help="verify the ledger",
        description="Check the hash chain, counters and projections.",
    )
    ledger_opts(p)
    p.set_defaults(run_ledger=cmd_verify)

    p = sub.add_parser(
        "backup",
        help="copy a SQLite ledger while it serves",
        description="Take a consistent online copy of a SQLite ledger (SQLite backup API).",
    )
    ledger_opts(p)
    p.add_argument("path", help="where to write the copy (must not exist)")
    p.set_defaults(run=_backup)

    p = sub.add_parser(
        "migrate",
        help="create or upgrade the ledger's tables",
        description="Create or upgrade the ledger's tables (run once per "
        "deployment before starting replicas; serve also does it).",
    )
    ledger_opts(p, json_flag=False)
    p.set_defaults(run=cmd_migrate)

    p = sub.add_parser("key", help="manage proxy keys", description="Manage proxy keys.")
    ksub = p.add_subparsers(dest="key_command", required=True, metavar="ACTION")
    q = ksub.add_parser("new", help="make a proxy key", description="Make a new proxy key.")
    q.add_argument("--root", required=True, help="the budget root this key may spend")
    q.set_defaults(run=cmd_key_new)

    _add_bench(sub)
    return parser


def _add_bench(sub: Any) -> None:
    try:
        from effectguard_bench import cli as bench
    except ImportError:
        return
    p = sub.add_parser(
        "bench",
        help="measure effectguard against a bare proxy",
        description="Benchmark the proxy and transport against a baseline.",
    )
    bench.add_arguments(p)
    p.set_defaults(run=bench.run)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``effectguard`` command."""
    parser = build_parser()
    args = parser.parse_args(argv)
    budget_set = getattr(args, "command", None) == "budget" and args.budget_command == "set"
    if budget_set and (args.limit is None) == (not args.no_limit):
        parser.error("budget set needs exactly one of --limit USD / --no-limit")
    try:
        if hasattr(args, "run_ledger"):
            return asyncio.run(_with_ledger(args, lambda ledger: args.run_ledger(args, ledger)))
        result: int = args.run(args)
        return result
    except ConfigError as exc:
        print(f"effectguard: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (CallNotFound, ReconcileError) as exc:
        print(f"effectguard: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except LedgerUnavailable as exc:
        print(f"effectguard: ledger unavailable: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except (LedgerError, EffectguardError) as exc:
        print(f"effectguard: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
