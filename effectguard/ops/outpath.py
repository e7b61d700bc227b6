"""Where an operator command may write a new file (``backup``, ``archive``), and how.

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


def create_owner_only(path: Path) -> None:
    """Create ``path`` empty (or empty it) and make it readable by its owner only.

    A backup or an archive holds what the ledger holds (prompts, answers, uploads), and
    the ledger file is owner-only (0600): a copy made under the process's umask (0644,
    commonly) would let every local user read what the ledger keeps from them. What is
    written into the file afterwards keeps its mode, and so does the name it is renamed
    to; SQLite gives a copy's ``-wal`` and ``-shm`` the same mode.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # a file that was there keeps its mode through O_CREAT
    finally:
        os.close(fd)
