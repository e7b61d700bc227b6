"""A small pool of daemon worker threads: where blocking calls leave the event loop.

The ledger's reads, its waits for another process's write lock and its batched fsyncs,
and a sync inner transport's sends and reads, each block a thread. They used to run on
``concurrent.futures.ThreadPoolExecutor``, whose rules for the interpreter's exit do not
fit a library that a program may forget to close:

* **Its threads are joined at exit.** A program that returned (or took Ctrl-C) mid-call
  without closing its transport waited for the provider's answer, up to
  ``upstream_read_timeout_s`` (600 s), and the answer was not even recorded: the loop
  that would record it had stopped. With daemon threads the process ends at once, as a
  crash does, and the call stays in flight for the next start to mark
  ``effect_unknown`` (docs/contract.md §3.8, "A program that ends without closing").
* **It refuses new work once the interpreter begins to exit**, before the non-daemon
  threads are joined, so a worker thread still calling after the main thread returned
  got ``RuntimeError`` from every call; and merely importing it then failed (it
  registers an exit hook, which cannot be done once the exit began). Plain httpx works
  there, and so does this pool.

:class:`DaemonThreads` is an :class:`~concurrent.futures.Executor` (``loop.
run_in_executor`` takes it) with the semantics the callers rely on: at most
``max_threads`` threads, started only when no thread is idle; work queued before
:meth:`shutdown` still runs; ``shutdown(wait=False)`` leaves threads to finish what they
are doing (a read abandoned with its upstream) and end. A pool dropped without shutdown
ends its idle threads too. The ledger's writer thread
(:class:`~effectguard.ledger.groupcommit.GroupCommitter`) is a daemon for the same
reasons, but it is one loop that owns its connection and batches, not a pool.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger("effectguard.ledger.daemonthreads")

#: How long a close waits for a pool's threads to end after :meth:`DaemonThreads.shutdown`
#: (a bound only a thread stuck in a blocking call reaches: it is then named in a warning).
END_WAIT_S = 10.0

#: A queued call: the future it answers, and what to call.
_Job = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class DaemonThreads(Executor):
    """Runs callables on up to ``max_threads`` daemon threads named ``{name}_{n}``."""

    def __init__(self, max_threads: int, name: str) -> None:
        if max_threads < 1:
            raise ValueError("max_threads must be at least 1")
        self._max = max_threads
        self._name = name
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        # Released by a thread each time it finishes a job, taken by submit() before it
        # starts a thread: as ThreadPoolExecutor does, a rough count of idle threads.
        self._idle = threading.Semaphore(0)
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._shut = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Queue ``fn(*args, **kwargs)``; its future. ``RuntimeError`` after shutdown."""
        with self._lock:
            if self._shut:
                raise RuntimeError(f"{self._name}: cannot run new work after shutdown")
            future: Future[T] = Future()
            self._jobs.put((future, fn, args, kwargs))
            if not self._idle.acquire(timeout=0) and len(self._threads) < self._max:
                self._start_thread()
        return future

    def _start_thread(self) -> None:
        # The thread holds only a weak reference to the pool: a pool dropped unclosed
        # wakes its threads with the end marker, and they end.
        jobs = self._jobs
        pool = weakref.ref(self, lambda _: jobs.put(None))
        thread = threading.Thread(
            target=_work,
            args=(pool, jobs, self._idle),
            name=f"{self._name}_{len(self._threads)}",
            daemon=True,
        )
        thread.start()
        self._threads.append(thread)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Refuse new work; the threads end once the work queued before is done (with
        ``cancel_futures``, work not yet started is cancelled). ``wait``: wait for them."""
        with self._lock:
            self._shut = True
            if cancel_futures:
                self._cancel_queued()
            self._jobs.put(None)  # each thread passes it on as it ends
        if wait:
            for thread in self._threads:
                if thread is not threading.current_thread():
                    thread.join()

    async def ended(self, timeout: float = END_WAIT_S) -> None:
        """After :meth:`shutdown`: wait, without blocking the loop, until every thread has
        ended, for at most ``timeout``; warn naming each one still running then.

        A transport's close returns only once its threads have ended: a program may fork
        after it (docs/contract.md §1.2), and a thread still running then may hold a lock
        (OpenSSL's, the allocator's) that the child inherits held, and hangs on."""
        await threads_ended(self._threads, timeout)

    def _cancel_queued(self) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job[0].cancel()


async def threads_ended(threads: list[threading.Thread], timeout: float = END_WAIT_S) -> None:
    """Wait, without blocking the loop, until each of ``threads`` (told to end) has ended,
    for at most ``timeout``; warn naming each one still running then."""
    deadline = time.monotonic() + timeout
    while (left := _alive(threads)) and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    warn_left(left, timeout)


def join_ended(threads: list[threading.Thread], timeout: float = END_WAIT_S) -> None:
    """:func:`threads_ended` for a caller with no event loop to keep going (it blocks)."""
    deadline = time.monotonic() + timeout
    for thread in _alive(threads):
        thread.join(max(0.0, deadline - time.monotonic()))
    warn_left(_alive(threads), timeout)


def _alive(threads: list[threading.Thread]) -> list[threading.Thread]:
    me = threading.current_thread()
    return [t for t in threads if t.is_alive() and t is not me]


def warn_left(threads: list[threading.Thread], timeout: float) -> None:
    """Name the threads a close left running after waiting ``timeout`` for them."""
    for thread in threads:
        log.warning(
            "thread %s had not ended %.0f s after the close began; it ends when its "
            "blocking call returns (do not fork until then: docs/contract.md §1.2)",
            thread.name,
            timeout,
        )


def _work(
    _pool: weakref.ReferenceType[DaemonThreads],
    jobs: queue.SimpleQueue[_Job | None],
    idle: threading.Semaphore,
) -> None:
    """One thread's life: run jobs until the end marker comes, then pass it on.

    ``_pool`` is not used: the thread holds it so that its callback, which puts the end
    marker, stays alive as long as the thread (a weak reference only its dying pool
    held would be collected with it, its callback never called)."""
    while (job := jobs.get()) is not None:
        future, fn, args, kwargs = job
        del job  # nothing here keeps a finished job's arguments or result alive
        if future.set_running_or_notify_cancel():
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # handed to the caller, as ThreadPoolExecutor does
                future.set_exception(exc)
            else:
                future.set_result(result)
                del result
        del future, fn, args, kwargs
        idle.release()
    jobs.put(None)
