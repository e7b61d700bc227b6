"""Start-up recovery on a large ledger: from ``effectguard serve`` to the first answer.

:func:`build_ledger` writes N completed calls (six events each) plus a few
calls left in flight by a worker whose lease has lapsed, straight through a
SQLite write session in large transactions. It runs the ledger's own
operations (``operations.append`` seals, chains and folds every event), so the
result is a ledger that ``effectguard verify`` accepts, only written faster
than the guard would write it. Then :func:`run` times ``effectguard serve``
from ``Popen`` to its first served request: the start-up sweep that takes the
dead worker over and marks its calls ``effect_unknown`` is inside that time.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from effectguard.ledger import Ledger, Writer, operations
from effectguard.ledger.sqlitesession import SqliteSession
from effectguard.rules.events import AttemptStarted, BudgetReserved, CallManifest, Event
from effectguard.testing import free_port
from effectguard_bench.ledgerbench import outcome_events
from effectguard_bench.loadgen import MODEL, request_body
from effectguard_bench.processes import Child, Pinning, first_served, python_module, spawn

IN_FLIGHT = 8
_BATCH = 20_000
_BUDGET = "bench"
_RESERVE = 10_000
_START_TIMEOUT = 60.0


@dataclass(frozen=True, slots=True)
class RecoveryResult:
    """How long the ledger took to build and the proxy to serve on it."""

    calls: int
    in_flight: int
    build_seconds: float
    ledger_mb: float
    start_to_first_served_s: float
    interrupted: int

    def to_json(self) -> dict[str, Any]:
        """The result as a JSON-ready dict."""
        return {
            "calls": self.calls,
            "in_flight": self.in_flight,
            "build_seconds": round(self.build_seconds, 1),
            "ledger_mb": round(self.ledger_mb, 1),
            "start_to_first_served_s": round(self.start_to_first_served_s, 3),
            "interrupted_by_sweep": self.interrupted,
        }


def _started_events(call_id: str, writer: Writer, now: float) -> list[Event]:
    return [
        CallManifest(
            call=call_id,
            request_hash=uuid.uuid4().hex,
            provider="openai",
            endpoint="/v1/chat/completions",
            method="POST",
            model=MODEL,
            idempotency_key=None,
            budget=_BUDGET,
            budget_root=_BUDGET,
            effect_kind="billable",
            body='{"model":"gpt-4o-mini"}',
            at=now,
        ),
        BudgetReserved(call=call_id, budget=_BUDGET, amount=_RESERVE),
        AttemptStarted(
            call=call_id, attempt=1, worker=writer.worker, generation=writer.generation, at=now
        ),
    ]


def build_ledger(path: Path, calls: int, in_flight: int = IN_FLIGHT) -> None:
    """Write ``calls`` completed calls and ``in_flight`` calls of a dead worker to ``path``."""
    session = SqliteSession(str(path))
    try:
        session.begin()
        # Lease 0 and a host that is not this one: both workers are dead by lease expiry.
        loader, dead = (
            operations.register_worker(
                session, worker=f"bench-{name}", host="bench-gone", pid=0, lease_s=0
            )
            for name in ("loader", "dead")
        )
        session.commit()
        written = 0
        while written < calls:
            session.begin()
            now = session.now()
            for _ in range(min(_BATCH, calls - written)):
                call_id = "call_" + uuid.uuid4().hex
                events = _started_events(call_id, loader, now)
                events += outcome_events(call_id, 1, _BUDGET, _RESERVE)
                operations.append(session, loader, events)
            session.commit()
            written += min(_BATCH, calls - written)
        session.begin()
        for _ in range(in_flight):
            operations.append(
                session, dead, _started_events("call_" + uuid.uuid4().hex, dead, session.now())
            )
        session.commit()
    finally:
        session.close()


async def _effect_unknown(path: Path) -> int:
    async with Ledger.open(str(path)) as ledger:
        return len(await ledger.calls(stage="effect_unknown", limit=1 << 30))


def run(fake: Child, pins: Pinning, calls: int, work: Path) -> RecoveryResult:
    """Build a ledger of ``calls`` calls, then time ``effectguard serve`` on it."""
    path = work / "recovery-ledger.db"
    started = time.perf_counter()
    build_ledger(path, calls)
    build_seconds = time.perf_counter() - started
    size = sum(p.stat().st_size for p in work.glob("recovery-ledger.db*") if p.is_file())
    port = free_port()
    command = python_module(
        "effectguard",
        "serve",
        "--ledger",
        str(path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--upstream",
        f"openai={fake.url}",
    )
    proxy = spawn("effectguard-recovery", command, pins.proxy, work / "recovery.log")
    with contextlib.ExitStack() as stack:
        stack.callback(proxy.stop)
        seconds = first_served(
            proxy,
            "127.0.0.1",
            port,
            "/openai/v1/chat/completions",
            request_body(False),
            _START_TIMEOUT,
        )
    return RecoveryResult(
        calls=calls,
        in_flight=IN_FLIGHT,
        build_seconds=build_seconds,
        ledger_mb=size / 1e6,
        start_to_first_served_s=seconds,
        interrupted=asyncio.run(_effect_unknown(path)),
    )
