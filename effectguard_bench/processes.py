"""Child processes for the benchmark: start, pin to CPUs, read ``/proc``, stop.

Every child listens on loopback only and is stopped (SIGTERM, then SIGKILL) by
:meth:`Child.stop`; callers keep them in an :class:`contextlib.ExitStack` so a
failing measurement never leaves one behind.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from effectguard.testing import stop_process

_STOP_TIMEOUT = 5.0
_CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class Pinning:
    """Which CPUs the proxies get and which the load (generator, fake provider) gets."""

    proxy: frozenset[int] | None = None
    load: frozenset[int] | None = None

    @classmethod
    def choose(cls, enabled: bool) -> Pinning:
        """Proxy on the first allowed CPU, everything else on the rest (None: no pinning)."""
        cpus = sorted(os.sched_getaffinity(0))
        if not enabled or len(cpus) < 2:
            return cls()
        return cls(frozenset(cpus[:1]), frozenset(cpus[1:]))

    @property
    def enabled(self) -> bool:
        """Whether anything is pinned."""
        return self.proxy is not None


def pinned(command: Sequence[str], cpus: frozenset[int] | None) -> list[str]:
    """``command`` run on ``cpus`` (via ``taskset`` so every thread inherits it from exec)."""
    if cpus is None or shutil.which("taskset") is None:
        return list(command)
    return ["taskset", "-c", ",".join(map(str, sorted(cpus))), *command]


def popen_pinned(
    command: Sequence[str], cpus: frozenset[int] | None, **kwargs: Any
) -> subprocess.Popen[bytes]:
    """``Popen`` on ``cpus``: through ``taskset``, or pinned right after start without it."""
    process: subprocess.Popen[bytes] = subprocess.Popen(pinned(command, cpus), **kwargs)
    if cpus is not None and shutil.which("taskset") is None:
        # Threads a child starts later inherit this; wrk's first thread may race it.
        for task in Path(f"/proc/{process.pid}/task").iterdir():
            with contextlib.suppress(OSError):  # the thread ended meanwhile
                os.sched_setaffinity(int(task.name), cpus)
    return process


@contextlib.contextmanager
def this_thread_on(cpus: frozenset[int] | None) -> Iterator[None]:
    """Run the block with this thread (and threads it starts) on ``cpus``."""
    previous = os.sched_getaffinity(0)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, previous)


def child_env() -> dict[str, str]:
    """The environment for children: this effectguard importable, no ``EFFECTGUARD_*`` knobs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EFFECTGUARD_")}
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    return env


def python_module(module: str, *args: str) -> list[str]:
    """The command line running ``python -m module args``."""
    return [sys.executable, "-m", module, *args]


@dataclass
class Child:
    """A running child process and the URL it serves (empty if it serves none)."""

    name: str
    process: subprocess.Popen[bytes]
    url: str = ""
    started_at: float = 0.0

    @property
    def pid(self) -> int:
        """The process id."""
        return self.process.pid

    def cpu_seconds(self) -> float:
        """User plus system CPU time of every thread so far (``/proc/<pid>/stat``)."""
        stat = Path(f"/proc/{self.pid}/stat").read_text()
        fields = stat.rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK

    def memory_mb(self) -> tuple[float, float]:
        """``(VmRSS, VmHWM)`` in MB: resident now and its high-water mark."""
        values = {"VmRSS": 0.0, "VmHWM": 0.0}
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in values:
                values[key] = int(rest.split()[0]) / 1024
        return values["VmRSS"], values["VmHWM"]

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it does not exit in time."""
        stop_process(self.process, _STOP_TIMEOUT)
        for stream in (self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()


def spawn(name: str, command: Sequence[str], cpus: frozenset[int] | None, log: Path) -> Child:
    """Start ``command`` pinned to ``cpus``, its output going to ``log``."""
    with log.open("ab") as out:
        started = time.perf_counter()
        process = popen_pinned(command, cpus, stdout=out, stderr=subprocess.STDOUT, env=child_env())
    return Child(name, process, started_at=started)


def spawn_announcing(
    name: str,
    command: Sequence[str],
    cpus: frozenset[int] | None,
    prefix: str,
    timeout: float,
    log: Path,
) -> Child:
    """Start ``command`` and wait for the stdout line ``prefix URL``; the child serves URL.

    Its stderr goes to ``log`` (a load generator that stops mid-request makes
    servers complain there).
    """
    with log.open("ab") as errors:
        process = popen_pinned(
            command, cpus, stdout=subprocess.PIPE, stderr=errors, env=child_env()
        )
    child = Child(name, process, started_at=time.perf_counter())
    assert process.stdout is not None
    deadline = time.monotonic() + timeout
    try:
        while (remaining := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([process.stdout], [], [], remaining)
            if not ready:
                break
            line = process.stdout.readline().decode()
            if line.startswith(prefix):
                child.url = line.removeprefix(prefix).strip()
                return child
            if not line:
                raise RuntimeError(f"{name} exited with status {process.wait()}")
        raise RuntimeError(f"{name} did not start within {timeout} s")
    except BaseException:
        child.stop()
        raise


def first_served(
    child: Child, host: str, port: int, path: str, body: bytes, timeout: float
) -> float:
    """Seconds from the child's start until ``POST path`` first answers 200 (polled quickly)."""
    deadline = time.monotonic() + timeout
    headers = {"content-type": "application/json"}
    while time.monotonic() < deadline:
        if child.process.poll() is not None:
            raise RuntimeError(f"{child.name} exited with status {child.process.returncode}")
        connection = http.client.HTTPConnection(host, port, timeout=timeout)
        try:
            connection.request("POST", path, body=body, headers=headers)
            response = connection.getresponse()
            response.read()
            if response.status == 200:
                return time.perf_counter() - child.started_at
        except OSError:
            pass
        finally:
            connection.close()
        time.sleep(0.002)
    raise RuntimeError(f"{child.name} served no request within {timeout} s")


def warm_up(host: str, port: int, path: str, body: bytes, count: int, seconds: float) -> None:
    """Up to ``count`` sequential requests on one connection, for at most ``seconds``."""
    deadline = time.monotonic() + seconds
    connection = http.client.HTTPConnection(host, port, timeout=10)
    headers = {"content-type": "application/json"}
    try:
        for _ in range(count):
            connection.request("POST", path, body=body, headers=headers)
            connection.getresponse().read()
            if time.monotonic() > deadline:
                break
    finally:
        connection.close()


def run_pinned(
    command: Sequence[str], cpus: frozenset[int] | None, timeout: float
) -> tuple[int, str, str]:
    """Run ``command`` on ``cpus`` to completion: ``(status, stdout, stderr)``."""
    process = popen_pinned(
        command, cpus, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env()
    )
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise RuntimeError(f"{command[0]} did not finish within {timeout:.0f} s") from None
    return process.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def machine() -> dict[str, object]:
    """What the numbers were measured on."""
    return {
        "nproc": os.cpu_count(),
        "allowed_cpus": len(os.sched_getaffinity(0)),
        "python": sys.version.split()[0],
        "platform": sys.platform,
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }
