"""Faithful fakes of the bundled tools (``stripe``, ``postmark``, ``github``), each a small
aiohttp app run as its own process, with an fsync'd receipt log of the effects it made.

* :mod:`stripe_like`: deduplicates on ``Idempotency-Key`` (the first result saved, 500s
  included), a metadata search that lags, Stripe's error shape.
* :mod:`email_like`: Postmark-like ``/email`` (and ``/email/withTemplate``), no dedup, a
  metadata search that lags.
* :mod:`chat_like`: GitHub-like issue comments, no dedup and no search.

Each effect is one receipt line ``{"seq", "ts", "path", "op", "body_sha256", "id"}``
(``op``: the effectguard operation id the request carried, or null), on disk before the
answer is sent, so a receipt is proof the effect happened.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from effectguard.testing import free_port
from effectguard.testing.receiptfile import read_receipts

HERE = Path(__file__).parent


@dataclass
class RunningFake:
    """A fake tool process: its URL and its receipt log."""

    url: str
    receipts: Path
    process: subprocess.Popen[bytes]

    def effects(self) -> list[dict[str, Any]]:
        """Every effect the tool made, from its own receipt log."""
        return read_receipts(self.receipts)


@contextmanager
def running_fake(kind: str, receipts: Path, *, lag_s: float = 0.0) -> Iterator[RunningFake]:
    """Run ``tests/fakes/{kind}.py`` on a free port until the block ends."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, str(HERE / f"{kind}.py"), str(receipts), str(port), str(lag_s)],
        stdout=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                httpx.get(url + "/healthz", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.05)
        else:
            raise RuntimeError(f"fake {kind} did not start")
        yield RunningFake(url, receipts, process)
    finally:
        process.terminate()
        process.wait(10)
