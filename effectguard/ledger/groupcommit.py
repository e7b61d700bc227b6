"""Group commit: many concurrent write operations, one durable commit.

One writer thread owns the write connection. Callers queue operations; the
thread takes every operation waiting, runs them in ONE transaction (each inside
its own savepoint, so one failing operation does not undo the others), commits
(one fsync for the batch), and only then resolves each caller's future. A
caller that is cancelled while waiting does not disturb the batch: its
operation still runs or has run, and the writer never blocks on it.

Isolation: some failures surface only when the transaction as a whole is sent
or committed (a value a column cannot hold, a constraint checked at commit, a
buffered write the server refuses). Such a failure cannot be pinned on one
operation, so the batch is split in halves and each half retried in a
transaction of its own, down to single operations: the operation that cannot
commit fails alone, and every other one commits exactly as if it had been
alone (:func:`split_retry`). A store whose failed commit may have committed
after all (a lost connection) finds out which it was (:meth:`Session.fate`): a batch
that committed is answered with what it did; one that did not is run once more, whole,
on a fresh connection; and one whose fate cannot be learnt is failed, never run twice:
running an operation twice would be worse than failing it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar

from effectguard.errors import LedgerUnavailable
from effectguard.ledger.base import Operation, Orphaned, Tx, Writer, probe
from effectguard.ledger.daemonthreads import join_ended, threads_ended

T = TypeVar("T")
S = TypeVar("S", bound="Session")

log = logging.getLogger("effectguard.ledger")

MAX_BATCH = 512

#: What became of a transaction that failed (see :meth:`Session.fate`).
Fate = Literal["refused", "lost", "committed", "unknown"]


class Session(Tx, Protocol):
    """A write connection's transaction control, on top of table access."""

    def begin(self) -> None:
        """Start a write transaction (taking the database's write lock)."""
        ...

    def commit(self) -> None:
        """Commit durably."""
        ...

    def rollback(self) -> None:
        """Abandon the transaction."""
        ...

    def savepoint(self) -> None:
        """Open a savepoint for one operation."""
        ...

    def release(self) -> None:
        """Keep the operation's writes."""
        ...

    def rollback_to(self) -> None:
        """Undo the operation's writes."""
        ...

    def close(self) -> None:
        """Close the connection."""
        ...

    def fate(self) -> Fate:
        """After a failed transaction (rolled back), what became of it:

        * ``refused``: the store refused it and it did not commit (an operation may be
          to blame: the batch is split to find it);
        * ``lost``: the connection was lost, and a fresh one proved it did not commit
          (nobody is to blame: the batch may run again, whole, on the fresh connection);
        * ``committed``: the connection was lost after its ``COMMIT``, which took effect;
        * ``unknown``: it may have committed, and nothing could tell.
        """
        ...


