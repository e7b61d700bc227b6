"""Which workers' processes are gone: the proofs a sweep takes them over by (contract §7).

A worker holds an OS file lock (``flock``) for as long as its process lives, beside a
file ledger or, for PostgreSQL, in a directory of its host
(:mod:`~effectguard.callpath.hostlocks`); the kernel drops it when the process dies,
however it dies. Only a process on the same host can see that lock (for PostgreSQL, of
the same OS user too). Elsewhere a worker is known gone only once its lease runs out by
the ledger's clock.
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterable
from pathlib import Path

from effectguard.ledger import Ledger
from effectguard.ledger.base import WorkerRow
from effectguard.rules.liveness import owner_gone
from effectguard.rules.workstate import WorkState


def lock_free(lock_dir: Path, worker: str) -> bool:
    """Whether ``worker``'s liveness lock exists and nobody holds it: its process is gone.

    A missing file proves nothing (a worker of another host, or one removed by the sweep
    that took it over), so it counts as held."""
    path = lock_dir / f"{worker}.lock"
    if not path.exists():
        return False
    try:
        # Read-only: flock needs no write access, and a ledger on a filesystem remounted
        # read-only after a crash must still show its dead workers as gone.
        handle = path.open("rb")
    except OSError:  # not ours to open (another user's process): nothing is proved
        return False
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(handle, fcntl.LOCK_UN)
        return True


def remove_if_free(lock_dir: Path, worker: str) -> bool:
    """Remove ``worker``'s lock file if nobody holds it; whether it was removed.

    Unlinked only while this process holds the lock: a file its worker still holds (a
    live process, or one that locked it after another looked) is never removed from
    under it. A worker re-checks after locking that its file is still the one in the
    directory (:func:`effectguard.callpath.recovery.take_lock`)."""
    try:
        handle = (lock_dir / f"{worker}.lock").open("rb")
    except OSError:  # gone already (another sweeper), or not ours
        return False
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        try:
            (lock_dir / f"{worker}.lock").unlink()
        except OSError:
            return False
        return True


def provably_dead(
    rows: Iterable[WorkerRow], lock_dir: Path | None, host: str, me: str = ""
) -> set[str]:
    """Workers of ``rows`` on ``host`` (other than ``me``) whose liveness lock is free."""
    if lock_dir is None:
        return set()
    return {
        row.worker
        for row in rows
        if not row.fenced
        and row.host == host
        and row.worker != me
        and lock_free(lock_dir, row.worker)
    }


async def gone_owners(
    ledger: Ledger, calls: Iterable[WorkState], lock_dir: Path | None, host: str
) -> dict[str, str]:
    """Of ``calls`` in flight, those whose owner will not finish them: call id -> why."""
    calls = [c for c in calls if c.stage == "in_flight"]
    if not calls:
        return {}
    rows = {row.worker: row for row in await ledger.store.live_workers()}
    now = await ledger.store.clock_now()
    dead = provably_dead(rows.values(), lock_dir, host)
    gone: dict[str, str] = {}
    for call in calls:
        row = rows.get(call.worker)
        reason = owner_gone(
            live=row is not None,
            lease_expires=0.0 if row is None else row.lease_expires,
            now=now,
            lock_free=call.worker in dead,
        )
        if reason is not None:
            gone[call.call_id] = reason
    return gone
