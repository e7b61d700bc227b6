"""Run a schedule against real processes, then bring everything back and let it go quiet.

Six concurrent parts: one task per client call (started at its time), one
task per replica that applies that replica's faults in order, a supervisor
that restarts a replica that died on its own (an armed crash point) once no
fault holds it down, the operator's actions (``--operator``: CLI commands
against the ledger) in order, and the maintenance commands (``--maintenance``:
backups, archives, authorized resends; :mod:`effectguard.testing.sim.maintenance`),
and the wall-clock steps (``--clock-steps``). After the schedule: every replica still
running must answer ``/healthz`` by itself in time; then every process is stopped
gracefully, the ledger's clock is stepped forward to the furthest it ran ahead (a step
back would delay the takeover of the dead workers' leases), every replica is started
clean, the recovery sweep is given time to mark the dead workers' attempts, keyed 200s
are replayed, and all is stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time

import httpx

from effectguard.ledger import Ledger
from effectguard.testing.sim.clients import TIMEOUT, Answer, run_call, send
from effectguard.testing.sim.cluster import Cluster, Replica
from effectguard.testing.sim.maintenance import maintain
from effectguard.testing.sim.schedule import (
    CLOCK_ACTIONS,
    KEY_ROOTS,
    MAINTENANCE_ACTIONS,
    OPERATOR_ACTIONS,
    Call,
    Fault,
)

__all__ = ["execute", "quiesce"]

_SUPERVISE_EVERY = 0.2
#: The operator's actions that take the fault's ``point`` (all but ``reconcile_auto``).
_OPERATOR = {
    "budget_set": Cluster.budget_set,
    "rate_set": Cluster.rate_set,
    "key_new": Cluster.key_new,
    "key_revoke": Cluster.key_revoke,
}


async def execute(cluster: Cluster) -> list[Answer]:
    """Run the schedule's calls and faults; every client answer, in call order."""
    schedule = cluster.schedule
    locks = {r.index: asyncio.Lock() for r in cluster.replicas}
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as client:
        start = time.monotonic()
        clients = [
            asyncio.create_task(_call_at(client, cluster, call, start)) for call in schedule.calls
        ]
        faulting = [
            asyncio.create_task(_faults_of(cluster, replica, locks, start))
            for replica in cluster.replicas
        ]
        supervisor = asyncio.create_task(_supervise(cluster, locks))
        operator = asyncio.create_task(_operator(cluster, start))
        clocks = asyncio.create_task(_clock_steps(cluster, start))
        maintenance = asyncio.create_task(maintain(cluster, client, start))
        results = await asyncio.gather(*clients, maintenance)
        await asyncio.gather(*faulting, operator, clocks)
        supervisor.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await supervisor
    return [answer for answers in results for answer in answers]


async def _call_at(
    client: httpx.AsyncClient, cluster: Cluster, call: Call, start: float
) -> list[Answer]:
    await asyncio.sleep(max(0.0, start + call.at - time.monotonic()))
    answers = await run_call(client, lambda i: cluster.replicas[i].url, call, cluster.keys)
    cluster.seen.update((a.call_id, call.id) for a in answers if a.call_id)
    return answers


async def _faults_of(
    cluster: Cluster, replica: Replica, locks: dict[int, asyncio.Lock], start: float
) -> None:
    """Apply ``replica``'s faults in order (a fault that runs long delays the next).

    A read-only remount touches every replica, so it holds every lock; it is always
    replica 0's fault and takes the locks in index order, so two tasks never wait on
    each other.
    """
    mine = (f for f in cluster.schedule.faults if f.replica == replica.index)
    apart = OPERATOR_ACTIONS | MAINTENANCE_ACTIONS | CLOCK_ACTIONS
    for fault in (f for f in mine if f.kind not in apart):
        await asyncio.sleep(max(0.0, start + fault.at - time.monotonic()))
        needed = sorted(locks) if fault.kind == "read_only" else [replica.index]
        async with contextlib.AsyncExitStack() as held:
            for index in needed:
                await held.enter_async_context(locks[index])
            await _apply(cluster, replica, fault)


async def _operator(cluster: Cluster, start: float) -> None:
    """Apply the operator's actions (``--operator``) in order, whatever the replicas do."""
    for fault in (f for f in cluster.schedule.faults if f.kind in OPERATOR_ACTIONS):
        await asyncio.sleep(max(0.0, start + fault.at - time.monotonic()))
        if fault.kind == "reconcile_auto":
            await asyncio.to_thread(cluster.reconcile_auto)
        else:
            await asyncio.to_thread(_OPERATOR[fault.kind], cluster, fault.point or "")


async def _clock_steps(cluster: Cluster, start: float) -> None:
    """Step the clocks (``--clock-steps``) in order, whatever the replicas go through."""
    for fault in (f for f in cluster.schedule.faults if f.kind in CLOCK_ACTIONS):
        await asyncio.sleep(max(0.0, start + fault.at - time.monotonic()))
        await asyncio.to_thread(cluster.step_clock, fault.replica, fault.point or "")


async def _start(cluster: Cluster, replica: Replica, crash_at: str | None = None) -> None:
    """Start a replica; one that dies while starting (an armed crash point met a request
    before the health check did) is noted and left to the supervisor."""
    try:
        await asyncio.to_thread(cluster.start, replica, crash_at)
    except RuntimeError as exc:
        cluster.note("start_failed", replica.index, error=str(exc)[-300:])


