"""The proxy app driven in-process, for profiles that do not depend on a busy machine.

``python -m effectguard_bench.inprocess --requests 3000 --concurrency 32 [--profile OUT]``
starts the fake provider in a child process, builds the proxy app as ``effectguard
serve`` does (metrics, access log to a file, uvloop) and calls it through ASGI directly
(no uvicorn, no client sockets), then prints the proxy's CPU seconds per request: the
guard's own work, plus aiohttp's and the ledger's. With ``--profile`` it writes a
cProfile (in CPU time) of the timed requests (``python -m pstats OUT``). CPU time is
counted for this process only, so other load on the machine moves it far less than
wall time. ``--baseline`` drives the bare baseline proxy the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import logging
import os
import resource
import tempfile
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

from effectguard.config.settings import load_settings
from effectguard.ingress.server import create_app
from effectguard.ingress.serving import settle_gc
from effectguard.telemetry.logs import configure_logging
from effectguard.telemetry.metrics import Metrics
from effectguard_bench.baseline import BareProxy
from effectguard_bench.loadgen import request_body
from effectguard_bench.processes import python_module, spawn_announcing

_CHAT = "/openai/v1/chat/completions"


def _scope(body: bytes) -> dict[str, Any]:
    headers = [
        (b"host", b"127.0.0.1"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"authorization", b"Bearer sk-test"),
    ]
    return {
        "type": "http",
        "method": "POST",
        "path": _CHAT,
        "raw_path": _CHAT.encode(),
        "query_string": b"",
        "headers": headers,
    }


async def _one(app: Any, body: bytes) -> int:
    sent = False
    status = 0

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            await asyncio.Event().wait()  # the client never goes away here
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(_scope(body), receive, send)
    return status


async def _drive(app: Any, body: bytes, requests: int, concurrency: int) -> int:
    left = requests
    failed = 0

    async def client() -> None:
        nonlocal left, failed
        while left > 0:
            left -= 1
            if await _one(app, body) != 200:
                failed += 1

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return failed


def _commit_stats(app: Any) -> Any:
    """The ledger committer's counters (how many commits the requests took), if any."""
    runtime = getattr(app, "runtime", None)
    committer = getattr(getattr(runtime, "ledger", None), "store", None)
    return getattr(getattr(committer, "committer", None), "stats", None)


async def _run(args: argparse.Namespace, upstream: str, work: Path) -> None:
    if args.baseline:
        app: Any = BareProxy(upstream)
        lifespan = _Lifespan(app)
        await lifespan.phase("startup")
    else:
        settings = load_settings(ledger=str(work / "ledger.db"), upstreams={"openai": upstream})
        app = create_app(settings, metrics=Metrics())
        await app.startup()
        settle_gc()  # as serve does once started
    try:
        body = request_body(args.stream)
        await _drive(app, body, 200, args.concurrency)  # warm-up: caches, pools, pages
        # CPU time, not wall time: a commit's fdatasync waits without using the CPU.
        profile = cProfile.Profile(time.process_time) if args.profile else None
        stats = _commit_stats(app)
        commits = stats.commits if stats is not None else 0
        times, wall = os.times(), time.perf_counter()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        if profile is not None:
            profile.enable()
        failed = await _drive(app, body, args.requests, args.concurrency)
        if profile is not None:
            profile.disable()
            profile.dump_stats(args.profile)
        after, wall = os.times(), time.perf_counter() - wall
        end = resource.getrusage(resource.RUSAGE_SELF)
        # Voluntary switches: the process slept (waited for the upstream, an fsync, a lock).
        sleeps = (end.ru_nvcsw - usage.ru_nvcsw) / args.requests
        user, system = after.user - times.user, after.system - times.system
        per = 1000 / args.requests
        print(
            f"concurrency={args.concurrency} requests={args.requests} failed={failed} "
            f"cpu_ms_per_request={(user + system) * per:.3f} (user {user * per:.3f}, "
            f"system {system * per:.3f}) wall_ms_per_request={wall * per:.3f} "
            f"sleeps_per_request={sleeps:.2f}"
            + (
                ""
                if stats is None
                else f" commits_per_request={(stats.commits - commits) / args.requests:.3f}"
            )
        )
    finally:
        if args.baseline:
            await lifespan.phase("shutdown")
        else:
            await app.shutdown()


class _Lifespan:
    """An ASGI app's lifespan, driven by hand (the baseline has no startup method)."""

    def __init__(self, app: Any) -> None:
        self._inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._task = asyncio.ensure_future(
            app({"type": "lifespan"}, self._inbox.get, self._outbox.put)
        )

    async def phase(self, name: str) -> None:
        await self._inbox.put({"type": f"lifespan.{name}"})
        await self._outbox.get()


@contextlib.contextmanager
def _fake_provider(work: Path) -> Iterator[str]:
    command = python_module("effectguard.testing.fakeprovider", "--port", "0")
    fake = spawn_announcing(
        "fake provider", command, None, "fake-provider listening on ", 20.0, work / "fake.log"
    )
    try:
        yield fake.url
    finally:
        fake.stop()


def main(argv: list[str] | None = None) -> int:
    """Run the in-process profile (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="effectguard_bench.inprocess")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--stream", action="store_true", help="streamed chat completions")
    parser.add_argument("--log-level", default="info", help="as serve --log-level (info)")
    parser.add_argument(
        "--baseline", action="store_true", help="drive the bare baseline proxy instead"
    )
    parser.add_argument("--profile", metavar="OUT", help="write a cProfile of the timed part")
    args = parser.parse_args(argv)
    in_loop(lambda upstream, work: _run(args, upstream, work), args.log_level)
    return 0


def in_loop(
    run: Callable[[str, Path], Coroutine[Any, Any, None]],
    log_level: str,
    ledger_dir: Path | None = None,
) -> None:
    """Run ``run(upstream, work)`` on uvloop (as ``serve`` does), with the fake provider in a
    child process, the access log to a file at ``log_level``, and ``work`` a temporary
    directory (under ``ledger_dir`` if given) for the ledger."""
    with tempfile.TemporaryDirectory(dir=ledger_dir) as tmp:
        work = Path(tmp)
        with (work / "access.log").open("w") as log:
            configure_logging("text", log_level, stream=log)
            with _fake_provider(work) as upstream:
                try:
                    import uvloop

                    runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
                except ImportError:
                    runner = asyncio.Runner()
                with runner:
                    runner.run(run(upstream, work))
            logging.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
