"""Take over, before a person decides, the workers whose calls in flight will not finish.

After a crash, a dead process's calls stay ``in_flight`` until a sweep marks them
``effect_unknown`` (contract §7), and a running ``serve`` sweeps only every ``sweep_s``
(a worker known gone by its lease alone: a sweep later still). A person deciding such a
call (``effectguard reconcile``, the operator page's forms) need not wait for that: the
decision registers as a worker, sweeps once as a ``serve`` start would, and stops. With
no such call it writes nothing of its own.

A call taken over because its owner's lease ran out is not to be decided in the same
step: that owner may be alive (paused, overloaded, on another host) and still receive
the provider's answer, kept then as evidence (operations.md, step 3). Deciding at once
would ignore the answer by construction, and a "not applied" it contradicts frees the
key for a second effect (:func:`~effectguard.rules.liveness.may_still_answer`).
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from pathlib import Path
from typing import Final

from effectguard.callpath.liveness import gone_owners, provably_dead
from effectguard.callpath.recovery import WorkerRuntime
from effectguard.ledger import Ledger
from effectguard.rules.liveness import LEASE_EXPIRED, owner_gone
from effectguard.rules.workstate import WorkState

#: Calls in flight looked at (far more than are ever in flight at once).
IN_FLIGHT_READ: Final = 100_000
#: Workers judged alive whose calls :func:`gone_in_flight` leaves out of its read by
#: name (far more processes than share a ledger; past that, their calls are read and
#: dropped by the judgment of each call, and may take room in the read).
ALIVE_NAMED: Final = 1000


async def gone_owners_here(
    ledger: Ledger, lock_dir: Path | None, calls: Iterable[WorkState]
) -> dict[str, str]:
    """:func:`~effectguard.callpath.liveness.gone_owners` as a process on this host judges
    them (locks in ``lock_dir``, the ledger's): call id -> why its owner will not finish it."""
    return await gone_owners(ledger, calls, lock_dir, socket.gethostname())


async def gone_in_flight(
    ledger: Ledger, lock_dir: Path | None, limit: int
) -> tuple[list[tuple[WorkState, str]], bool]:
    """Up to ``limit`` calls in flight whose owner is gone, each with why, and whether
    there may be more. Not every call in flight is read: the live workers are, then, in
    one read (``Ledger.in_flight_except``), the calls in flight of every worker not
    judged alive: gone by its lock or lease, fenced with its call not yet marked (a sweep
    that could not mark it), or with no row at all. Each call read is then judged by
    :func:`gone_owners_here`, the rule ``show`` and a decision use, on a fresh read of
    the workers: a worker registered since the first read is alive, its call dropped."""
    rows = await ledger.store.live_workers()
    now = await ledger.store.clock_now()
    dead = provably_dead(rows, lock_dir, socket.gethostname())
    alive = [
        row.worker
        for row in rows
        if owner_gone(
            live=True, lease_expires=row.lease_expires, now=now, lock_free=row.worker in dead
        )
        is None
    ]
    calls = await ledger.in_flight_except(alive[:ALIVE_NAMED], limit + 1)
    gone = await gone_owners_here(ledger, lock_dir, calls)
    found = [(call, gone[call.call_id]) for call in calls if call.call_id in gone]
    return found[:limit], len(calls) > limit


async def take_over_gone(
    ledger: Ledger,
    lock_dir: Path | None,
    calls: Iterable[WorkState] | None = None,
    *,
    lock_required: bool = True,
) -> dict[str, str]:
    """Sweep once if a call in flight of ``calls`` (None: every call in flight) has an
    owner that is gone; returns the calls the sweep marked effect unknown, each with why
    its owner was given up."""
    if calls is None:
        calls = await ledger.calls(stage="in_flight", limit=IN_FLIGHT_READ)
    gone = await gone_owners_here(ledger, lock_dir, calls)
    if not gone:
        return {}
    worker = WorkerRuntime(ledger, lock_dir=lock_dir, lock_required=lock_required)
    await worker.register()
    try:
        marked = await worker.sweep()
    finally:
        await worker.stop()
    # A call not judged above had an owner that was live a moment ago (its lease ran out
    # between that look and the sweep: a paused worker), or was not looked at: said so, it
    # is not decided at once, as an owner given up by its lease never is.
    return {call_id: gone.get(call_id, LEASE_EXPIRED) for call_id in marked}