async def _apply(cluster: Cluster, replica: Replica, fault: Fault) -> None:
    if fault.kind == "kill":
        cluster.kill(replica)
        await asyncio.sleep(fault.seconds)
        await _start(cluster, replica)
    elif fault.kind == "crash_at":
        cluster.kill(replica)
        await _start(cluster, replica, fault.point)
    elif fault.kind == "stop":
        cluster.signal(replica, signal.SIGSTOP)
        await asyncio.sleep(fault.seconds)
        cluster.signal(replica, signal.SIGCONT)
    elif fault.kind == "restart":
        await asyncio.to_thread(cluster.stop, replica)
        await _start(cluster, replica)
    elif fault.kind == "disk_full":
        filler = await asyncio.to_thread(cluster.fill_disk)
        await asyncio.sleep(fault.seconds)
        if filler is not None:
            cluster.free_disk(filler)
    elif fault.kind == "read_only":
        await _read_only(cluster, fault.seconds)
    elif fault.kind == "pg_outage":
        await asyncio.to_thread(cluster.pg_stop, fault.point or "fast")
        await asyncio.sleep(fault.seconds)
        await asyncio.to_thread(cluster.pg_start)


async def _read_only(cluster: Cluster, seconds: float) -> None:
    """Make the SQLite ledger read-only for ``seconds``, with every replica down meanwhile.

    Linux refuses to remount a filesystem read-only while a file on it is open for
    writing, and a running replica always holds the ledger so: every replica is
    SIGKILLed first. Each is started once on the read-only ledger (``serve`` refuses
    to start then: noted ``start_failed``), and again once the ledger is writable.
    """
    for replica in cluster.replicas:
        cluster.kill(replica)
    if await asyncio.to_thread(cluster.remount, "ro"):
        for replica in cluster.replicas:
            await _start(cluster, replica)
        await asyncio.sleep(seconds)
        await asyncio.to_thread(cluster.remount, "rw")
    for replica in cluster.replicas:
        if not replica.alive():
            await _start(cluster, replica)


async def _supervise(cluster: Cluster, locks: dict[int, asyncio.Lock]) -> None:
    """Restart, unarmed, a replica that died by itself (its crash point was hit)."""
    while True:
        await asyncio.sleep(_SUPERVISE_EVERY)
        for replica in cluster.replicas:
            lock = locks[replica.index]
            if replica.alive() or lock.locked():
                continue
            async with lock:
                if replica.proxy is not None:
                    cluster.note("died", replica.index, code=replica.proxy.process.returncode)
                await _start(cluster, replica)


async def quiesce(cluster: Cluster, answers: list[Answer]) -> list[Answer]:
    """Check each replica recovers by itself; then stop everything, start every replica
    clean, wait for recovery, replay keyed 200s."""
    await _note_unrecovered(cluster)
    for replica in cluster.replicas:
        await asyncio.to_thread(cluster.stop, replica)
        cluster.kill(replica)
    await asyncio.to_thread(cluster.restore_clock)
    if cluster.keys is not None:  # the replays need a key no one has revoked
        for root in KEY_ROOTS:
            await asyncio.to_thread(cluster.key_new, f"{root}.end")
    for replica in cluster.replicas:
        await asyncio.to_thread(cluster.start, replica)
    await _wait_recovered(cluster)
    replays = await _replay_keyed(cluster, answers)
    for replica in cluster.replicas:
        await asyncio.to_thread(cluster.stop, replica)
    return replays


async def _note_unrecovered(cluster: Cluster) -> None:
    """Note (``unrecovered``) each running replica that does not answer ``/healthz`` 200
    by itself within a few leases of the last fault: a paused, fenced or disk-starved
    replica must serve again without a restart."""
    deadline = time.monotonic() + cluster.schedule.lease_s * 5 + 10
    async with httpx.AsyncClient(timeout=5) as client:
        for replica in cluster.replicas:
            while replica.alive():
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(replica.url + "/healthz")).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    cluster.note("unrecovered", replica.index)
                    break
                await asyncio.sleep(0.25)


async def _wait_recovered(cluster: Cluster) -> None:
    """Until no call is in flight (dead workers' leases must expire first), or a deadline."""
    deadline = time.monotonic() + cluster.schedule.lease_s * 6 + 10
    async with Ledger.open(cluster.ledger) as ledger:
        while time.monotonic() < deadline:
            if not await ledger.calls(stage="in_flight", limit=1):
                cluster.note("quiet")
                return
            await asyncio.sleep(0.25)
    cluster.note("still_in_flight_at_deadline")


async def _replay_keyed(cluster: Cluster, answers: list[Answer]) -> list[Answer]:
    """Resend each keyed call that got a clean 200, with its key: a replay is due."""
    by_id = {call.id: call for call in cluster.schedule.calls}
    done: set[str] = set()
    replays: list[Answer] = []
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        for answer in answers:
            call = by_id[answer.call]
            if call.key is None or not answer.clean_ok or call.id in done:
                continue
            done.add(call.id)
            replica = cluster.replicas[call.replicas[0]]
            replays.append(
                await send(
                    client,
                    replica.url,
                    call,
                    kind="replay",
                    tag=f"{call.id}.replay",
                    replica=replica.index,
                    retry_count=0,
                    keys=cluster.keys,
                )
            )
    return replays
