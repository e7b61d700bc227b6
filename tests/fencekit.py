"""Fencing set up for a test (docs/contract.md §7), shared by the fencing and the
late-answer tests, which differ only in what they check once a worker is fenced.

* In process: :class:`Upstream` holds a call on the wire until released, and
  :func:`taken_over_mid_call` has a peer's sweep take the calling worker over meanwhile.
* With real processes: :func:`stopped_while_held`, two proxies on one SQLite ledger with
  a short lease, the first SIGSTOPped while the fake provider holds a call it sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from observing import ledger_events, wait_for

from effectguard.callpath.guard import Guard
from effectguard.callpath.recovery import WorkerRuntime
from effectguard.callpath.runtime import Runtime, RuntimeConfig
from effectguard.ledger import Ledger, Writer, open_store, operations
from effectguard.providers import load_providers
from effectguard.testing import FakeProvider, Proxy, start_proxy
from effectguard.testing.clock import ManualClock

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


# -- in process -----------------------------------------------------------------------


def answer_body(status: int) -> bytes:
    """What :class:`Upstream` answers: a completion with usage, or an error."""
    if status >= 400:
        return json.dumps({"error": {"type": "invalid_request_error", "message": "no"}}).encode()
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    message = {"role": "assistant", "content": "ok"}
    choice = {"index": 0, "message": message, "finish_reason": "stop"}
    body = {"id": "x", "object": "chat.completion", "model": MODEL, "usage": usage}
    return json.dumps({**body, "choices": [choice]}).encode()


def stream_body() -> bytes:
    """A streamed completion whose last chunk before ``[DONE]`` carries the usage."""
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    head = {"id": "x", "object": "chat.completion.chunk", "model": MODEL}
    delta = {"index": 0, "delta": {"content": "ok"}, "finish_reason": "stop"}
    chunks = [{**head, "choices": [delta]}, {**head, "choices": [], "usage": usage}]
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + (
        b"data: [DONE]\n\n"
    )


class Upstream:
    """An upstream that answers ``status`` (or a 200 stream); with ``hold``, only once
    ``release`` is set."""

    def __init__(self, status: int = 200, *, stream: bool = False, hold: bool = False) -> None:
        self.status = status
        self.stream = stream
        self.sent = 0
        self.release = asyncio.Event()
        if not hold:
            self.release.set()

    async def send(self, request: httpx.Request) -> httpx.Response:
        self.sent += 1
        await self.release.wait()
        kind, body = "application/json", answer_body(self.status)
        if self.stream:
            kind, body = "text/event-stream", stream_body()
        # An unread stream, as a real inner transport hands back.
        return httpx.Response(
            self.status,
            headers={"content-type": kind},
            stream=httpx.ByteStream(body),
            request=request,
        )


def make_runtime(
    ledger: Path | str,
    *,
    lease_s: float,
    heartbeat_s: float,
    sweep_s: float,
    clock: ManualClock | None = None,
) -> Runtime:
    """A runtime on ``ledger``; with ``clock``, its ledger's clock is that manual one."""
    providers = load_providers([], {"openai": UPSTREAM})
    config = RuntimeConfig(
        ledger_url=str(ledger),
        providers=providers,
        lease_s=lease_s,
        heartbeat_s=heartbeat_s,
        sweep_s=sweep_s,
    )
    runtime = Runtime(config)
    if clock is not None:  # still the runtime's own ledger: it opens and closes it
        runtime.ledger = Ledger(open_store(str(ledger), clock=clock))
    return runtime


@asynccontextmanager
async def taken_over_mid_call(
    runtime: Runtime,
    guard: Guard,
    request: httpx.Request,
    upstream: Upstream,
    *,
    interrupt_calls: bool,
) -> AsyncIterator[tuple[asyncio.Future[httpx.Response], Writer]]:
    """Send ``request`` through ``guard`` to the holding ``upstream``; once it is on the
    wire, a peer's sweep takes the guard's worker over (and, with ``interrupt_calls``,
    marks its call). Yields the call's task and the fenced registration. On exit the
    upstream is released, the task awaited and the peer stopped."""
    task = asyncio.ensure_future(guard.handle(guard.providers["openai"], request, upstream.send))
    peer = WorkerRuntime(
        runtime.ledger, lock_dir=None, lease_s=60, heartbeat_s=3600, sweep_s=3600, host="peer"
    )
    try:
        while upstream.sent == 0:
            await asyncio.sleep(0.01)
        old = guard.writer
        taker = await peer.start()
        await runtime.ledger.store.write(
            taker,
            lambda tx: operations.sweep(
                tx, taker, frozenset({old.worker}), interrupt_calls=interrupt_calls
            ),
        )
        yield task, old
    finally:
        upstream.release.set()
        with contextlib.suppress(Exception):
            await task
        await peer.stop()


# -- real processes -------------------------------------------------------------------


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
