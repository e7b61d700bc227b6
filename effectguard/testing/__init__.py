"""Helpers for testing code that uses effectguard, shipped so nobody has to mock it.

The fake provider part: :func:`fake_provider` runs ``effectguard.testing.fakeprovider``
in a subprocess and hands back a :class:`FakeProvider` whose receipt log
counts the effects that actually reached the provider::

    with fake_provider(tmp_path / "receipts.jsonl") as provider:
        client = openai.OpenAI(base_url=provider.url + "/v1", api_key="x")
        client.chat.completions.create(model="m", messages=[...])
        assert len(provider.effects()) == 1
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from effectguard.testing.receiptfile import read_receipts

__all__ = [
    "FakeProvider",
    "Proxy",
    "fake_provider",
    "free_port",
    "running_proxy",
    "start_proxy",
    "stop_process",
]

_LISTENING = "fake-provider listening on "
_START_TIMEOUT = 10.0
_STOP_TIMEOUT = 5.0


def stop_process(process: subprocess.Popen[bytes], timeout: float = _STOP_TIMEOUT) -> int | None:
    """SIGTERM ``process``, then SIGKILL if it has not exited after ``timeout`` seconds."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


@dataclass
class FakeProvider:
    """A running fake-provider subprocess and its receipt log."""

    url: str
    receipts_path: Path
    process: subprocess.Popen[bytes]

    def receipts(self) -> list[dict[str, Any]]:
        """Every receipt line so far: one per POST the provider received, in order."""
        return read_receipts(self.receipts_path)

    def effects(self) -> list[dict[str, Any]]:
        """The receipts that were not answered from the provider's dedup store.

        Error answers (``--error-status``, a reused key's 422) count: the request
        reached the provider. Filter on the receipt's ``status`` where that matters.
        """
        return [receipt for receipt in self.receipts() if not receipt["deduped"]]

    def stop(self) -> None:
        """Stop the process: SIGTERM, then SIGKILL if it does not exit in time."""
        stop_process(self.process)
        if self.process.stdout is not None:
            self.process.stdout.close()


@contextlib.contextmanager
def fake_provider(
    receipts: str | Path,
    *,
    delay: float | None = None,
    idempotent: bool = False,
    error_status: int | None = None,
    break_after: int | None = None,
    cut_stream_clean: int | None = None,
    extra_args: Sequence[str] = (),
) -> Iterator[FakeProvider]:
    """Run a fake provider on a free port for the duration of the ``with`` block."""
    receipts = Path(receipts)
    args = [sys.executable, "-m", "effectguard.testing.fakeprovider", "--port", "0"]
    args += ["--receipts", str(receipts)]
    if delay is not None:
        args += ["--delay", str(delay)]
    if idempotent:
        args.append("--idempotent")
    if error_status is not None:
        args += ["--error-status", str(error_status)]
    if break_after is not None:
        args += ["--break-after", str(break_after)]
    if cut_stream_clean is not None:
        args += ["--cut-stream-clean", str(cut_stream_clean)]
    args += extra_args
    # The child must import this very effectguard, installed or not.
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    process = subprocess.Popen(args, stdout=subprocess.PIPE, env=env)
    provider = FakeProvider(url="", receipts_path=receipts, process=process)
    try:
        provider.url = _read_url(process)
        yield provider
    finally:
        provider.stop()


