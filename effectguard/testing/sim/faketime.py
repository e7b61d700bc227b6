"""Wall clocks the run can step (``--clock-steps``), one per host, through libfaketime.

Stepping the machine's clock needs ``CAP_SYS_TIME`` and moves every process on it;
Linux time namespaces offset only the monotonic clocks. So a process that should see a
host's clock runs with ``LD_PRELOAD`` libfaketime, reading its offset from a file of
that host's (``FAKETIME_TIMESTAMP_FILE``, ``+S`` or ``-S`` seconds) at most
:data:`CACHE_S` after it changed (``FAKETIME_CACHE_DURATION``): rewriting the file steps
that host's clock, as NTP would, in each process within that second. Reading the file on
every clock read instead (``FAKETIME_NO_CACHE=1``) costs 4 µs a read, which on a loaded
machine made the replicas stand still past their leases (a PostgreSQL run's system time
went from 2 s to 30 s). Only the wall clock (``CLOCK_REALTIME``) is faked
(``FAKETIME_DONT_FAKE_MONOTONIC=1``): timers, sleeps and asyncio's loop run on.

libfaketime keeps a semaphore and a shared-memory segment per process tree, named by
the first process's pid, in ``/dev/shm``, and never removes them after a SIGKILL; a
later process given that pid then fails to start. Every process of the run therefore
shares one pair (``FAKETIME_SHARED``), made at the start and removed at the end.
"""

from __future__ import annotations

import contextlib
import glob
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

__all__ = ["CACHE_S", "FakeClocks", "fake_clocks", "library", "unavailable_reason"]

#: How long a process keeps its host's offset before reading the file again (seconds).
CACHE_S: Final = 1

_PATTERNS = (
    "/usr/lib/*/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
    "/usr/local/lib/faketime/libfaketime.so.1",
)


def library() -> str | None:
    """The path of libfaketime's shared library, where it is installed."""
    for pattern in _PATTERNS:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def unavailable_reason() -> str | None:
    """Why this machine cannot step a process's clock (None: it can)."""
    if library() is None:
        return "needs libfaketime (Debian: apt-get install libfaketime)"
    if not Path("/dev/shm").is_dir():
        return "libfaketime needs /dev/shm"
    return None


@dataclass
class FakeClocks:
    """The run's steppable clocks: one offset file per host name (``host``, ``replica-N``)."""

    directory: Path
    library: str
    shared: str
    offsets: dict[str, float] = field(default_factory=dict)

    def env(self, name: str) -> dict[str, str]:
        """The environment a process of host ``name`` runs with (its offset file made)."""
        path = self._file(name)
        if name not in self.offsets:
            self._write(name, 0.0)
        return {
            "LD_PRELOAD": self.library,
            "FAKETIME_TIMESTAMP_FILE": str(path),
            "FAKETIME_CACHE_DURATION": str(CACHE_S),
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            "FAKETIME_SHARED": self.shared,
        }

    def now(self, name: str) -> float:
        """What host ``name``'s clock reads now."""
        return time.time() + self.offsets.get(name, 0.0)

    def step(self, name: str, seconds: float) -> tuple[float, float, float]:
        """Step host ``name``'s clock by ``seconds``: (real time before the step, real time
        by which every process sees it, the host's offset now). A process reading its clock
        in between may see either side."""
        began = time.time()
        self._write(name, round(self.offsets.get(name, 0.0) + seconds, 6))
        return began, time.time() + CACHE_S, self.offsets[name]

    def _file(self, name: str) -> Path:
        return self.directory / f"{name}.faketime"

    def _write(self, name: str, offset: float) -> None:
        # Replaced whole: a reader never sees a half-written (empty) file, read as no offset.
        staging = self.directory / f".{name}.faketime"
        staging.write_text(f"{offset:+.6f}\n")
        os.replace(staging, self._file(name))
        self.offsets[name] = offset


@contextlib.contextmanager
def fake_clocks(directory: Path) -> Iterator[FakeClocks]:
    """The run's clocks; the shared semaphore and memory removed on the way out."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"--clock-steps {unavailable_reason()}")
    directory.mkdir(parents=True, exist_ok=True)
    # One preloaded process makes the pair, named by its pid; every later one shares it.
    made = subprocess.run(
        ["sh", "-c", "echo $$"],
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LD_PRELOAD": lib},
        capture_output=True,
        text=True,
        check=True,
    )
    pid = made.stdout.strip()
    try:
        yield FakeClocks(directory, lib, f"/faketime_sem_{pid} /faketime_shm_{pid}")
    finally:
        for name in (f"sem.faketime_sem_{pid}", f"faketime_shm_{pid}"):
            with contextlib.suppress(OSError):
                os.unlink(f"/dev/shm/{name}")
