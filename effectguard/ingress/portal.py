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
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from typing import Any


class Portal:
    """Runs coroutines on its own loop thread for synchronous callers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._scheduled: set[asyncio.Task[Any]] = set()

    def _started(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self.closed:
                # After close(), or in a child process forked after the first use (the
                # portal's thread did not come along): waiting would wait for ever.
                raise RuntimeError(
                    "this GuardTransport is closed, or was first used before this process "
                    "forked: make a new one"
                )
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(
                    target=self._loop.run_forever, name="effectguard-portal", daemon=True
                )
                self._thread.start()
            return self._loop

    def run(self, coro: Any) -> Any:
        """Run ``coro`` on the loop and wait for its result; an interrupt of the waiting
        thread cancels it."""
        try:
            loop = self._started()
        except RuntimeError:
            coro.close()
            raise
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # done already (its own exception): nothing happens
            raise

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

    def close(self) -> None:
        """Finish the loop's async generators, then stop the loop and its thread."""
        if self._loop is None:
            self._stopped = True
            return
        # A stream its reader stopped early leaves async generators open on this loop
        # (the guard's response body, the inner transport's): their aclose() has to run
        # here, before the loop stops. Left to the collector, it is scheduled on a loop
        # that never runs again, and Python 3.13 warns that it was never awaited.
        self.run(self._loop.shutdown_asyncgens())
        self._stopped = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        assert self._thread is not None
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()

    @property
    def closed(self) -> bool:
        """Closed, or its thread is gone (this process was forked after its first use)."""
        if self._stopped:
            return True
        return self._thread is not None and not self._thread.is_alive()
