"""``effectguard key new | list | revoke``: proxy keys kept in the ledger.

``key new`` prints the key once and records only its SHA-256 (a ``key.created``
event in the hash chain); ``key revoke`` records ``key.revoked``. Every running
replica picks a change up within ``[server] key_refresh_s`` (default 2 s), no
restart. ``key new --print-config`` writes nothing and prints ``[[keys]]`` lines
for the config file instead (keys there need a restart to change); ``key new --admin
NAME`` prints an operator page key's ``[[admin.keys]]`` lines (also not in the ledger).
"""

from __future__ import annotations

import argparse
import json
import re
import secrets
import sys
import time
from datetime import UTC, date, datetime
from typing import Any

from effectguard.ledger import Ledger
from effectguard.ops.command import (
    EXIT_OK,
    EXIT_USAGE,
    Command,
    ledger_option,
    set_check,
    text_arg,
)
from effectguard.ops.render import emit, iso, table
from effectguard.rules import budget as budgets
from effectguard.rules import keys, notes
from effectguard.rules.events import KeyCreated
from effectguard.rules.keys import LedgerKey

LIST_COLUMNS = ["name", "budget_root", "status", "created_at", "expires_at", "models", "providers"]


def new_key() -> str:
    """A fresh proxy key: ``eg-`` and 32 random URL-safe characters (192 bits)."""
    return "eg-" + secrets.token_urlsafe(24)


def expiry(value: str) -> float:
    """An argparse type: an ISO 8601 date or date-time, as seconds since the epoch.

    A date alone means 00:00 UTC of that day (the key works until then); a date-time
    without a zone is UTC.
    """
    try:
        if len(value) == 10:
            day = date.fromisoformat(value)
            moment = datetime(day.year, day.month, day.day, tzinfo=UTC)
        else:
            moment = datetime.fromisoformat(value)
            if moment.tzinfo is None:
                moment = moment.replace(tzinfo=UTC)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not an ISO 8601 date or date-time: {value!r} (e.g. 2027-01-31)"
        ) from None
    try:
        # key list shows expiries in UTC: one past 9999-12-31T23:59:59Z could not be shown.
        moment.astimezone(UTC)
    except OverflowError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is out of range: in UTC it falls outside years 1 to 9999"
        ) from None
    return moment.timestamp()


#: What a call names its model or provider with: printable ASCII without spaces (model ids
#: such as ``accounts/x/models/y`` or ``claude@2024``), and a provider's declared name.
_MODEL = re.compile(r"[!-~]{1,200}")
_PROVIDER = re.compile(r"[a-z0-9][a-z0-9_.-]{0,99}")


