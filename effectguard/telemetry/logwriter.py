"""A log handler that never makes its caller wait for the log's reader.

``serve`` logs from its event loop. Its stderr is often a pipe (a log shipper, a
container runtime, systemd): when the reader stalls, the pipe fills (64 KiB on Linux)
and a write to it blocks, which froze every request, ``/healthz`` too. Here a line is
formatted by its caller, as before, and written at once when nothing is waiting and the
stream can take it without blocking (a file, a pipe with room): then it is out before the
caller goes on, as before. Otherwise it is handed to a thread that writes it. Lines wait
in a bounded queue; when it is full they are dropped and counted, and a warning says how
many once there is room again, so a reader that never comes back costs bounded memory.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import select
import threading
import time
from typing import IO

__all__ = ["QueuedStreamHandler"]

#: Lines that may wait for the writer (about 5 MB of access lines).
MAX_WAITING = 10_000
#: How long the process's exit waits for lines still queued (a reader that never reads).
EXIT_WAIT_S = 5.0

#: A line at most this long is written whole or not at all to a pipe that has room.
_ATOMIC = 4096

_STOP = object()


def _poll_for_room(stream: IO[str]) -> select.poll | None:
    """A poll of ``stream``'s descriptor for room to write; None where it has none (an
    in-memory stream), whose lines the writer thread always takes."""
    try:
        poll = select.poll()
        poll.register(stream.fileno(), select.POLLOUT)
    except (OSError, ValueError, AttributeError):
        return None
    return poll


class QueuedStreamHandler(logging.Handler):
    """Formats each record in the caller's thread and writes it there when that cannot
    block; else a daemon thread writes it."""

    def __init__(self, stream: IO[str], max_waiting: int = MAX_WAITING) -> None:
        super().__init__()
        self.stream = stream
        self._lines: queue.Queue[object] = queue.Queue(max_waiting)
        self._dropped = 0  # lines dropped since the last that could be queued
        self._busy = threading.Lock()  # held while a line is being written
        self._poll = _poll_for_room(stream)
        self._writer = threading.Thread(target=self._write, name="effectguard-log", daemon=True)
        self._writer.start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:
            self.handleError(record)
            return
        # Called under the handler's lock (Handler.handle): the count needs no other.
        if not self._dropped and self._wrote_at_once(line):
            return
        try:
            if self._dropped:
                self._lines.put_nowait(self._dropped_line(record))
                self._dropped = 0
            self._lines.put_nowait(line)
        except queue.Full:
            self._dropped += 1

    def _wrote_at_once(self, line: str) -> bool:
        """Write ``line`` now if no line is queued or being written (the order stays) and
        the stream can take it without blocking; False if it must be queued."""
        if len(line) * 4 >= _ATOMIC and len(line.encode(errors="replace")) >= _ATOMIC:
            return False  # a long line (a traceback) might go out in part: the writer's
        if not self._busy.acquire(blocking=False):
            return False
        try:
            if self._lines.unfinished_tasks or not self._has_room():
                return False
            with contextlib.suppress(Exception):  # a closed or broken stream: lose it
                self.stream.write(f"{line}\n")
                self.stream.flush()
            return True
        finally:
            self._busy.release()

    def _has_room(self) -> bool:
        """Whether a short line can be written to the stream without blocking."""
        return self._poll is not None and bool(self._poll.poll(0))

    def _dropped_line(self, after: logging.LogRecord) -> str:
        """The warning that says how many lines were dropped (queued before ``after``)."""
        dropped = self._dropped
        record = logging.LogRecord(
            "effectguard.telemetry.logs",
            logging.WARNING,
            __file__,
            0,
            "%d log lines dropped: their reader (stderr) did not read them",
            (dropped,),
            None,
        )
        record.created = after.created
        record.event = "log_lines_dropped"
        record.dropped = dropped
        return self.format(record)

    def _write(self) -> None:
        while True:
            line = self._lines.get()
            try:
                if line is _STOP:
                    return
                with self._busy, contextlib.suppress(Exception):  # a broken stream: lose it
                    self.stream.write(f"{line}\n")
                    self.stream.flush()
            finally:
                self._lines.task_done()

    def flush(self) -> None:
        """Wait (at most :data:`EXIT_WAIT_S`) for the lines queued so far to be written."""
        deadline = time.monotonic() + EXIT_WAIT_S
        while self._lines.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self) -> None:
        """End the writer once it has written what is queued (not waited for here: the
        process's exit, logging.shutdown, has flushed first, and waited once is enough)."""
        with contextlib.suppress(queue.Full):
            self._lines.put_nowait(_STOP)
        super().close()
