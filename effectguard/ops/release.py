"""Which release is installed, as ``effectguard --version`` tells it.

Every release so far carries the package version 0.1.0, so the version alone cannot
tell an operator which release runs before an upgrade (docs/operations.md, "Upgrading").
What tells releases apart for the ledger is what they write: the writer format (which
stops an older release's writes, docs/contract.md §7) and the last migration of each
store. Read only when asked: the other commands import none of this.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from effectguard.errors import ConfigError


def release_line() -> str:
    """``effectguard VERSION (writer format F; migrations: SQLite N, PostgreSQL M)``."""
    from effectguard.ledger.sqliteschema import MIGRATIONS as SQLITE_MIGRATIONS
    from effectguard.ledger.writerformat import WRITER_FORMAT

    try:
        number = version("effectguard")
    except PackageNotFoundError:  # run from a checkout that was never installed
        number = "(not installed)"
    return (
        f"effectguard {number} (writer format {WRITER_FORMAT}; migrations: "
        f"SQLite {SQLITE_MIGRATIONS[-1][0]}, {_postgres()})"
    )


def _postgres() -> str:
    """The last PostgreSQL migration, or why it cannot be read: the schema module needs
    the driver, which only the ``postgres`` extra installs."""
    try:
        from effectguard.ledger.pgschema import MIGRATIONS
    except ConfigError:
        return "PostgreSQL: needs the postgres extra"
    return f"PostgreSQL {MIGRATIONS[-1][0]}"


class VersionAction(argparse.Action):
    """``--version``: print :func:`release_line` and exit 0 (read only then)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        kwargs.setdefault("help", "print the release (package version, ledger formats) and exit")
        super().__init__(option_strings, argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print(release_line())  # to stdout, as argparse's own version action
        parser.exit()
