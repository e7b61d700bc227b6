"""Fencing with real processes (docs/contract.md §7): two proxies on one SQLite ledger
with a short lease, the first SIGSTOPped while the fake provider holds a call it sent.

Shared by the fencing and the late-answer tests, which differ only in what they check
once the peer has taken the stopped proxy over.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from observing import ledger_events, wait_for

from effectguard.testing import FakeProvider, Proxy, start_proxy

CHAT = "/v1/chat/completions"
MODEL = "gpt-4o-mini"
UPSTREAM = "http://upstream.test"
#: A lease short enough that a stopped proxy loses it within seconds.
LEASE = """
[server]
lease_s = 2
heartbeat_s = 0.5
sweep_s = 0.5
"""


def chat(content: str) -> dict[str, Any]:
    """A small chat completion request."""
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8}


@dataclass
class Stopped:
    """Two proxies on ``ledger``; ``first`` is SIGSTOPped holding the call ``pending``."""

    ledger: Path
    first: Proxy
    second: Proxy
    pending: Future[httpx.Response]
    #: The held call's ``attempt.started`` event (see :func:`observing.ledger_events`).
    started: dict[str, Any]
    #: ``time.monotonic()`` just after the SIGSTOP.
    stopped_at: float


@contextmanager
def stopped_while_held(
    tmp_path: Path, fake: FakeProvider, headers: dict[str, str]
) -> Iterator[Stopped]:
    """Start two proxies on ``tmp_path/ledger.db`` serving ``fake``; send the call
    ``chat("held")`` with ``headers`` (which make the fake provider hold it) to the first;
    once the provider has it, SIGSTOP the first. On exit the first is resumed and both
    are stopped."""
    ledger = tmp_path / "ledger.db"
    config = tmp_path / "lease.toml"
    config.write_text(LEASE)
    kwargs: dict[str, Any] = {"upstreams": {"openai": fake.url}, "args": ["--config", str(config)]}
    first = start_proxy(ledger, **kwargs)
    second = start_proxy(ledger, **kwargs)
    pool = ThreadPoolExecutor(1)
    try:
        pending = pool.submit(
            httpx.post,
            first.url + "/openai" + CHAT,
            json=chat("held"),
            headers=headers,
            timeout=60,
        )
        wait_for(lambda: fake.receipts(), 10, "the provider to receive the call")
        first.kill(signal.SIGSTOP)
        stopped_at = time.monotonic()
        (started,) = [e for e in ledger_events(ledger) if e["kind"] == "attempt.started"]
        yield Stopped(ledger, first, second, pending, started, stopped_at)
    finally:
        # Resumed before the pool is waited for: a stopped proxy never answers.
        first.kill(signal.SIGCONT)
        pool.shutdown(wait=True)
        first.stop()
        second.stop()
