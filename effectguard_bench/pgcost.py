"""What an admit+settle pair costs the PostgreSQL writer: round trips, statements, CPU.

``python -m effectguard_bench.pgcost DSN [SECONDS]`` runs the ledger benchmark's loop
(:mod:`effectguard_bench.ledgerbench`) at 1 and 64 callers on the ledger at ``DSN`` and
prints, per writer batch, the round trips and statements the writer sent, and per pair
the CPU of this process and of the writer's server backend (``/proc/PID/schedstat``;
the database must run on this machine). CPU per pair moves far less than pairs per
second when the machine is shared, so it is the figure to compare before and after.

Statements and round trips are counted by wrapping psycopg's ``Cursor.execute`` and
``Connection.pipeline`` in this process (a diagnostic, never done by the store): a
pipeline is one round trip, a statement outside one is one round trip of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg

from effectguard.ledger import Ledger, Writer
from effectguard_bench.ledgerbench import RESERVE, admit_request, outcome_events, register


class Counter:
    """Statements and round trips sent by connections marked ``counted``."""

    def __init__(self) -> None:
        self.statements = 0
        self.round_trips = 0
        self._depth = 0

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Wrap psycopg's execute and pipeline for the block."""
        execute, pipeline = psycopg.Cursor.execute, psycopg.Connection.pipeline
        counter = self

        def counted_execute(cursor: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(cursor.connection, "counted", False):
                counter.statements += 1
                counter.round_trips += counter._depth == 0
            return execute(cursor, *args, **kwargs)

        @contextlib.contextmanager
        def counted_pipeline(conn: Any) -> Iterator[Any]:
            counter.round_trips += bool(getattr(conn, "counted", False))
            counter._depth += 1
            try:
                with pipeline(conn) as p:
                    yield p
            finally:
                counter._depth -= 1

        setattr(psycopg.Cursor, "execute", counted_execute)  # noqa: B010 (a diagnostic)
        setattr(psycopg.Connection, "pipeline", counted_pipeline)  # noqa: B010
        try:
            yield
        finally:
            setattr(psycopg.Cursor, "execute", execute)  # noqa: B010
            setattr(psycopg.Connection, "pipeline", pipeline)  # noqa: B010


def _backend_ns(pid: int) -> int:
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])


def _mark_writer(tx: Any) -> int:
    tx.conn.counted = True
    return int(tx.conn.info.backend_pid)


async def measure(dsn: str, callers: int, seconds: float, counter: Counter) -> str:
    """One line of figures for ``callers`` callers over ``seconds``."""
    async with Ledger.open(dsn) as ledger:
        writer = await register(ledger, lease_s=seconds + 60)
        pid = await ledger.store.write(Writer("pgcost", 0), _mark_writer)
        budget = f"bench/{uuid.uuid4().hex[:8]}"
        request = admit_request(budget)
        pairs = 0

        async def caller(deadline: float) -> None:
            nonlocal pairs
            while time.perf_counter() < deadline:
                admitted = await ledger.admit(writer, request)
                events = outcome_events(admitted.call_id, admitted.attempt, budget, RESERVE)
                await ledger.record(writer, admitted.call_id, admitted.attempt, events)
                pairs += 1

        committer = ledger.store.committer  # type: ignore[attr-defined]
        commits, statements, trips = (
            committer.stats.commits,
            counter.statements,
            counter.round_trips,
        )
        cpu, server, began = time.process_time(), _backend_ns(pid), time.perf_counter()
        await asyncio.gather(*(caller(began + seconds) for _ in range(callers)))
        elapsed = time.perf_counter() - began
        cpu, server = time.process_time() - cpu, _backend_ns(pid) - server
        per_pair = 1e6 / max(pairs, 1)
        batches = max(1, committer.stats.commits - commits)
        return (
            f"callers {callers:3}: {pairs / elapsed:7.0f} pairs/s, "
            f"{(counter.round_trips - trips) / batches:5.2f} round trips and "
            f"{(counter.statements - statements) / batches:5.2f} statements per batch "
            f"({2 * pairs / batches:5.1f} ops), CPU per pair: this process "
            f"{cpu * per_pair:5.0f} us, writer backend {server / 1e9 * per_pair:5.0f} us"
        )


def main(argv: list[str]) -> int:
    """Print the figures at 1 and 64 callers."""
    dsn, seconds = argv[0], float(argv[1]) if len(argv) > 1 else 3.0
    counter = Counter()
    with counter.installed():
        for callers in (1, 64):
            print(asyncio.run(measure(dsn, callers, seconds, counter)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
