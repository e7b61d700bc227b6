"""A log reader that stops reading must not stop the proxy.

``serve`` writes its lines to stderr. Behind a pipe (a log shipper, a container runtime)
whose reader stalls, the pipe fills after about 64 KiB (some 140 access lines); a write
to it then blocks. Written from the event loop, that froze every request, ``/healthz``
too, until the reader came back. The lines are now written by a thread of their own.
"""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from effectguard.telemetry.logs import JsonFormatter
from effectguard.telemetry.logwriter import QueuedStreamHandler
from effectguard.testing import FakeProvider, fake_provider, free_port

pytestmark = pytest.mark.slow

REQUESTS = 400  # about 180 KB of access lines: well past a pipe's 64 KiB


@pytest.fixture
def provider(tmp_path: Path) -> Iterator[FakeProvider]:
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        yield fake


def test_a_stalled_stderr_reader_does_not_stop_serve(
    tmp_path: Path, provider: FakeProvider
) -> None:
    """With nobody reading serve's stderr pipe, 400 refused requests are each answered
    within 5 s and /healthz still answers; once the pipe is read, every access line is
    there, each one whole JSON line."""
    port = free_port()
    command = [sys.executable, "-m", "effectguard", "serve", "--ledger", str(tmp_path / "l.db")]
    command += ["--port", str(port), "--upstream", f"openai={provider.url}"]
    command += ["--log-format", "json"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert process.stdout is not None and process.stderr is not None
        assert process.stdout.readline().startswith(b"effectguard listening on")
        url = f"http://127.0.0.1:{port}"
        body = {"model": "no-such-model", "messages": []}
        with httpx.Client(base_url=url, timeout=5) as client:
            statuses = [
                client.post("/openai/v1/chat/completions", json=body).status_code
                for _ in range(REQUESTS)
            ]
            assert statuses == [400] * REQUESTS
            assert client.get("/healthz").status_code == 200
        process.terminate()  # and read the pipe at last, as it stops
        _, err = process.communicate(timeout=60)
        lines = err.decode().splitlines()
    finally:
        process.kill()
        process.wait()
    access = [json.loads(line) for line in lines if '"event": "access"' in line]
    assert len(access) == REQUESTS
    assert {line["error"] for line in access} == {"model_not_priced"}


class _StalledStream(io.StringIO):
    """A stream whose writes wait until it is let go, like a pipe nobody reads."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()

    def write(self, text: str) -> int:
        self.go.wait(10)
        return super().write(text)


def test_lines_past_the_queue_are_dropped_counted_and_said() -> None:
    """While the stream is stalled, lines past the queue's bound are dropped, not held;
    once it moves, a warning line says how many, and every line is accounted for."""
    stream = _StalledStream()
    handler = QueuedStreamHandler(stream, max_waiting=2)
    handler.setFormatter(JsonFormatter())
    log = logging.getLogger("effectguard.test.stall")
    log.propagate = False
    log.addHandler(handler)
    try:
        for n in range(10):
            log.warning("line %d", n)
        stream.go.set()
        handler.flush()  # the reader caught up: the next line finds room
        log.warning("after")
        handler.flush()
    finally:
        log.removeHandler(handler)
        handler.close()
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    (said,) = [line for line in lines if line.get("event") == "log_lines_dropped"]
    kept = [line["message"] for line in lines if line.get("event") is None]
    assert said["level"] == "warning" and said["dropped"] >= 7, said
    assert len(kept) + said["dropped"] == 11 and kept[-1] == "after", kept
    expected = f"{said['dropped']} log lines dropped: their reader (stderr) did not read them"
    assert said["message"] == expected
