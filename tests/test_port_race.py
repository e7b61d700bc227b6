"""Two servers racing for one port.

``serve`` binds its port before it opens the ledger (a taken port is exit 2 with nothing
written). Bound is not yet listening, though: with ``SO_REUSEADDR`` (which every server
sets, so a restart can bind beside its last run's TIME_WAIT connections) the kernel lets a
second socket bind the same port until one of them listens. A ``serve`` that listened
only once its startup was done left the port open to another server for that whole
startup; the other one took it, and the first wrote its ledger and then failed at
``listen`` (under uvloop silently: it printed its start line and ran on, serving
nothing). A client (and the test kit's ``start_proxy``, polling ``/healthz``) talked
to the other server meanwhile: a tenant test once got 200 from a foreign proxy and then
found no budget of its own in its own ledger.
"""

from __future__ import annotations

import contextlib
import http.server
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from observing import wait_for
from stagedkit import serve_refusing

from effectguard.testing import free_port, start_proxy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads /proc/PID/fd"),
]


def _holds_open(pid: int, path: Path) -> bool:
    """Whether process ``pid`` has ``path`` open (``serve`` opens its ledger only after
    binding its port, so this says it has bound)."""
    fds = Path(f"/proc/{pid}/fd")
    with contextlib.suppress(OSError):
        return any(os.path.realpath(fd) == str(path.resolve()) for fd in fds.iterdir())
    return False


def _accepts(port: int) -> bool:
    """Whether something listens on 127.0.0.1 ``port`` (a connection is queued, then
    closed: the server, still starting, never reads it)."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def _serve(ledger: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "effectguard", "serve", "--ledger", str(ledger)]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    with log.open("wb") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)


def test_a_starting_serve_keeps_its_port_from_a_second_serve(tmp_path: Path) -> None:
    """While the first ``serve`` is still starting (its ledger opened, not yet ready), a
    second one on the same port is refused (exit 2, one line) and writes no ledger."""
    first_ledger, second_ledger = tmp_path / "first.db", tmp_path / "second.db"
    migrate = [sys.executable, "-m", "effectguard", "migrate", "--ledger", str(first_ledger)]
    subprocess.run(migrate, check=True, capture_output=True, timeout=60)
    port = free_port()
    lock = sqlite3.connect(first_ledger, isolation_level=None)
    lock.execute("BEGIN IMMEDIATE")  # the first serve's startup waits on its first write
    first = _serve(first_ledger, port, tmp_path / "first.log")
    try:
        # Its ledger held open alone is not enough: serve reads the file once before it
        # binds (check_ledger_place), and a freeze there left the port free (CI, loaded).
        wait_for(
            lambda: _holds_open(first.pid, first_ledger) and _accepts(port),
            60,
            "the first serve listening with its ledger open",
        )
        first.send_signal(signal.SIGSTOP)  # frozen in its startup, past its listen
        lock.execute("ROLLBACK")
        second = serve_refusing("--ledger", str(second_ledger), "--port", str(port))
        assert second.code == 2, second
        assert second.err == f"effectguard: port {port} on 127.0.0.1 is already in use\n"
        assert not second_ledger.exists()
    finally:
        lock.close()
        first.send_signal(signal.SIGCONT)
        first.kill()
        first.wait(30)


class _Healthy(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # the stdlib calls it by this name
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        """Quiet."""


@contextlib.contextmanager
def _foreign_server() -> Iterator[int]:
    """Another HTTP server, answering 200 to ``/healthz``, on a port of its own."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Healthy)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_start_proxy_never_takes_another_server_for_its_proxy(tmp_path: Path) -> None:
    """``start_proxy`` on a port another server holds fails: it does not hand back a
    proxy whose ``/healthz`` was that other server's (its own ``serve`` exits 2)."""
    with _foreign_server() as port, pytest.raises(RuntimeError, match="already in use"):
        proxy = start_proxy(tmp_path / "l.db", port=port)
        proxy.stop()
    assert not (tmp_path / "l.db").exists()
