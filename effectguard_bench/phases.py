"""Where one client's request spends its time before the first byte (issue #17, one client).

``python -m effectguard_bench.phases --requests 1000 [--stream] [--ledger-dir DIR]`` drives
the proxy app in-process at one client, as :mod:`effectguard_bench.inprocess` does, and
marks four points of every request: its arrival, the upstream send (admission is durable
by then), the upstream's answer, and the first body bytes the client receives. It prints
the median CPU time of the event-loop thread and the median wall time of each phase:

- *before dispatch*: parse, price, hash, admit and the admission's commit;
- *upstream*: the fake provider, and the loop's own work while it waits;
- *to the first byte*: reading the answer, the stream reader, the response's start.

Each phase also prints the median wall time of the ledger commits inside it (the
admission's before dispatch; a plain call's observation before its first byte): what
the durable points themselves cost, against what the guard's own code costs around
them. ``--ledger-dir /dev/shm`` puts the ledger on tmpfs, where ``fdatasync`` does not
wait: the difference from a run on disk is what the durable commit costs. With ``--profile OUT`` a
cProfile (in thread CPU time) covers only the *before dispatch* phase of every request.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import statistics
import time
from pathlib import Path
from typing import Any

from effectguard.config.settings import load_settings
from effectguard.ingress.server import create_app
from effectguard.ingress.serving import settle_gc
from effectguard.telemetry.metrics import Metrics
from effectguard_bench.inprocess import _scope, in_loop
from effectguard_bench.loadgen import request_body

Mark = tuple[float, float]  # (thread CPU seconds, perf_counter seconds)


def _mark() -> Mark:
    return time.thread_time(), time.perf_counter()


class _Phases:
    """The marks of the request in progress (one client: one request at a time)."""

    def __init__(self, profile: cProfile.Profile | None) -> None:
        self.profile = profile
        self.marks: dict[str, Mark] = {}
        self.rows: list[dict[str, Mark]] = []
        #: Wall seconds of the commits in the request in progress, by when they ended.
        self.commits: list[float] = []
        self.commit_rows: list[list[tuple[float, float]]] = []
        self._spans: list[tuple[float, float]] = []

    def wrap_commit(self, commit: Any) -> Any:
        def timed() -> None:
            started = time.perf_counter()
            try:
                commit()
            finally:
                self._spans.append((started, time.perf_counter()))

        return timed

    def wrap(self, send: Any) -> Any:
        async def marked(request: Any) -> Any:
            self.marks["send"] = _mark()
            if self.profile is not None:
                self.profile.disable()
            answer = await send(request)
            self.marks["answered"] = _mark()
            return answer

        return marked

    async def one(self, app: Any, body: bytes) -> None:
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if sent:
                await asyncio.Event().wait()  # the client never goes away here
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                self.marks.setdefault("first", _mark())

        self.marks, self._spans = {"arrived": _mark()}, []
        if self.profile is not None:
            self.profile.enable()
        await app(_scope(body), receive, send)
        if len(self.marks) == 4:
            self.rows.append(self.marks)
            self.commit_rows.append(self._spans)

    def report(self) -> str:
        def median(a: str, b: str, clock: int) -> float:
            return statistics.median(r[b][clock] - r[a][clock] for r in self.rows) * 1000

        def committing(a: str, b: str) -> float:
            """Median wall time of the commits that ended between marks ``a`` and ``b``."""
            walls = [
                sum(end - start for start, end in spans if r[a][1] <= end <= r[b][1])
                for r, spans in zip(self.rows, self.commit_rows, strict=True)
            ]
            return statistics.median(walls) * 1000

        lines = [f"{len(self.rows)} requests; medians, ms (CPU of the loop thread, wall):"]
        for name, a, b in (
            ("before dispatch", "arrived", "send"),
            ("upstream", "send", "answered"),
            ("to the first byte", "answered", "first"),
        ):
            lines.append(
                f"  {name:18} CPU {median(a, b, 0):.3f}  wall {median(a, b, 1):.3f}"
                f"  (of which ledger commits {committing(a, b):.3f})"
            )
        return "\n".join(lines)


async def _run(args: argparse.Namespace, upstream: str, ledger_dir: Path) -> None:
    settings = load_settings(ledger=str(ledger_dir / "ledger.db"), upstreams={"openai": upstream})
    app = create_app(settings, metrics=Metrics())
    await app.startup()
    settle_gc()  # as serve does once started
    profile = cProfile.Profile(time.thread_time) if args.profile else None
    phases = _Phases(None)
    # The proxy's upstream leg, wrapped to mark its send: a measurement hook, not an API.
    app._send = phases.wrap(app._send)
    store: Any = app.runtime.ledger.store  # the SQLite store: its writer's session
    session = store.committer._session
    session.commit = phases.wrap_commit(session.commit)
    try:
        body = request_body(args.stream)
        for _ in range(100):  # warm-up: caches, pools, pages
            await phases.one(app, body)
        phases.rows, phases.commit_rows, phases.profile = [], [], profile
        for _ in range(args.requests):
            await phases.one(app, body)
    finally:
        await app.shutdown()
    print(f"stream={args.stream} ledger in {ledger_dir}")
    print(phases.report())
    if profile is not None:
        profile.dump_stats(args.profile)


def main(argv: list[str] | None = None) -> int:
    """Run the phase split (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="effectguard_bench.phases")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--stream", action="store_true", help="streamed chat completions")
    parser.add_argument("--ledger-dir", type=Path, help="where the ledger goes (a temp dir)")
    parser.add_argument("--profile", metavar="OUT", help="cProfile of the pre-dispatch phase")
    args = parser.parse_args(argv)
    in_loop(lambda upstream, work: _run(args, upstream, work), "info", args.ledger_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
