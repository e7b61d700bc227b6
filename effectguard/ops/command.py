"""What an ``effectguard`` command is made of: its record, exit codes, shared options.

Each command module lists :class:`Command` records; :mod:`effectguard.ops.cli`
assembles the parser from them. A command's ``arguments`` function adds its
options and sets ``run`` (``run(args) -> int``) or ``run_ledger`` (``async
run_ledger(args, ledger) -> int``, given an open ledger) as parser defaults, and
``reads_only=True`` beside ``run_ledger`` if it never writes (then a SQLite ledger behind
this release is read through a migrated copy, :mod:`~effectguard.ops.verifycopy`); it
may import what it needs lazily, and the parser only calls it for the command
being run, so ``effectguard calls`` never imports the server.

Exit codes (docs/contract.md §8): 0 success; 1 a check failed (``verify``) or nothing
matched; 2 bad usage or configuration; 3 the ledger refused (e.g. reconcile of
a call that is neither ``effect_unknown`` nor ``failed``); 4 the ledger is unavailable.
"""

from __future__ import annotations

import argparse
import errno
import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from effectguard.config import defaults
from effectguard.errors import ConfigError, LedgerUnavailable
from effectguard.rules.budget import validate_path
from effectguard.rules.counts import parse_count
from effectguard.rules.money import MAX_CALL_NANOS, MAX_NANOS, typed_usd

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_REFUSED, EXIT_UNAVAILABLE = 0, 1, 2, 3, 4


@dataclass(frozen=True, slots=True)
class Command:
    """One top-level command: its name, its help, and how to add its options."""

    name: str
    help: str
    description: str
    arguments: Callable[[argparse.ArgumentParser], None]


def set_check(
    parser: argparse.ArgumentParser, check: Callable[[argparse.Namespace], str | None]
) -> None:
    """Give ``parser``'s command a ``check(args)`` that returns a usage problem (or None),
    reported (exit 2) with that command's usage line, as argparse's own errors are, not
    the top-level ``effectguard COMMAND ...`` one."""
    parser.set_defaults(check=check, check_parser=parser)


def path_arg(value: str) -> str:
    """An argparse type: a path the file system can look up (it need not exist).

    A NUL character or a name longer than the file system takes would otherwise surface
    as a ``ValueError`` or ``OSError`` from whatever first touches the path. A DSN
    (``postgresql://...``) is only checked for NUL.
    """
    if not value:
        # An unset variable (--ledger "$LEDGR") would otherwise mean the default ledger.
        raise argparse.ArgumentTypeError("a path cannot be empty")
    if "\x00" in value:
        raise argparse.ArgumentTypeError(f"a path cannot hold a NUL character: {value!r}")
    if "://" in value and not value.startswith("sqlite:///"):
        return value  # a DSN: its parts are no file names
    try:
        os.stat(value.removeprefix("sqlite:///"))
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            shown = value if len(value) <= 60 else f"{value[:40]}... ({len(value)} chars)"
            raise argparse.ArgumentTypeError(f"file name too long: {shown}") from None
    return value


def text_arg(value: str) -> str:
    """An argparse type: text the ledger can hold and look up (a call id, a name).

    A byte that is no UTF-8 (typed in a Latin-1 terminal, pasted) reaches Python as a
    lone surrogate, which the ledger's UTF-8 encoder refuses with a traceback."""
    if any("\ud800" <= c <= "\udfff" for c in value):
        raise argparse.ArgumentTypeError(f"not UTF-8 text: {value!r}")
    return value


def port_arg(value: str) -> int:
    """An argparse type: a TCP port, 0 (any free one) to 65535.

    The socket layer would take 99999 as port 34463, and -1 fails with a resolver's error.
    """
    port = parse_count(value, 65535)
    if port is None or port > 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is a number from 0 to 65535, not {value!r}")
    return port


def ledger_option(parser: argparse.ArgumentParser, json_flag: bool = True) -> None:
    """``--ledger``, ``--config`` and, unless told not to, ``--json``.

    The ledger is found as ``serve`` finds it (:func:`resolve_ledger`), so a command run
    with serve's config file reads serve's ledger.
    """
    parser.add_argument(
        "--ledger",
        type=path_arg,
        default=None,
        help="ledger PATH or DSN (default: the --config file's ledger, else "
        "$EFFECTGUARD_LEDGER, else ./effectguard.db)",
    )
    parser.add_argument(
        "--config",
        type=path_arg,
        metavar="FILE",
        help="serve's TOML config: its `ledger = ...` names the ledger (--ledger wins)",
    )
    parser.set_defaults(resolve_ledger=True)
    if json_flag:
        parser.add_argument("--json", action="store_true", help="machine-readable JSON output")


def resolve_ledger(args: argparse.Namespace) -> str:
    """The ledger a command uses: ``--ledger``, else the config's, else the environment's.

    A ``--config`` given is read even when ``--ledger`` wins: a file that cannot be read is
    an error, not something to pass over in silence.
    """
    named = None
    if args.config:
        from effectguard.config.settings import config_ledger

        named = config_ledger(Path(args.config))
    if args.ledger:
        return str(args.ledger)
    return named or defaults.ledger_from(os.environ)


def ledger_flags(args: argparse.Namespace) -> str:
    """``--ledger`` naming this command's ledger (resolved: from ``--ledger``, the config or
    the environment), for a command it prints to run next; a password in it as ``***``."""
    if not args.ledger:
        return ""
    from effectguard.ledger import shown_ledger

    return f" --ledger {shlex.quote(shown_ledger(str(args.ledger)))}"


