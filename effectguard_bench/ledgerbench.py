"""The ledger micro-benchmark: admit+settle pairs per second, with group commit visible.

N callers each loop admit → record(observed, settled, completed), exactly the
two durable writes the guard makes per call, against a file ledger (SQLite,
``synchronous=FULL``) and, given a DSN, PostgreSQL. The committer's counters
show how many operations each commit carried: at 1 caller about one, at 64
many, which is where the throughput comes from.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from effectguard.errors import EffectguardError
from effectguard.ledger import AdmitRequest, Ledger, Writer, operations
from effectguard.rules.events import AttemptObserved, BudgetSettled, CallCompleted, Event
from effectguard_bench.loadgen import MODEL, percentile, request_body

if TYPE_CHECKING:
    from effectguard_bench.storagebench import StorageCost

CALLERS = (1, 64)
RESERVE = 10_000  # nano-dollars
_RESPONSE = json.dumps({"id": "chatcmpl-bench", "choices": [], "usage": {}})
#: The request and response bodies' own bytes in each benchmark call.
BODY_BYTES_PER_CALL = len(request_body(False)) + len(_RESPONSE.encode())


@dataclass(frozen=True, slots=True)
class LedgerSample:
    """Pairs completed by ``callers`` concurrent callers, and the commits they took."""

    engine: str
    callers: int
    pairs: int
    seconds: float
    p50_ms: float
    p99_ms: float
    commits: int | None
    operations: int | None

    @property
    def pairs_per_second(self) -> float:
        """Admit+settle pairs per second."""
        return self.pairs / self.seconds if self.seconds > 0 else 0.0

    @property
    def operations_per_commit(self) -> float | None:
        """Operations that shared one commit, on average (None if the store does not say)."""
        if not self.commits or self.operations is None:
            return None
        return self.operations / self.commits

    def to_json(self) -> dict[str, Any]:
        """The sample as a JSON-ready dict."""
        per_commit = self.operations_per_commit
        return {
            "engine": self.engine,
            "callers": self.callers,
            "pairs": self.pairs,
            "seconds": round(self.seconds, 3),
            "pairs_per_second": round(self.pairs_per_second, 1),
            "pair_p50_ms": round(self.p50_ms, 3),
            "pair_p99_ms": round(self.p99_ms, 3),
            "commits": self.commits,
            "operations": self.operations,
            "operations_per_commit": None if per_commit is None else round(per_commit, 2),
        }


@dataclass
class LedgerResult:
    """Every sample, and why an engine was skipped."""

    samples: list[LedgerSample] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: Bytes per call and WAL pages per commit on SQLite (None: not measured).
    storage: StorageCost | None = None


def admit_request(budget: str) -> AdmitRequest:
    """A chat admission as the guard makes one: its request hash a SHA-256 in hex (each
    call's its own), its endpoint ``at_most_once`` (what a billable endpoint declares)."""
    body = request_body(False).decode()
    return AdmitRequest(
        request_hash=hashlib.sha256(uuid.uuid4().bytes).hexdigest(),
        provider="openai",
        endpoint="/v1/chat/completions",
        method="POST",
        model=MODEL,
        idempotency_key=None,
        budget=budget,
        budget_root=budget.split("/", 1)[0],
        effect_kind="at_most_once",
        body=body,
        body_encoding="utf8",
        stream=False,
        reserve=RESERVE,
    )


def outcome_events(call_id: str, attempt: int, budget: str, reserved: int) -> list[Event]:
    """What the guard records for a completed call: observed, settled, completed."""
    usage = {"input_tokens": 12, "output_tokens": 16, "cached_input_tokens": 0}
    return [
        AttemptObserved(
            call=call_id,
            attempt=attempt,
            status=200,
            not_processed=False,
            usage=usage | {"cache_write_tokens": 0},
            usage_problem=None,
            headers={"content-type": "application/json"},
            body=_RESPONSE,
        ),
        BudgetSettled(call=call_id, budget=budget, reserved=reserved, actual=reserved // 2),
        CallCompleted(call=call_id, outcome="completed"),
    ]


def _commit_counts(ledger: Ledger) -> tuple[int, int] | None:
    committer = getattr(ledger.store, "committer", None)
    stats = getattr(committer, "stats", None)
    return None if stats is None else (stats.commits, stats.operations)


async def _pairs(
    ledger: Ledger, writer: Writer, engine: str, callers: int, duration: float
) -> LedgerSample:
    budget = f"bench/{uuid.uuid4().hex[:8]}"
    request = admit_request(budget)
    latencies: list[float] = []

    async def caller(deadline: float) -> None:
        while (started := time.perf_counter()) < deadline:
            admitted = await ledger.admit(writer, request)
            if admitted.action != "admit":
                raise RuntimeError(f"admission refused: {admitted.refusal}")
            events = outcome_events(admitted.call_id, admitted.attempt, budget, RESERVE)
            await ledger.record(writer, admitted.call_id, admitted.attempt, events)
            latencies.append(time.perf_counter() - started)

    before = _commit_counts(ledger)
    begin = time.perf_counter()
    await asyncio.gather(*(caller(begin + duration) for _ in range(callers)))
    elapsed = time.perf_counter() - begin
    after = _commit_counts(ledger)
    latencies.sort()
    commits = ops = None
    if before is not None and after is not None:
        commits, ops = after[0] - before[0], after[1] - before[1]
    return LedgerSample(
        engine=engine,
        callers=callers,
        pairs=len(latencies),
        seconds=elapsed,
        p50_ms=percentile(latencies, 50) * 1000,
        p99_ms=percentile(latencies, 99) * 1000,
        commits=commits,
        operations=ops,
    )


async def register(ledger: Ledger, lease_s: float) -> Writer:
    """Register this process as a new writer on ``ledger``."""
    worker = f"bench-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    writer: Writer = await ledger.store.write(
        Writer(worker, 0),
        lambda tx: operations.register_worker(
            tx, worker=worker, host=socket.gethostname(), pid=os.getpid(), lease_s=lease_s
        ),
    )
    return writer


async def bench_engine(
    url: str, engine: str, callers: Sequence[int], duration: float
) -> list[LedgerSample]:
    """Register a worker on the ledger at ``url`` and measure each caller count."""
    async with Ledger.open(url) as ledger:
        writer = await register(ledger, lease_s=duration * len(callers) + 60)
        return [await _pairs(ledger, writer, engine, n, duration) for n in callers]


async def measure_pairs(
    url: str, engine: str, callers: int, duration: float, ready: Callable[[], Awaitable[None]]
) -> LedgerSample:
    """Open the ledger at ``url``, register a worker, await ``ready``, then measure."""
    async with Ledger.open(url) as ledger:
        writer = await register(ledger, lease_s=duration + 60)
        await ready()
        return await _pairs(ledger, writer, engine, callers, duration)


def run(work: Path, duration: float, pg_dsn: str | None = None) -> LedgerResult:
    """SQLite in ``work`` (and PostgreSQL at ``pg_dsn``) at 1 and 64 callers."""
    result = LedgerResult()
    sqlite_url = str(work / "ledger-bench.db")
    result.samples += asyncio.run(bench_engine(sqlite_url, "sqlite", CALLERS, duration))
    if pg_dsn:
        try:
            result.samples += asyncio.run(bench_engine(pg_dsn, "postgresql", CALLERS, duration))
        except ImportError as exc:
            result.notes.append(f"postgresql skipped: no PostgreSQL ledger store here ({exc})")
        except EffectguardError as exc:  # unreachable or refused: keep the SQLite figures
            result.notes.append(f"postgresql skipped: {exc}")
    return result
