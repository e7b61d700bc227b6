"""``verify``, ``calls``, ``show`` and ``budgets`` of a SQLite ledger an older release left,
such as the backup of an upgrade.

Every command but ``migrate`` and ``serve`` refuses a ledger behind this release
(:mod:`effectguard.ledger.versions`), because opening a store migrates it. For the
commands that only read, that refusal advised migrating the file, and the file they are
most often run on after an upgrade is step 1's backup: migrated, it is refused by the
release it was taken for, so the rollback copy would be gone. They read a copy instead,
migrated in a temporary directory (owner-only, removed after), and never change the
file. A copy is exact: it is taken with SQLite's backup API as ``effectguard backup``
takes one, and this release's migrations are what it would apply to the file itself.
A command that changes the ledger keeps refusing: its change would be made to the copy.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from effectguard.ops.backup import backup_sqlite
from effectguard.ops.render import say


def pending_migrations(url: str) -> list[int]:
    """This release's migrations a SQLite ledger at ``url`` has yet to apply, where every
    migration it has is this release's; none for a current ledger, one a newer release
    migrated (still refused), no ledger at all, or PostgreSQL."""
    if url.startswith(("memory://", "postgresql://", "postgres://")):
        return []
    from effectguard.ledger import sqlitefile
    from effectguard.ledger.sqliteschema import MIGRATIONS

    applied = set(sqlitefile.applied_versions(sqlitefile.sqlite_path(url)))
    known = {m[0] for m in MIGRATIONS}
    if not applied or applied - known:
        return []
    return sorted(known - applied)


@contextmanager
def migrated_copy(url: str, pending: list[int], doing: str = "verifying") -> Iterator[str]:
    """A copy of the SQLite ledger at ``url`` to open (and so migrate) in its place;
    ``doing`` (``verifying``, ``reading``) is what the command does with it, for its line."""
    with tempfile.TemporaryDirectory(prefix="effectguard-verify-") as folder:
        copy = Path(folder) / "ledger.db"
        backup_sqlite(url, copy)
        say(
            f"effectguard: ledger {url} is behind this release (migration "
            f"{', '.join(map(str, pending))} pending): {doing} a copy of it migrated in "
            f"{folder}; the ledger itself is not changed",
            err=True,
        )
        yield str(copy)
