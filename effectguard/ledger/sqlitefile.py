"""Where a SQLite ledger's file is, and how it is created (owner-only)."""

from __future__ import annotations

import contextlib
import os

from effectguard.errors import ConfigError


def file_identity(path: str) -> tuple[int, int]:
    """The file at ``path`` (device and inode): a replaced file is another one."""
    stat = os.stat(path)
    return stat.st_dev, stat.st_ino


def sqlite_path(url: str) -> str:
    """The file path of a ``sqlite:///path`` URL or a plain path."""
    if url.startswith("sqlite:///"):
        return url[len("sqlite:///") - 1 :] if url.startswith("sqlite:////") else url[10:]
    if "://" in url:
        raise ConfigError(f"not a SQLite ledger: {url!r}")
    return url


def create_owner_only(path: str) -> None:
    """Create the ledger file readable by its owner only (it holds prompts and responses).

    SQLite gives the ``-wal`` and ``-shm`` files the main file's permissions. An existing
    file is left as its owner set it.
    """
    if path == ":memory:" or path.startswith("file:"):
        return
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