def _read_url(process: subprocess.Popen[bytes]) -> str:
    assert process.stdout is not None
    deadline = time.monotonic() + _START_TIMEOUT
    while (remaining := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([process.stdout], [], [], remaining)
        if not ready:
            break
        line = process.stdout.readline().decode()
        if line.startswith(_LISTENING):
            return line.removeprefix(_LISTENING).strip()
        if not line:
            raise RuntimeError(f"fake provider exited with status {process.wait()}")
    raise RuntimeError(f"fake provider did not start within {_START_TIMEOUT} s")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Proxy:
    """A running ``effectguard serve`` subprocess."""

    url: str
    ledger: str
    process: subprocess.Popen[bytes]
    log_path: Path
    #: Where this run's output begins in ``log_path`` (a log may be appended to by runs).
    log_start: int = 0

    def log(self) -> str:
        """Everything the proxy printed (stdout and stderr), up to its last finished line.

        A line still being written is left out, as in a receipt log
        (:func:`~effectguard.testing.receiptfile.read_receipts`): a reader may see its
        first part alone.
        """
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return text[: text.rfind("\n") + 1]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (default SIGKILL: no cleanup)."""
        if self.process.poll() is None:
            self.process.send_signal(sig)

    def stop(self, timeout: float = _STOP_TIMEOUT * 3) -> int | None:
        """SIGTERM (graceful drain), then SIGKILL if it does not exit in time."""
        return stop_process(self.process, timeout)


class _PortTaken(RuntimeError):
    """``serve`` found its port taken (exit 2) before it started."""


#: How many free ports :func:`start_proxy` tries when it picks the port itself.
_PORT_TRIES = 3


def start_proxy(
    ledger: str | Path,
    *,
    upstreams: dict[str, str] | None = None,
    args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    log_path: Path | None = None,
    port: int | None = None,
    wait: bool = True,
) -> Proxy:
    """Start ``effectguard serve`` on a free loopback port; wait until ``/healthz`` answers.

    A port picked here (``port`` None) is only free a moment ago: another process may
    take it before ``serve`` binds it, so with ``wait`` a taken one is picked again.
    """
    flags: list[str] = []  # after --port, as before, so that ``args`` may override
    for name, url in (upstreams or {}).items():
        flags += ["--upstream", f"{name}={url}"]
    flags += list(args)
    child_env = {**os.environ, **(env or {})}
    for tries_left in reversed(range(_PORT_TRIES if port is None and wait else 1)):
        chosen = port or free_port()
        process, proxy = _launch(flags, chosen, ledger, log_path, child_env)
        if not wait:
            return proxy
        try:
            return _wait_healthy(process, proxy)
        except _PortTaken:
            if not tries_left:
                raise
    raise AssertionError("unreachable: the last try returns or raises")


def _launch(
    flags: list[str], port: int, ledger: str | Path, log_path: Path | None, env: dict[str, str]
) -> tuple[subprocess.Popen[bytes], Proxy]:
    log_path = log_path or Path(str(ledger) + f".proxy-{port}.log")
    command = [sys.executable, "-m", "effectguard", "serve", "--ledger", str(ledger)]
    command += ["--host", "127.0.0.1", "--port", str(port), *flags]
    with log_path.open("ab") as log_file:
        started_at = log_file.tell()
        process = subprocess.Popen(
            command,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
        )
    return process, Proxy(f"http://127.0.0.1:{port}", str(ledger), process, log_path, started_at)


def _says_listening(proxy: Proxy) -> bool:
    """Whether this run of ``serve`` (its part of the log) said it listens on its port
    (on whichever host its arguments name)."""
    port = proxy.url.rsplit(":", 1)[1]
    line = re.compile(rb"^effectguard listening on http://\S+:" + port.encode() + rb" ", re.M)
    with contextlib.suppress(FileNotFoundError), proxy.log_path.open("rb") as log:
        log.seek(proxy.log_start)
        return line.search(log.read()) is not None
    return False


def _wait_healthy(process: subprocess.Popen[bytes], proxy: Proxy) -> Proxy:
    """Wait until this ``serve`` says it listens on its port, and ``/healthz`` answers.

    Its own start line first: the port was free when it was picked, but another server
    may take it before ``serve`` binds it (this one then exits 2), and that server's
    ``/healthz`` answered before the exit; a test then talked to another proxy, with
    another ledger. ``serve`` prints the line once it listens, and a port listened on is
    its alone.
    """
    import urllib.request

    deadline = time.monotonic() + _START_TIMEOUT * 2
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log = proxy.log()
            taken = process.returncode == 2 and "is already in use" in log
            raise (_PortTaken if taken else RuntimeError)(
                f"effectguard serve exited with {process.returncode}:\n{log}"
            )
        if not _says_listening(proxy):
            time.sleep(0.05)
            continue
        try:
            with urllib.request.urlopen(proxy.url + "/healthz", timeout=1) as response:
                if response.status == 200:
                    return proxy
        except OSError:
            time.sleep(0.05)
    proxy.kill()
    raise RuntimeError(f"effectguard serve did not become healthy:\n{proxy.log()}")


@contextlib.contextmanager
def running_proxy(ledger: str | Path, **kwargs: Any) -> Iterator[Proxy]:
    """:func:`start_proxy` for the duration of a block (stopped gracefully after)."""
    proxy = start_proxy(ledger, **kwargs)
    try:
        yield proxy
    finally:
        proxy.stop()
