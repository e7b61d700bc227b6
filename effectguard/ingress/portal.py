"""A private event loop on a daemon thread: how the synchronous transport runs the guard.

:class:`~effectguard.ingress.transport.GuardTransport` is called from plain code, from
many threads at once; the guard is async. Each call is run on this loop and waited for.

* **Started on first use, not when made.** A program that builds its client at import
  and then forks (gunicorn ``--preload``, Celery's prefork pool, ``multiprocessing``
  with ``fork``) hands the child a transport whose thread did not come along. Unused
  until then, the child starts its own; used before the fork, it refuses with an error
  (the parent's ledger connections and worker registration are not the child's).
* **The waiting thread's interrupt cancels the call's coroutine** (``KeyboardInterrupt``
  in a script, a notebook, a REPL), as an async caller's cancellation would
  (docs/contract.md §3.8): not yet admitted, nothing is sent; admitted, its attempt is
  recorded as never sent; dispatched, it is read and settled in the background. Left
  running, a call interrupted before it was sent would go out after the user stopped it.
* **Closed once, refusing from the moment the close begins** (docs/contract.md §1.2,
  §3.8). Work handed in while the close drains the loop would either race the ledger's
  close or, handed in after the loop stopped, wait for ever: it is refused instead, with
  the same error as after the close. A second close waits for the first and returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Coroutine
from concurrent.futures import Future, InvalidStateError
from typing import Any

from effectguard.ledger.daemonthreads import END_WAIT_S, warn_left

#: How long a second close waits for the first (which drains calls for up to 30 s).
SECOND_CLOSE_WAIT_S = 60.0

CLOSED = "this GuardTransport is closed: make a new one"
FORKED = (
    "this GuardTransport was first used before this process forked: its loop thread, "
    "ledger connections and worker registration are the parent's; nothing was sent. Make "
    "the client in each process after it starts (a multiprocessing Pool's initializer, "
    "Celery's worker_process_init, gunicorn's post_fork), or make it at import and use it "
    "first in the worker; a SQLite ledger the parent still has open cannot be opened here "
    "(docs/contract.md §3.8)"
)


class Portal:
    """Runs coroutines on its own loop thread for synchronous callers."""

    def __init__(self) -> None:
        # Reentrant: the garbage collector runs at any allocation, inside ``_submit`` too,
        # and an abandoned stream it finalizes there closes through ``_submit`` on the
        # same thread. A plain lock waited on itself there, and the thread hung for ever.
        self._lock = threading.RLock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        #: The process its thread started in: read only to word a refusal.
        self._pid: int | None = None
        #: Set when the first close begins: from then on nothing new is taken.
        self._closing = False
        self._closed = threading.Event()
        #: Work handed to the loop and not done: failed if the loop stops under it.
        self._pending: set[Future[Any]] = set()
        self._scheduled: set[asyncio.Task[Any]] = set()

    def _submit(self, coro: Any, *, closing: bool = False) -> Future[Any]:
        """Hand ``coro`` to the loop (starting it); refused once closed, or while closing
        unless it is the close's own work (``closing``)."""
        with self._lock:
            if self._thread_gone() or (self._closing and not closing):
                # After close() began, or in a child process forked after the first use
                # (the portal's thread did not come along): waiting would wait for ever.
                coro.close()
                forked = not self._closing and self._pid != os.getpid()
                raise RuntimeError(FORKED if forked else CLOSED)
            if self._loop is None:
                self._pid = os.getpid()
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(
                    target=self._loop.run_forever, name="effectguard-portal", daemon=True
                )
                self._thread.start()
            future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self._loop)
            self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        return future

    @staticmethod
    def _wait(future: Future[Any]) -> Any:
        try:
            return future.result()
        except BaseException:
            future.cancel()  # done already (its own exception): nothing happens
            raise

    def run(self, coro: Any) -> Any:
        """Run ``coro`` on the loop and wait for its result; an interrupt of the waiting
        thread cancels it."""
        return self._wait(self._submit(coro))

    def run_or_schedule(self, coro: Any) -> None:
        """Run ``coro`` and wait for it; on the portal's own thread, schedule it instead.

        The garbage collector may finalize an abandoned stream on any thread, the
        portal's too, and the stream's close then calls here: waiting on the portal's
        loop from inside it would wait on itself, and every request would hang."""
        if threading.current_thread() is not self._thread or self._loop is None:
            self.run(coro)
            return
        task = self._loop.create_task(coro)
        self._scheduled.add(task)  # a task only the loop refers to may be collected
        task.add_done_callback(self._scheduled.discard)

    def close(self, last: Coroutine[Any, Any, Any] | None = None) -> None:
        """Refuse new work, run ``last`` (the transport's own close) and finish the loop's
        async generators, then stop the loop and its thread. Only the first close does
        this; one made meanwhile waits for it (bounded) and returns."""
        with self._lock:
            first, self._closing = not self._closing, True
            # Never used, it still runs ``last`` (which closes the inner transport);
            # in a child forked after the first use there is no loop left to run it on.
            running = not self._thread_gone()
        if not first or not running:
            if last is not None:
                last.close()
            if not first:
                self._closed.wait(SECOND_CLOSE_WAIT_S)
            else:
                self._closed.set()
            return
        try:
            if last is not None:
                self._wait(self._submit(last, closing=True))
        finally:
            self._finish()

    def _finish(self) -> None:
        """Finish the async generators, stop the loop, fail what it left undone."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:  # never started: nothing to stop
            self._closed.set()
            return
        try:
            # A stream its reader stopped early leaves async generators open on this loop
            # (the guard's response body, the inner transport's): their aclose() has to
            # run here, before the loop stops. Left to the collector, it is scheduled on a
            # loop that never runs again, and Python 3.13 warns it was never awaited.
            # A reader still waiting for a stalled stream's next chunk is cancelled first.
            self._wait(self._submit(_end_loop_work(loop), closing=True))
        finally:
            loop.call_soon_threadsafe(loop.stop)
            # Bounded, and named if it does not end: close() promises a program may fork
            # after it returns (docs/contract.md §1.2), which a thread still running denies.
            thread.join(timeout=END_WAIT_S)
            if thread.is_alive():
                warn_left([thread], END_WAIT_S)
            else:
                loop.close()
            # Handed in before the close began but never run (or cut off by the stop):
            # their threads would wait for ever on a loop that is gone.
            for future in list(self._pending):
                # Done meanwhile, or cancelled by its waiter: nothing to fail.
                with contextlib.suppress(InvalidStateError):
                    future.set_exception(RuntimeError(CLOSED))
            self._closed.set()

    def _thread_gone(self) -> bool:
        """Its thread ended (closed, or this process was forked after its first use)."""
        return self._thread is not None and not self._thread.is_alive()

    @property
    def closed(self) -> bool:
        """Closing or closed, or its thread is gone (forked after its first use)."""
        return self._closing or self._thread_gone()


#: How long the close waits for the tasks it cancelled (a bound only a task that
#: ignores its cancellation reaches).
CANCELLED_WAIT_S = 5.0


async def _end_loop_work(loop: asyncio.AbstractEventLoop) -> None:
    """End what runs on the loop as ``asyncio.run`` does: cancel the tasks left, then close
    the async generators. In the other order, a generator a task is still running (a
    reader waiting on a stalled stream) cannot be closed, and asyncio printed "aclose():
    asynchronous generator is already running" for each as the transport closed."""
    left = asyncio.all_tasks() - {asyncio.current_task()}
    for task in left:
        task.cancel()
    if left:
        await asyncio.wait(left, timeout=CANCELLED_WAIT_S)
    await loop.shutdown_asyncgens()
    # Anything run with asyncio.to_thread on this loop (a spooled body's reads) started
    # the loop's default executor: its threads are the transport's too (§1.2).
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(loop.shutdown_default_executor(), END_WAIT_S)
