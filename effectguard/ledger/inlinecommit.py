"""Group commit on the event loop: the statements of a batch run on the loop thread.

For SQLite a statement costs microseconds and a ``COMMIT`` (one fsync) a few
hundred. Handing batches to a writer thread costs more than that on a busy
core: every hand-off is a GIL round trip and a context switch. Here the batch
runs on the loop thread itself; operations submitted meanwhile form the next
batch. Three things leave the loop for a worker thread: a ``BEGIN IMMEDIATE``
that must wait for another process's write lock (so a locked ledger never
freezes the server), the ``COMMIT`` of a batch of several operations
(its fsync releases the GIL, so the loop serves other requests meanwhile;
measured at 32 concurrent proxy requests: 950 -> 1,330 req/s), and the
operations of a batch holding a bulky one (:func:`~effectguard.ledger.base.bulky`:
an upload's chunks, about 30 ms for 10 MiB). A batch of one
commits inline: the loop has nothing else to do, and the hop would cost
latency. A batch that cannot commit is split and retried, so an operation that
cannot commit fails alone (see :mod:`effectguard.ledger.groupcommit`).

When callers come one at a time (the last :data:`QUIET` batches each held one
operation), an operation submitted to an idle committer commits in the caller's own
step, with no task and no loop iteration in between: at one client that saves two
loop iterations per commit, about 0.05 ms of a request's path each
(docs/performance.md, "One client"). Every :data:`RESAMPLE` such commits one goes
through the batching path again, so a rise in concurrency is seen within that many
commits and batching resumes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from effectguard.errors import LedgerUnavailable
from effectguard.ledger.base import Operation, Orphaned, Tx, Writer, is_bulky
from effectguard.ledger.daemonthreads import DaemonThreads
from effectguard.ledger.groupcommit import (
    MAX_BATCH,
    CommitStats,
    Job,
    Session,
    adopt,
    count_commit,
    fail_all,
    note_outcome,
    record_commit,
    reset,
    resolve_job,
    run_alone,
    run_operation,
    split_retry,
    tell_observers,
)

T = TypeVar("T")

#: Batches of one operation in a row that show callers come one at a time.
QUIET = 4
#: Lone commits in a row before one goes through the batching path again, to see
#: whether callers still come one at a time.
RESAMPLE = 8


class InlineSession(Session, Protocol):
    """A session that can try to start a transaction without waiting."""

    def begin_nowait(self) -> bool:
        """Start a write transaction if the lock is free now; False if it is not."""
        ...

    def maintenance_due(self) -> bool:
        """Whether :meth:`maintain` should run before the next batch."""
        ...

    def maintain(self) -> None:
        """Housekeeping between transactions (run off the loop, between batches)."""
        ...


S = TypeVar("S", bound=InlineSession)


class InlineCommitter(Generic[S]):
    """Batches operations submitted on one event loop into shared commits."""

    def __init__(
        self,
        session_factory: Callable[[], S],
        check_writer: Callable[[Tx, Writer], None],
    ) -> None:
        self._factory = session_factory
        self._check_writer = check_writer
        self._session: S | None = None
        self._pending: list[Job] = []
        self._runner: asyncio.Task[None] | None = None
        self._lock = threading.Lock()
        # A daemon: a program that ends unclosed mid-commit ends as a crash would (the
        # commit is atomic either way), not held up by this thread.
        self._io = DaemonThreads(1, "effectguard-lock")
        self._busy: concurrent.futures.Future[Any] | None = None
        #: Lone commits allowed before the batching path samples concurrency again, and
        #: how many batches in a row held one operation.
        self._lone = 0
        self._lone_batches = 0
        self.stats = CommitStats()

    def start(self) -> None:
        """Open the session (migrations run here)."""
        self._session = self._factory()

    async def submit(self, writer: Writer, op: Operation[T], orphaned: Orphaned | None = None) -> T:
        """Queue ``op``; return its result once its transaction is durable. ``orphaned``
        is told the result if the caller is cancelled meanwhile and ``op`` commits."""
        if self._session is None:
            raise LedgerUnavailable("the ledger writer is not running")
        loop = asyncio.get_running_loop()
        job = Job(writer, op, loop, loop.create_future())
        if self._lone > 0 and self._idle() and not is_bulky(op) and self._commit_lone(job):
            if job.error is not None:
                raise job.error
            result: T = job.result
            return result
        self._pending.append(job)
        if self._runner is None or self._runner.done():
            # Its own task: a cancelled caller never cancels a batch half-way.
            self._runner = loop.create_task(self._drain())
        try:
            answer: T = await job.future
        except asyncio.CancelledError:
            adopt(job, orphaned)
            raise
        return answer

    def _idle(self) -> bool:
        return not self._pending and (self._runner is None or self._runner.done())

    def _commit_lone(self, job: Job) -> bool:
        """Commit ``job`` alone, now, in the caller's step; False (nothing done) if the
        write lock is not free this instant, and the caller queues it as usual."""
        session = self._session
        assert session is not None
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if not session.begin_nowait():
                return False
            self._lone -= 1
            started = time.perf_counter()
            ok = self._end_lone(session, job)
        except Exception as exc:  # the ledger itself refuses (begin): as in _run_locked
            fail_all([job], exc)
            ok, started = False, time.perf_counter()
        finally:
            self._lock.release()
        note_outcome(self.stats, [job], ok)
        elapsed = time.perf_counter() - started
        count_commit(self.stats, 1, elapsed, ok)
        # The metrics wait until the caller's step yields (it dispatches first).
        job.loop.call_soon(tell_observers, self.stats, 1, elapsed, ok)
        if session.maintenance_due():
            # As the runner: operations submitted meanwhile queue, and are drained after.
            self._runner = job.loop.create_task(self._maintain_then_drain())
        return True

    def _end_lone(self, session: S, job: Job) -> bool:
        """Run a begun transaction's one operation and end it (see :meth:`_run_alone`)."""
        try:
            reset([job])
            run_alone(session, job, self._check_writer)
            (session.rollback if job.error is not None else session.commit)()
            self.stats.transactions += 1
            return True
        except BaseException as exc:
            with contextlib.suppress(Exception):
                session.rollback()
            if not isinstance(exc, Exception):
                raise
            split_retry([job], exc, session.fate())  # one operation: it fails alone
            return False

    async def _drain(self) -> None:
        # Let every request that is ready in this loop iteration join the batch.
        await asyncio.sleep(0)
        while self._pending:
            batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
            await self._run_batch(batch)
            if self._pending:
                await asyncio.sleep(0)  # serve I/O between batches
        # Done in the step that resolved the last batch: the next caller finds us idle.

    async def _run_batch(self, batch: list[Job]) -> None:
        session = self._session
        assert session is not None
        started, committed = time.perf_counter(), self.stats.transactions
        ok = False
        # Several event loops may share a store (rare): their batches never overlap.
        with self._lock:
            ok = await self._run_locked(session, batch)
        note_outcome(self.stats, batch, self.stats.transactions > committed)
        record_commit(self.stats, len(batch), time.perf_counter() - started, ok)
        # Lone operations in a row mean callers come one at a time: let the next ones
        # commit in their own step (see the module docstring).
        self._lone_batches = self._lone_batches + 1 if len(batch) == 1 else 0
        self._lone = RESAMPLE if self._lone_batches >= QUIET else 0
        for job in batch:
            _resolve(job)
        if session.maintenance_due():
            await self._maintain()

    async def _maintain_then_drain(self) -> None:
        await self._maintain()
        await self._drain()

    async def _maintain(self) -> None:
        """Housekeeping between batches, off the loop (a checkpoint: see the session)."""
        session = self._session
        assert session is not None
        # If the ledger is really failing, the next batch reports it.
        with self._lock, contextlib.suppress(Exception):
            await asyncio.get_running_loop().run_in_executor(self._io, session.maintain)

    async def _run_locked(self, session: S, batch: list[Job]) -> bool:
        try:
            if not session.begin_nowait():  # another process writes: wait off the loop
                await self._off_loop(session.begin)
        except Exception as exc:  # the ledger itself refuses: no operation is to blame
            fail_all(batch, exc)
            return False
        except BaseException:
            # Cancelled while the thread waits for the lock (the loop's teardown cancels
            # this task): the thread may still begin. Left open, that transaction made
            # every later batch fail ("cannot start a transaction within a transaction"),
            # the markings of the calls a second signal cuts off among them.
            self._wait_for_thread()
            with contextlib.suppress(Exception):
                session.rollback()
            raise
        try:
            reset(batch)
            # A bulky operation (an upload's chunks) runs off the loop, like an fsync.
            off_loop = any(is_bulky(job.op) for job in batch)
            if len(batch) == 1:
                await self._run_alone(session, batch[0], off_loop)
                return True
            if off_loop:
                await self._off_loop(self._run_all, session, batch)
            else:
                self._run_all(session, batch)
            # Requests are waiting on the loop: let them run while the fsync does.
            await self._off_loop(session.commit)
            self.stats.transactions += 1
            return True
        except BaseException as exc:
            self._wait_for_thread()
            with contextlib.suppress(Exception):
                session.rollback()
            if not isinstance(exc, Exception):  # cancelled: no transaction is left open
                raise
            halves = split_retry(batch, exc, session.fate())
        # Both halves run (a list, not a short-circuiting generator): each op gets its answer.
        return bool(halves) and all([await self._run_locked(session, half) for half in halves])

    async def _run_alone(self, session: S, job: Job, off_loop: bool) -> None:
        """One operation alone in its transaction: no savepoint; if it fails, the
        transaction is rolled back instead of committed. Inline on a quiet loop (a thread
        hop would only add latency), unless it is bulky: then its commit, which fsyncs
        the upload's pages, leaves the loop too."""
        if off_loop:
            await self._off_loop(run_alone, session, job, self._check_writer)
        else:
            run_alone(session, job, self._check_writer)
        end = session.rollback if job.error is not None else session.commit
        if off_loop:
            await self._off_loop(end)
        else:
            end()
        self.stats.transactions += 1

    async def _off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the I/O thread. Remembered: a batch cancelled meanwhile waits
        for it before rolling back, so two threads never use the connection at once."""
        self._busy = self._io.submit(fn, *args)
        return await asyncio.wrap_future(self._busy)

    def _wait_for_thread(self) -> None:
        busy, self._busy = self._busy, None
        if busy is not None and not busy.done():
            concurrent.futures.wait([busy])

    def _run_all(self, session: S, batch: list[Job]) -> None:
        for job in batch:
            run_operation(session, job, self._check_writer)

    async def aclose(self) -> None:
        """Finish queued work, then close."""
        while self._runner is not None and not self._runner.done():
            await asyncio.wait({self._runner})
        if self._session is not None:
            with contextlib.suppress(Exception):
                self._session.close()
            self._session = None
        # Not shutdown(wait=True): that join is unbounded, and blocks this loop.
        self._io.shutdown(wait=False)
        await self._io.ended()


def _resolve(job: Job) -> None:
    if job.loop is not asyncio.get_running_loop():  # submitted from another loop's thread
        with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits
            job.loop.call_soon_threadsafe(resolve_job, job)
        return
    resolve_job(job)