def _names(value: str, pattern: re.Pattern[str], rule: str) -> list[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError("give at least one name (comma-separated)")
    for name in names:
        if not pattern.fullmatch(name):
            raise argparse.ArgumentTypeError(f"{name!r}: {rule}; no call could name it")
    return names


def _models(value: str) -> list[str]:
    return _names(value, _MODEL, "a model name is printable ASCII without spaces")


def _providers(value: str) -> list[str]:
    return _names(value, _PROVIDER, "a provider name is lowercase letters, digits, _ . -")


#: ``ROOT-xxxxxx`` is cut to a name's 100 characters.
_ROOT_IN_NAME = 100 - len("-xxxxxx")


def key_json(row: LedgerKey, now: float) -> dict[str, Any]:
    """A ledger key as ``key list --json`` shows it (never its digest)."""
    return {
        "name": row.name,
        "budget_root": row.budget_root,
        "status": row.ended(now) or "active",
        "created_at": iso(row.created_at),
        "expires_at": iso(row.expires_at),
        "revoked_at": iso(row.revoked_at),
        "models": None if row.models is None else list(row.models),
        "providers": None if row.providers is None else list(row.providers),
    }


async def cmd_key_new(args: argparse.Namespace, ledger: Ledger) -> int:
    """``effectguard key new``: record a key's hash in the ledger; print the key once."""
    from effectguard.config.settings import hash_key

    key = new_key()
    event = KeyCreated(
        name=args.name or f"{args.root[:_ROOT_IN_NAME]}-{secrets.token_hex(3)}",
        sha256=hash_key(key),
        budget_root=args.root,
        expires_at=args.expires,
        models=args.models,
        providers=args.providers,
    )
    row = await ledger.create_key(event)
    made = key_json(row, time.time())
    text = (
        f"key {row.name} for budget root {row.budget_root!r} is in the ledger; every replica "
        f"accepts it within seconds.\n{_restrictions(made)}\n"
        f"key (shown once, not stored; give it to the tenant): {key}"
    )
    emit(args, {"key": key, **made}, text)
    return EXIT_OK


def _restrictions(made: dict[str, Any]) -> str:
    """What a new key may do, as the ledger recorded it (``key_json``'s fields): a typo in
    ``--models`` or an expiry in the wrong year is seen before the key is handed over, and
    a key with no restriction says so rather than leaving it to be inferred."""
    rows = [
        ("budget_root", made["budget_root"]),
        ("models", ", ".join(made["models"]) if made["models"] else "any model"),
        ("providers", ", ".join(made["providers"]) if made["providers"] else "any provider"),
        ("expires_at", made["expires_at"] or "never"),
    ]
    return "\n".join(f"  {field:<12} {value}" for field, value in rows)


def print_config(args: argparse.Namespace) -> int:
    """``key new --print-config`` / ``--admin``: a key and its lines for the config file
    (with ``--json``, the same as one object: ``key``, ``name``, ``sha256``, ``config``,
    and a proxy key's ``budget_root``)."""
    from effectguard.config.settings import hash_key

    if args.admin is None and (args.expires is not None or args.models or args.providers):
        print("effectguard: --expires, --models and --providers need a ledger key", file=sys.stderr)
        return EXIT_USAGE
    key = new_key()
    digest = hash_key(key)
    if args.admin is not None:
        # A TOML basic string: JSON's escapes are TOML's, and the rest stays as typed
        # (TOML refuses the surrogate-pair escapes ensure_ascii would write for 😀).
        name = notes.name_text(args.admin)
        shown = {"key": key, "name": name, "sha256": digest}
        lines = (
            f'[[admin.keys]]\nname = {json.dumps(name, ensure_ascii=False)}\nsha256 = "{digest}"'
        )
        who = "operator"
    else:
        name = args.name or args.root
        shown = {"key": key, "name": name, "budget_root": args.root, "sha256": digest}
        lines = f'[[keys]]\nname = "{name}"\nsha256 = "{digest}"\nbudget_root = "{args.root}"'
        who = "tenant"
    kind = "admin key" if args.admin is not None else "key"
    text = f"{kind} (give it to the {who}; it is not stored): {key}\nconfig:\n{lines}"
    # Printed whole, not through emit's terminal filter: the name is a TOML string the
    # config file must read back exactly (checked printable when parsed).
    print(json.dumps({**shown, "config": lines + "\n"}, indent=2) if args.json else text)
    return EXIT_OK


async def cmd_key_list(args: argparse.Namespace, ledger: Ledger) -> int:
    """``effectguard key list``: the ledger's keys, revoked and expired ones included."""
    now = time.time()
    rows = [key_json(row, now) for row in await ledger.keys()]
    shown = [
        {**r, "models": ",".join(r["models"] or []) or None}
        | {"providers": ",".join(r["providers"] or []) or None}
        for r in rows
    ]
    emit(args, rows, table(shown, LIST_COLUMNS) if rows else "no keys in the ledger")
    return EXIT_OK


async def cmd_key_revoke(args: argparse.Namespace, ledger: Ledger) -> int:
    """``effectguard key revoke NAME``."""
    row = await ledger.revoke_key(args.name)
    emit(
        args,
        key_json(row, time.time()),
        f"key {row.name} revoked; every replica refuses it within seconds",
    )
    return EXIT_OK


#: What only a proxy key (--root) has.
_PROXY_KEY_ONLY = ("--name", "--expires", "--models", "--providers")


def _check_new(args: argparse.Namespace) -> str | None:
    if args.print_config or args.admin is not None:  # writes nothing: needs no ledger
        del args.run_ledger
        args.run = print_config
    if args.admin is not None:
        # As the config file reads it back: `serve` would refuse any other name, after the
        # key (shown once) was printed.
        if notes.name_text(args.admin) is None:
            return f"admin name {args.admin!r}: must be a printable, non-empty name"
        # An admin key is named by --admin and has no expiry or restriction: a flag asking
        # for one would otherwise be dropped, and a key meant to expire never would.
        given = [flag for flag in _PROXY_KEY_ONLY if getattr(args, flag[2:]) is not None]
        if given:
            return f"{', '.join(given)}: not for an operator page key (--admin)"
        return None
    try:
        budgets.validate_path(args.root)
        if args.name is not None:
            keys.validate_name(args.name)
    except ValueError as exc:
        return str(exc)
    return None


def _key_arguments(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="key_command", required=True, metavar="ACTION")
    q = actions.add_parser(
        "new",
        help="make a proxy key",
        description="Make a proxy key: its hash goes into the ledger, the key is printed once.",
    )
    ledger_option(q)
    who = q.add_mutually_exclusive_group(required=True)
    who.add_argument("--root", help="the budget root this key may spend")
    who.add_argument(
        "--admin",
        metavar="NAME",
        help="an operator page key instead, for the operator NAME (prints config lines)",
    )
    q.add_argument("--name", help="a name to list and revoke it by (default ROOT-xxxxxx)")
    q.add_argument(
        "--expires", type=expiry, help="ISO date or date-time it stops working (UTC by default)"
    )
    q.add_argument(
        "--models", type=_models, help="comma-separated models it may call (default any)"
    )
    q.add_argument(
        "--providers", type=_providers, help="comma-separated providers it may call (default any)"
    )
    q.add_argument(
        "--print-config",
        action="store_true",
        help="write nothing; print [[keys]] lines for the config file instead",
    )
    q.set_defaults(run_ledger=cmd_key_new)
    set_check(q, _check_new)
    q = actions.add_parser(
        "list", help="list the ledger's keys", description="List the proxy keys in the ledger."
    )
    ledger_option(q)
    q.set_defaults(run_ledger=cmd_key_list)
    q = actions.add_parser(
        "revoke", help="revoke a key", description="Revoke a proxy key in the ledger by name."
    )
    ledger_option(q)
    q.add_argument("name", type=text_arg, help="the key's name (see key list)")
    q.set_defaults(run_ledger=cmd_key_revoke)


KEY = Command("key", "manage proxy keys", "Manage proxy keys kept in the ledger.", _key_arguments)
