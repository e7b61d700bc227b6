"""Workers, leases and the recovery sweeper (docs/contract.md §7).

Every writing process is a :class:`WorkerRuntime`: it registers with the ledger
(taking a fresh fencing generation), holds an OS file lock that proves it is
alive on this host, renews its lease with a heartbeat, and sweeps: on start and
periodically it takes over workers that are dead — lease expired by the
ledger's clock, or, on this host, their lock is free — and marks their in-flight
attempts ``attempt.interrupted``.

A worker that was itself taken over (paused past its lease, say) learns it when
the store refuses its heartbeat. It then registers anew: a fresh worker id and
a new fencing generation. Everything of the old registration stays refused by
the store; only calls admitted from then on are written as the new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import socket
import time
import uuid
import weakref
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import IO, BinaryIO

from effectguard.callpath.hostlocks import pg_lock_dir
from effectguard.callpath.liveness import provably_dead, remove_if_free
from effectguard.callpath.repeating import Repeating
from effectguard.config import defaults
from effectguard.errors import FencedError, LedgerError, LedgerUnavailable
from effectguard.ledger import Ledger, Writer, operations

log = logging.getLogger("effectguard.callpath.recovery")


def lock_dir_for(ledger_url: str) -> Path | None:
    """Where workers of the ledger at ``ledger_url`` keep their liveness locks (None: none
    here): beside a file ledger; for PostgreSQL, in a directory of this host
    (:mod:`effectguard.callpath.hostlocks`)."""
    if ledger_url.startswith(("postgresql://", "postgres://")):
        return pg_lock_dir()
    if ledger_url.startswith("sqlite:///"):
        from effectguard.ledger.sqlite import sqlite_path

        return Path(sqlite_path(ledger_url) + ".workers")
    if "://" in ledger_url:
        return None
    return Path(ledger_url + ".workers")


def lock_required(ledger_url: str) -> bool:
    """Whether a worker of the ledger at ``ledger_url`` must hold its liveness lock to
    start. Beside a file ledger, yes: a filesystem that refuses it refuses the ledger too.
    On PostgreSQL, no: the lock only spares a restart on this host the wait for the
    lease, so a directory that refuses it leaves the lease alone to tell (one warning)."""
    return not ledger_url.startswith(("postgresql://", "postgres://"))


#: How long a clean stop waits for the ledger to tell whether its worker left calls in
#: flight (its lock file is then kept for the next sweeper, see WorkerRuntime.stop).
STOP_READ_S = 5.0

#: The workers of this process holding a liveness lock, for :func:`_drop_inherited_locks`.
_LOCK_HOLDERS: weakref.WeakSet[WorkerRuntime] = weakref.WeakSet()
_AT_FORK: list[bool] = []  # registered once, at the first lock (no work at import)


def _drop_inherited_locks() -> None:
    """In a child just forked: close its copies of the parent's lock files.

    A flock belongs to the open file, shared by every descriptor of it in every process,
    so a long-lived child (a ``multiprocessing`` helper) that kept its copy kept the
    lock: a restart after the parent crashed found it held and waited for the whole
    lease instead of taking over at once (docs/contract.md §7). Closing the copy here
    leaves the parent's lock held by the parent; unlocking would release it for both.
    """
    for worker in list(_LOCK_HOLDERS):
        worker.forget_lock()


def take_lock(path: Path) -> BinaryIO:
    """Make the worker's lock file and lock it: the handle that holds it.

    A sweeper removes a lock file only while it holds it (``remove_if_free``), so a file
    removed between its making and its locking would leave this process holding a lock
    nobody can see: locked, it is checked to be still the file of its name, else made
    again."""
    for _ in range(3):
        handle = _new_lock(path)
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino:
                return handle
        handle.close()
    raise LedgerUnavailable(f"the worker lock {path} was removed as it was made")


def _new_lock(path: Path) -> BinaryIO:
    """Create the worker's lock file (beside a file ledger), owner-only like the ledger.

    It lives on the ledger's filesystem, so a filesystem that refuses it (read-only, full)
    is the ledger unavailable, as a write the ledger refuses is: ``reconcile``, which
    registers to take over a gone worker, exits 4 then, not with a traceback."""
    try:
        # Each directory made owner-only (``parents=True`` would make all but the last
        # with the umask's mode): a PostgreSQL ledger's per-boot one is two levels deep.
        for folder in reversed([path.parent, *path.parent.parents]):
            if not folder.exists():
                folder.mkdir(mode=0o700, exist_ok=True)
        # Close-on-exec (also Python's default), so no program it runs holds it either.
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        return os.fdopen(os.open(path, flags, 0o600), "wb")
    except OSError as exc:
        raise LedgerUnavailable(f"cannot make the worker lock {path}: {exc.strerror}") from exc


class WorkerRuntime:
    """This process as a ledger writer: registration, lock, heartbeat, sweeper."""

    def __init__(
        self,
        ledger: Ledger,
        *,
        lock_dir: Path | None,
        lease_s: float = defaults.LEASE_S,
        heartbeat_s: float = defaults.HEARTBEAT_S,
        sweep_s: float = defaults.SWEEP_S,
        host: str | None = None,
        lock_required: bool = True,
    ) -> None:
        self.ledger = ledger
        self.lock_dir = lock_dir
        #: False (PostgreSQL): a lock that cannot be made is done without (lease only).
        self.lock_required = lock_required
        self.lease_s = lease_s
        self.heartbeat_s = heartbeat_s
        self.sweep_s = sweep_s
        self.host = host or socket.gethostname()
        #: The current registration's worker id (each registration takes a fresh one).
        self.worker_id = ""
        self.writer: Writer | None = None
        self._lock_file: IO[bytes] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._rejoining = asyncio.Lock()
        #: Run after every periodic sweep (e.g. the guard's retry of failed markings).
        self.after_sweep: list[Callable[[], Awaitable[None]]] = []
        #: Run with the new writer when a fenced worker has registered anew.
        self.after_rejoin: list[Callable[[Writer], None]] = []
        #: Each live worker's lease expiry as the previous sweep saw it (see sweep());
        #: None before the first sweep, which has nothing to compare with.
        self._leases_seen: dict[str, float] | None = None

    async def start(self) -> Writer:
        """Register, lock, sweep once, and start the heartbeat and sweeper tasks."""
        writer = await self.register()
        await self.run()
        return writer

    async def register(self) -> Writer:
        """Register and lock, nothing more: hooks that need the writer (the guard's
        ``after_sweep``) can be attached before :meth:`run` sweeps for the first time."""
        return await self._register()

    async def run(self) -> None:
        """Sweep once (with every ``after_sweep`` hook), then heartbeat and sweep on."""
        await self.sweep()
        self._tasks = [
            asyncio.create_task(self._every(self.heartbeat_s, self.heartbeat)),
            asyncio.create_task(self._every(self.sweep_s, self.sweep)),
        ]

    async def _register(self) -> Writer:
        """Take a fresh worker id, its liveness lock, and a new fencing generation."""
        self.worker_id = f"{self.host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._lock()
        boot = Writer(self.worker_id, 0)
        try:
            self.writer = await self.ledger.store.write(
                boot,
                lambda tx: operations.register_worker(
                    tx, worker=self.worker_id, host=self.host, pid=os.getpid(), lease_s=self.lease_s
                ),
            )
        except BaseException:
            self._release_lock(unlink=True)  # no row names it: no sweeper would remove it
            raise
        return self.writer

    def _lock(self) -> None:
        """Take this registration's liveness lock, or (a lock not required) go without."""
        if self.lock_dir is None:
            return
        try:
            handle = take_lock(self.lock_dir / f"{self.worker_id}.lock")
        except LedgerUnavailable as exc:
            if self.lock_required:
                raise
            log.warning(
                "%s; workers here are known gone by their lease alone",
                exc,
                extra={"event": "host_lock_unavailable", "worker": self.worker_id},
            )
            self.lock_dir = None  # for good: one warning, and no file looked for again
            return
        self._lock_file = handle
        _LOCK_HOLDERS.add(self)
        if not _AT_FORK:
            os.register_at_fork(after_in_child=_drop_inherited_locks)
            _AT_FORK.append(True)

    async def _every(self, seconds: float, job: Callable[[], Awaitable[object]]) -> None:
        name = getattr(job, "__name__", str(job))
        # A refusal that lasts (a ledger a newer release migrated refuses every heartbeat
        # until the process is replaced) is said when it starts, at most once a minute, and
        # when it ends: not at every turn, which buried every other line.
        busy = Repeating()
        while True:
            await asyncio.sleep(seconds)
            writer = self.writer
            try:
                await job()
            except FencedError as exc:
                try:
                    await self._rejoin(writer, exc)
                except LedgerError as again:
                    log.warning("worker could not register anew (%s); retrying", again)
                continue
            except LedgerError as exc:
                now = time.monotonic()
                if busy.failed(now):
                    held = busy.lasted(now)
                    still = f" (still, for {held:.0f} s)" if held else ""
                    extra = {"event": "ledger_busy", "job": name}
                    log.warning("ledger busy in %s: %s%s", name, exc, still, extra=extra)
                continue
            lasted = busy.worked(time.monotonic())
            if lasted is not None:
                extra = {"event": "ledger_busy_ended", "job": name}
                log.warning("ledger answers %s again, after %.0f s", name, lasted, extra=extra)

    async def _rejoin(self, fenced: Writer | None, exc: FencedError) -> None:
        """Register anew if ``fenced`` (the writer the store refused) is still ours.

        The old registration stays fenced: the store refuses whatever it would still
        write (late results of calls it dispatched answer 502 ``observe_refused``).
        """
        async with self._rejoining:
            if fenced is None or fenced != self.writer:
                return  # the other loop has registered anew already
            if not await self._is_fenced(fenced):
                raise LedgerError(f"worker {fenced.worker} refused but not fenced: {exc}")
            log.error(
                "worker %s (generation %d) was fenced: %s; registering anew",
                fenced.worker,
                fenced.generation,
                exc,
                extra={"event": "fenced", "worker": fenced.worker},
            )
            self._release_lock(unlink=True)  # the old id is dead for good
            writer = await self._register()
            log.warning(
                "registered anew as worker %s (generation %d)",
                writer.worker,
                writer.generation,
                extra={"event": "registered", "worker": writer.worker},
            )
            for hook in self.after_rejoin:
                hook(writer)

    async def writer_after_refusal(self, refused: Writer) -> Writer:
        """A registration of this process the store accepts now, after it refused ``refused``.

        The current registration: ``refused`` itself if it is not fenced (the store refused
        the write for another reason), else the one that replaced it, registered now if the
        heartbeat has not noticed the fence yet. Used to keep a fenced registration's late
        answer as evidence without writing as that registration (docs/contract.md §7).
        """
        if refused == self.writer and await self._is_fenced(refused):
            await self._rejoin(refused, FencedError(f"worker {refused.worker} was fenced"))
        return self._writer()

    async def _is_fenced(self, writer: Writer) -> bool:
        """Whether the ledger refuses ``writer`` for good (taken over, or re-registered)."""
        rows = {row.worker: row for row in await self.ledger.store.live_workers()}
        row = rows.get(writer.worker)  # None: fenced (a fence is for good), or never seen
        return row is None or row.generation != writer.generation

    async def heartbeat(self) -> None:
        """Renew the lease (the store refuses a fenced worker)."""
        await self.ledger.store.renew_lease(self._writer(), self.lease_s)

    async def sweep(self) -> list[str]:
        """Take over dead workers; returns the calls marked interrupted.

        Normally one transaction fences the dead workers and marks their calls. If it
        cannot commit, the workers are fenced alone and each of their calls is marked
        in a transaction of its own (:meth:`_mark_stranded`, which every sweep runs):
        a call whose marking cannot commit is retried on every sweep and blocks no
        other, and a restart never fails because of one call.
        """
        writer = self._writer()
        # Only the live workers: the table keeps every worker ever registered (each start
        # of serve, each process with a transport), and a sweep that read it whole cost
        # every replica, every sweep_s, time on its event loop growing without end (200,000
        # old rows: a sixth of a core idle, requests held up 1.6 s).
        rows = await self.ledger.store.live_workers()
        dead = frozenset(provably_dead(rows, self.lock_dir, self.host, self.worker_id))
        # A lease lapses by the ledger's clock, which NTP or a resumed VM may step forward
        # past every live worker's lease at once. Only a worker whose lease this sweeper saw
        # unchanged a sweep ago (no heartbeat in between) is taken over for its lease. The
        # start-up sweep has seen nothing: it takes a lapsed lease at its word, so a replica
        # restarted after a crash recovers its predecessor's calls at once, not a sweep later
        # (a start within one heartbeat of a forward step is the window that remains).
        still, self._leases_seen = self._leases_seen, {r.worker: r.lease_expires for r in rows}
        try:
            interrupted = await self.ledger.store.write(
                writer, lambda tx: operations.sweep(tx, writer, dead, held_still=still)
            )
        except FencedError:
            raise
        except LedgerError as exc:
            # Said once the fallback worked: when it fails too (a ledger refusing every
            # write), the sweeper's own line says so, once, not this one every sweep.
            await self.ledger.store.write(
                writer,
                lambda tx: operations.sweep(
                    tx, writer, dead, interrupt_calls=False, held_still=still
                ),
            )
            log.warning("sweep could not commit as one transaction (%s); call by call", exc)
            interrupted = []
        interrupted += await self._mark_stranded(writer)
        for worker in dead:
            if self.lock_dir is not None:
                remove_if_free(self.lock_dir, worker)
        for hook in self.after_sweep:
            await hook()
        _log_sweep(dead, interrupted)
        return interrupted

    async def _mark_stranded(self, writer: Writer) -> list[str]:
        """Mark interrupted, one transaction each, the in-flight calls of fenced workers."""
        in_flight = await self.ledger.calls(stage="in_flight")
        if not in_flight:
            return []
        # Read after the calls: a worker not live now was fenced (for good) since it
        # admitted its call. Read before, a worker registered in between would look fenced.
        live = {row.worker for row in await self.ledger.store.live_workers()}
        stranded = [c for c in in_flight if c.worker not in live]
        # Submitted together they share commits; a call that cannot commit fails alone.
        results = await asyncio.gather(
            *(
                self.ledger.interrupt(writer, c.call_id, c.attempts, f"worker {c.worker} fenced")
                for c in stranded
            ),
            return_exceptions=True,
        )
        marked = []
        for call, result in zip(stranded, results, strict=True):
            if isinstance(result, FencedError):
                raise result
            if isinstance(result, BaseException):
                log.warning("call %s could not be marked interrupted: %s", call.call_id, result)
            elif result.stage == "effect_unknown":
                marked.append(call.call_id)
        return marked

    def _writer(self) -> Writer:
        if self.writer is None:
            raise LedgerError("worker not started")
        return self.writer

    async def stop(self) -> None:
        """Stop heartbeats and release the lock (leaving the row for the next sweeper)."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        # A worker that leaves calls in flight (a drain cut short) keeps its file: the
        # next sweeper on this host finds it free, takes those calls over at once
        # instead of waiting for the lease, and removes it. One that leaves none removes
        # it (nothing waits on its lease), else a file stayed per start for good.
        self._release_lock(unlink=await self._left_nothing())

    async def _left_nothing(self) -> bool:
        """Whether the ledger says, in time, that no call of this worker is in flight."""
        if self._lock_file is None or self.writer is None:
            return False
        limit = 1000
        try:
            calls = await asyncio.wait_for(
                self.ledger.calls(stage="in_flight", limit=limit), STOP_READ_S
            )
        except Exception:  # unavailable, slow, closed: unsure, so kept (a stop never fails)
            return False
        return len(calls) < limit and all(c.worker != self.worker_id for c in calls)

    def forget_lock(self) -> None:
        """Close this process's handle on the lock without unlocking it: in a forked
        child, the lock is still the parent's, held through the parent's handle."""
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    def _release_lock(self, *, unlink: bool) -> None:
        if self._lock_file is None:
            return
        if unlink and self.lock_dir is not None:
            with contextlib.suppress(OSError):
                (self.lock_dir / f"{self.worker_id}.lock").unlink()
        self._lock_file.close()
        self._lock_file = None


def _log_sweep(dead: frozenset[str], interrupted: list[str]) -> None:
    """One line per worker taken over, one per call the sweep marked effect unknown."""
    for worker in sorted(dead):
        # Info, not a warning: a worker whose clean stop left calls in flight is taken over
        # the same way at the next start. What a crash costs is the calls below.
        log.info(
            "took over worker %s: its process is gone",
            worker,
            extra={"event": "takeover", "worker": worker},
        )
    for call_id in interrupted:
        log.warning(
            "sweep marked call %s effect_unknown (its worker is gone)",
            call_id,
            extra={"event": "sweep", "call_id": call_id},
        )