def applied_versions(url: str) -> list[int]:
    """The migrations applied to the ledger at ``url``, read without migrating it; none
    where there is no ledger yet."""
    if url.startswith("memory://"):
        return []
    if url.startswith(("postgresql://", "postgres://")):
        from effectguard.ledger import pgschema

        return pgschema.applied_versions(url)
    from effectguard.ledger import sqlitefile

    return sqlitefile.applied_versions(sqlitefile.sqlite_path(url))


def migrate_ledger(url: str) -> list[int]:
    """Apply the pending migrations to the ledger at ``url`` (a SQLite one is created, owner
    only, where no file is); the versions this process applied, not those another process
    opening the ledger at the same moment applied."""
    if url.startswith("memory://"):
        return []
    if url.startswith(("postgresql://", "postgres://")):
        from effectguard.ledger import pgschema

        return pgschema.migrate(url)
    import sqlite3

    from effectguard.ledger import sqliteconnect, sqlitefile, sqliteschema

    path = sqlitefile.sqlite_path(url)
    sqlitefile.create_owner_only(path)
    try:
        conn = sqliteconnect.connect(path)
        try:
            return sqliteschema.migrate(conn)
        finally:
            conn.close()
    except sqlite3.Error as exc:  # as the store's open says it
        raise LedgerUnavailable(f"cannot open ledger {path}: {exc}") from exc


def check_ledger(url: str) -> None:
    """Refuse (``ConfigError``) a ledger URL or path that names no ledger (a SQLite file,
    a PostgreSQL schema): a command that is not ``migrate`` or ``serve`` must not create
    one, nor migrate an empty file, an empty schema or another program's database into one."""
    if url.startswith("memory://"):
        return
    if url.startswith(("postgresql://", "postgres://")):
        from effectguard.ledger.pgschema import check_ledger_schema

        check_ledger_schema(url)
        return
    from effectguard.ledger.sqlitefile import check_ledger_file, sqlite_path

    check_ledger_file(sqlite_path(url))


def check_ledger_place(url: str) -> None:
    """Refuse (``ConfigError``) a SQLite ledger path where ``serve`` or ``migrate`` could
    not make or open a ledger (a directory, a missing directory, a file that is not a
    SQLite database, another program's database), before either starts anything. A
    PostgreSQL schema is created if missing; a server that does not answer is exit 4.
    A ledger a newer release migrated is refused too: a rollback that started this release
    on it would write beside that release's rules, or fail only in the lifespan."""
    if url.startswith("memory://"):
        return
    postgres = url.startswith(("postgresql://", "postgres://"))
    if not postgres:
        from effectguard.ledger import sqlitefile

        sqlitefile.check_ledger_place(sqlitefile.sqlite_path(url))
    from effectguard.ledger import shown_ledger, versions

    try:
        applied = applied_versions(url)
    except LedgerUnavailable:
        return  # unreachable or locked now: opening the store reports it, as it did
    if postgres:
        from effectguard.ledger import pgschema

        ours = [m[0] for m in pgschema.MIGRATIONS]
    else:
        from effectguard.ledger import sqliteschema

        ours = [m[0] for m in sqliteschema.MIGRATIONS]
    versions.check_not_newer(shown_ledger(url), applied, ours)


def provider_options(parser: argparse.ArgumentParser, *, long_help: bool = True) -> None:
    """``--providers DIR`` and ``--upstream NAME=URL``, both repeatable."""
    parser.add_argument(
        "--providers",
        action="append",
        type=path_arg,
        metavar="DIR",
        help="extra provider declarations (repeatable)" if long_help else "extra declarations",
    )
    parser.add_argument(
        "--upstream",
        action="append",
        metavar="NAME=URL",
        help="override a provider's base URL (repeatable)" if long_help else "base URL override",
    )


def _amount(value: str, bound: int, what: str) -> int:
    try:
        return typed_usd(value, bound, what)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def usd(value: str) -> int:
    """An argparse type: a non-negative USD amount that a budget counter can hold, as nanos
    (exact: an amount finer than a nano-dollar is refused, not rounded)."""
    return _amount(value, MAX_NANOS, "amount")


def call_usd(value: str) -> int:
    """An argparse type: what one call may cost (:data:`MAX_CALL_NANOS`), as nanos."""
    return _amount(value, MAX_CALL_NANOS, "a cost")


def count(value: str) -> int:
    """An argparse type: a count, ASCII digits from 0 up to what a counter holds."""
    text = value.strip()
    if text.startswith("-") and text[1:].isdecimal():
        raise argparse.ArgumentTypeError("a count cannot be negative")
    counted = parse_count(text, MAX_NANOS)
    if counted is None:
        raise argparse.ArgumentTypeError(f"not a count: {value!r}")
    if counted > MAX_NANOS:
        raise argparse.ArgumentTypeError(f"a count is at most {MAX_NANOS}")
    return counted


def budget_path(value: str) -> str:
    """An argparse type: a budget path (:func:`~effectguard.rules.budget.validate_path`).

    Also for the filters (``budgets --under``, ``calls --budget``): a path no node can
    have (``team/``, with a trailing slash) would list nothing, as if the node were empty.
    """
    try:
        return validate_path(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def upstreams(args: argparse.Namespace) -> dict[str, str]:
    """The ``--upstream NAME=URL`` flags as a mapping."""
    out = {}
    for item in getattr(args, "upstream", None) or ():
        name, sep, url = item.partition("=")
        if not sep:
            raise ConfigError(f"--upstream takes NAME=URL, got {item!r}")
        out[name] = url
    return out


def upstream_flag(name: str) -> str:
    """How the CLI names one ``--upstream`` entry in errors (the library names its argument)."""
    return f"--upstream {name}"