@dataclass(slots=True)
class Job:
    writer: Writer
    op: Operation[Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    result: Any = None
    error: BaseException | None = None
    #: Told the result if the caller was cancelled and the operation committed anyway.
    orphaned: Orphaned | None = None
    #: Its outcome was handed over (:func:`resolve_job`): whoever adopts it later is told
    #: now, since nothing will hand it over again.
    resolved: bool = False


@dataclass
class CommitStats:
    """Counters a benchmark or metrics collector can read."""

    commits: int = 0
    operations: int = 0
    failed_commits: int = 0
    last_batch: int = 0
    commit_seconds: float = 0.0
    #: Transactions that ended as intended: committed, or rolled back because their one
    #: operation refused itself (a batch that had to be split runs several).
    transactions: int = 0
    #: Whether the last batch holding a real operation (not only probes) committed any of
    #: it. A batch where one operation failed alone still proves the ledger works.
    last_ok: bool = True
    observers: list[Callable[[int, float, bool], None]] = field(default_factory=list)


class GroupCommitter(Generic[S]):
    """Runs write operations on one thread, batching them into shared commits."""

    def __init__(
        self,
        session_factory: Callable[[], S],
        check_writer: Callable[[Tx, Writer], None],
        name: str = "effectguard-writer",
    ) -> None:
        self._factory = session_factory
        self._check_writer = check_writer
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self.stats = CommitStats()

    def start(self) -> None:
        """Open the session on the writer thread; raise if it cannot open."""
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error

    async def submit(self, writer: Writer, op: Operation[T], orphaned: Orphaned | None = None) -> T:
        """Queue ``op``; return its result once its transaction is durable. ``orphaned``
        is told the result if the caller is cancelled meanwhile and ``op`` commits."""
        loop = asyncio.get_running_loop()
        job = Job(writer, op, loop, loop.create_future())
        if not self._thread.is_alive():
            raise LedgerUnavailable("the ledger writer is not running")
        self._queue.put(job)
        try:
            result: T = await job.future
        except asyncio.CancelledError:
            adopt(job, orphaned)
            raise
        return result

    def stop(self) -> None:
        """Finish queued work and close the session; wait for that at most
        :data:`~effectguard.ledger.daemonthreads.END_WAIT_S` (blocking)."""
        if self._thread.is_alive():
            self._queue.put(None)
            join_ended([self._thread])

    async def aclose(self) -> None:
        """:meth:`stop` without blocking the loop. A writer stuck in a round trip with a
        database that stopped answering is left to end when that call returns (it is a
        daemon: the process may exit first, as after a crash, and the next sweeper settles
        what it was committing); a close waiting for it with no bound hung shutdown past
        any orchestrator's stop timeout."""
        if self._thread.is_alive():
            self._queue.put(None)
            await threads_ended([self._thread])

    # -- the writer thread -------------------------------------------------
    def _run(self) -> None:
        try:
            session = self._factory()
        except BaseException as exc:
            self._startup_error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            stopping = False
            while not stopping:
                first = self._queue.get()
                if first is None:
                    break
                batch = [first]
                while len(batch) < MAX_BATCH:
                    try:
                        nxt = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if nxt is None:
                        stopping = True
                        break
                    batch.append(nxt)
                self._run_batch(session, batch)
        finally:
            with contextlib.suppress(Exception):
                session.close()

    def _run_batch(self, session: S, batch: list[Job]) -> None:
        started, committed = time.perf_counter(), self.stats.transactions
        ok = self._commit_isolated(session, batch)
        note_outcome(self.stats, batch, self.stats.transactions > committed)
        record_commit(self.stats, len(batch), time.perf_counter() - started, ok)
        # One wake-up per event loop per batch, not one per job.
        by_loop: dict[asyncio.AbstractEventLoop, list[Job]] = {}
        for job in batch:
            by_loop.setdefault(job.loop, []).append(job)
        for loop, jobs in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits
                loop.call_soon_threadsafe(_resolve_all, jobs)

    def _commit_isolated(self, session: S, batch: list[Job], again: bool = True) -> bool:
        """Commit ``batch``; if it cannot commit, retry its halves (see :func:`split_retry`),
        or the whole batch once (``again``) when a lost connection is proved to have
        committed none of it."""
        try:
            session.begin()
        except Exception as exc:  # the ledger itself refuses: no operation is to blame
            fail_all(batch, exc)
            return False
        try:
            reset(batch)
            for job in batch:
                self._run_one(session, job)
            session.commit()
            self.stats.transactions += 1
            return True
        except Exception as exc:
            with contextlib.suppress(Exception):
                session.rollback()
            fate = session.fate()
            if fate == "committed":  # what each operation did is what was committed
                log.warning("ledger connection lost after COMMIT; the batch had committed")
                self.stats.transactions += 1
                return True
            if fate == "lost" and again:
                log.warning("ledger connection lost; the batch had not committed: run again")
                return self._commit_isolated(session, batch, again=False)
            halves = split_retry(batch, exc, fate)
        # Both halves run (a list, not a short-circuiting generator): each op gets its answer.
        return bool(halves) and all([self._commit_isolated(session, half) for half in halves])

    def _run_one(self, session: S, job: Job) -> None:
        run_operation(session, job, self._check_writer)


def reset(batch: list[Job]) -> None:
    """Forget what an earlier, rolled-back try of these jobs produced."""
    for job in batch:
        job.result = job.error = None


def note_outcome(stats: CommitStats, batch: list[Job], ok: bool) -> None:
    """Remember whether a batch committed anything, unless it held only probes."""
    if any(job.op is not probe for job in batch):
        stats.last_ok = ok


def fail_all(batch: list[Job], exc: Exception) -> None:
    """Fail every job of ``batch`` with ``exc`` as a :class:`LedgerUnavailable`."""
    failure = LedgerUnavailable(f"ledger transaction failed: {exc}")
    failure.__cause__ = exc
    for job in batch:
        job.error = failure


def split_retry(batch: list[Job], exc: Exception, fate: Fate) -> list[list[Job]]:
    """The halves of a batch whose transaction failed, to retry; [] when none may be retried.

    A single operation's failure is its own (it gets ``exc``); a batch the store did not
    refuse (its connection was lost, whatever became of it) fails as a whole: the
    operations are not rerun, and none of them is to blame.
    """
    if len(batch) == 1 or fate != "refused":
        fail_all(batch, exc)
        return []
    mid = len(batch) // 2
    return [batch[:mid], batch[mid:]]


def run_operation(session: Session, job: Job, check_writer: Callable[[Tx, Writer], None]) -> None:
    """Run one job in its own savepoint: a failure undoes only this operation."""
    session.savepoint()
    try:
        run_alone(session, job, check_writer)
    except BaseException:
        session.rollback_to()
        session.release()
        raise
    if job.error is not None:
        session.rollback_to()
    session.release()


def run_alone(session: Session, job: Job, check_writer: Callable[[Tx, Writer], None]) -> None:
    """Run a job; an exception becomes ``job.error`` and the caller undoes its writes."""
    try:
        check_writer(session, job.writer)
        job.result = job.op(session)
    except Exception as exc:
        job.error = exc


def record_commit(stats: CommitStats, size: int, elapsed: float, ok: bool) -> None:
    """Count one commit and tell the observers (metrics)."""
    count_commit(stats, size, elapsed, ok)
    tell_observers(stats, size, elapsed, ok)


def count_commit(stats: CommitStats, size: int, elapsed: float, ok: bool) -> None:
    """Count one commit in ``stats``."""
    stats.commits += 1
    stats.operations += size
    stats.last_batch = size
    stats.commit_seconds += elapsed
    if not ok:
        stats.failed_commits += 1


def tell_observers(stats: CommitStats, size: int, elapsed: float, ok: bool) -> None:
    """Tell the observers (metrics) of one commit."""
    for observer in stats.observers:
        observer(size, elapsed, ok)


def _resolve_all(jobs: list[Job]) -> None:
    for job in jobs:
        resolve_job(job)


def adopt(job: Job, orphaned: Orphaned | None) -> None:
    """The caller of ``job`` was cancelled: ``orphaned`` gets its result instead (the
    operation runs or has run anyway: a cancelled caller never stops a batch)."""
    if orphaned is None:
        return
    if not job.resolved:
        job.orphaned = orphaned  # resolve_job hands it over
    elif job.error is None:
        # Resolved before this caller's step ran: answered, then cancelled before it
        # resumed; or cancelled (its future with it) just before the batch that ran it
        # resolved, which found no one to tell yet. Either way it committed.
        orphaned(job.result)


def resolve_job(job: Job) -> None:
    """Hand a finished job's result or error to its caller (on the caller's loop)."""
    job.resolved = True
    if job.future.done():  # the caller was cancelled; its operation ran anyway
        if job.orphaned is not None and job.error is None:
            job.orphaned(job.result)
        return
    if job.error is not None:
        job.future.set_exception(job.error)
    else:
        job.future.set_result(job.result)
