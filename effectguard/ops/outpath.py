"""Where an operator command may write a new file (``backup``, ``archive``).

A new file goes where no file is, in a directory that exists, and never under a name
SQLite keeps beside the ledger (``LEDGER-wal``, ``-shm``, ``-journal``): SQLite would
take a backup written there for its own file, and truncate or delete it on the next open.
"""

from __future__ import annotations

import os
from pathlib import Path

from effectguard.errors import ConfigError
from effectguard.ledger.sqlitefile import COMPANIONS


def new_file(path: str | Path, *, ledger: Path, command: str, what: str) -> Path:
    """``path`` as the target of ``command`` (which writes ``what``), or ``ConfigError``."""
    if not str(path):
        raise ConfigError(f"{command} needs a file name")
    target = Path(path)
    resolved = target.resolve()
    home = ledger.resolve()
    for suffix in COMPANIONS:  # whether SQLite has one there right now or not
        if resolved == home.with_name(home.name + suffix):
            raise ConfigError(
                f"{target} is the ledger's own {suffix} file: SQLite would overwrite or "
                f"delete {what} written there"
            )
    if target.exists() or target.is_symlink():
        raise ConfigError(f"{target} exists; {what} never overwrites a file")
    if not resolved.parent.is_dir():
        raise ConfigError(f"{command}: directory {target.parent} does not exist")
    if not os.access(resolved.parent, os.W_OK):
        raise ConfigError(f"{command}: cannot write in {target.parent}")
    return target


def partial_of(target: Path) -> Path:
    """Where ``backup`` and ``archive`` write ``target`` before renaming it into place."""
    return target.with_name(f".{target.name}.partial")


def create_private(path: Path) -> None:
    """Create ``path`` empty and owner-only (0600) for a command to write: ``backup``'s
    and ``archive``'s files hold what the ledger holds (prompts, answers, key digests),
    which the ledger keeps owner-only too. Nothing may be there already, a symbolic link
    included: in a shared directory one planted there would have the copy written
    wherever it points."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    except FileExistsError:
        raise ConfigError(f"{path} exists; it is not overwritten") from None
