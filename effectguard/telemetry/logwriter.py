"""A log handler that never makes its caller wait for the log's reader.

``serve`` logs from its event loop. Its stderr is often a pipe (a log shipper, a
container runtime, systemd): when the reader stalls, the pipe fills (64 KiB on Linux)
and a write to it blocks, which froze every request, ``/healthz`` too. Here a line is
formatted by its caller, as before, and handed to a thread that writes it. Lines wait
in a bounded queue; when it is full they are dropped and counted, and a warning says how
many once there is room again, so a reader that never comes back costs bounded memory.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from typing import IO

__all__ = ["QueuedStreamHandler"]

#: Lines that may wait for the writer (about 5 MB of access lines).
MAX_WAITING = 10_000
#: How long the process's exit waits for lines still queued (a reader that never reads).
EXIT_WAIT_S = 5.0

_STOP = object()


class QueuedStreamHandler(logging.Handler):
    """Formats each record in the caller's thread; a daemon thread writes the lines."""

    def __init__(self, stream: IO[str], max_waiting: int = MAX_WAITING) -> None:
        super().__init__()
        self.stream = stream
        self._lines: queue.Queue[object] = queue.Queue(max_waiting)
        self._dropped = 0  # lines dropped since the last that could be queued
        self._writer = threading.Thread(target=self._write, name="effectguard-log", daemon=True)
        self._writer.start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:
            self.handleError(record)
            return
        # Called under the handler's lock (Handler.handle): the count needs no other.
        try:
            if self._dropped:
                self._lines.put_nowait(self._dropped_line(record))
                self._dropped = 0
            self._lines.put_nowait(line)
        except queue.Full:
            self._dropped += 1

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
                with contextlib.suppress(Exception):  # a closed or broken stream: lose it
                    self.stream.write(f"{line}\n")
                    if self._lines.empty():
                        self.stream.flush()
            finally:
                self._lines.task_done()

    def flush(self) -> None:
        """Wait (at most :data:`EXIT_WAIT_S`) for the lines queued so far to be written."""
        deadline = time.monotonic() + EXIT_WAIT_S
        while self._lines.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self) -> None:
        self.flush()
        with contextlib.suppress(queue.Full):
            self._lines.put_nowait(_STOP)
        super().close()
