"""Where the workers of a PostgreSQL ledger keep their liveness locks (contract §7).

A file ledger's workers lock files beside it (``LEDGER.workers/``). A PostgreSQL ledger has
no file of its own, so its workers lock files in a directory of this host, user and boot:
``$XDG_RUNTIME_DIR/effectguard/`` (the user's runtime directory), else
``effectguard-UID/`` in the system's temporary directory, each with a subdirectory per
boot (``/proc/sys/kernel/random/boot_id``). A worker id names its host, process and a
random part, so one directory serves every PostgreSQL ledger of the user, whatever DSN
each process spells the ledger with: a replica reaching the server as ``localhost`` and a
``reconcile`` reaching it as ``127.0.0.1`` see the same locks.

Only a process of the same OS user on the same host and boot can see a worker's lock.
Any other (another host, even one of the same name; another user) finds no file, which
proves nothing: it knows the worker gone by its lease alone, as before.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

#: This kernel's boot, as Linux names it (a directory per boot: a lock file another boot
#: left, in a directory that outlived a reboot or is shared, is never looked at).
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def pg_lock_dir() -> Path | None:
    """The directory of this user's PostgreSQL workers' locks on this host and boot, or
    None (locks are then not used: a worker is known gone by its lease alone) if the
    user's directory cannot be made or is not the user's alone."""
    base = _runtime_base()
    with contextlib.suppress(OSError):  # read-only, full: judged below
        base.mkdir(mode=0o700, exist_ok=True)
    if not _ours_alone(base):
        return None
    return base / f"pg-{_boot()}"


def _runtime_base() -> Path:
    """The user's runtime directory if it is set and theirs, else one of the user's own
    in the temporary directory (which another user could have made first: judged by
    :func:`_ours_alone`)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if runtime and os.path.isabs(runtime) and _ours_alone(Path(runtime)):
        return Path(runtime) / "effectguard"
    return Path(tempfile.gettempdir()) / f"effectguard-{os.getuid()}"


def _ours_alone(path: Path) -> bool:
    """Whether ``path`` is a directory (not a link to one) of this user that no other
    user may write: only then do its lock files say anything about this user's workers."""
    try:
        info = path.lstat()
    except OSError:
        return False
    return (
        stat.S_ISDIR(info.st_mode)
        and info.st_uid == os.getuid()
        and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    )


def _boot() -> str:
    """This boot's id, or ``unknown`` where the kernel names none."""
    try:
        boot = BOOT_ID.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return "unknown"
    return boot if boot.replace("-", "").isalnum() else "unknown"
