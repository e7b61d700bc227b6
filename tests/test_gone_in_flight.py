"""Gone workers' calls in flight are read in one query: by the start page, and by a sweep.

The start page reads the calls in flight of every worker not judged alive, a fenced
worker's among them (a sweep that could only fence it left its calls in flight).

On SQLite no index has a call's worker: each read of one worker's calls in flight walked
every unresolved call (the partial index ``calls_unresolved``). The start page read one
gone worker at a time, up to 20 of them: with 20,000 calls effect unknown and 20 gone
workers its calls took 1.4-2.2 s (effectguard_bench.gonebench). A sweep did the same
inside its write transaction, which every writer of the ledger waits on (1.8 s there).
Now the calls in flight of every gone worker are one read: one walk, however many.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from admitkit import admit_request

from effectguard.callpath.takeover import gone_in_flight
from effectguard.ledger import AdmitRequest, Ledger, Writer, operations
from effectguard.ledger.base import Tx
from effectguard.rules.liveness import LEASE_EXPIRED, TAKEN_OVER
from effectguard.rules.workstate import WorkState
from effectguard.testing.clock import ManualClock


def _request(n: int) -> AdmitRequest:
    return admit_request(request_hash=f"hash-{n}")


async def _register(ledger: Ledger, worker: str, lease_s: float) -> Writer:
    return await ledger.store.write(
        Writer("boot", 0),
        lambda tx: operations.register_worker(tx, worker=worker, host="h", pid=1, lease_s=lease_s),
    )


@pytest.mark.parametrize("url", ["memory://", "sqlite"])
async def test_the_calls_of_every_worker_not_alive_are_read_in_one_query(
    tmp_path: Path, url: str
) -> None:
    """Three workers gone by their lease, two calls in flight each, a fenced worker's call
    a sweep left in flight, a live worker's call and a call effect unknown: the seven are
    listed (the fenced worker's as taken over), read by one in_flight_except; a worker
    that registers between the read of the workers and that of the calls is alive when
    each call is judged, and its call is not listed."""
    clock = ManualClock()
    location = str(tmp_path / "ledger.db") if url == "sqlite" else url
    async with Ledger.open(location, clock=clock) as ledger:
        gone = [await _register(ledger, f"gone-{i}", lease_s=1) for i in range(4)]
        expected = {}
        for i, writer in enumerate(gone):
            for j in range(2 if i < 3 else 1):
                admitted = await ledger.admit(writer, _request(10 * i + j))
                expected[admitted.call_id] = LEASE_EXPIRED if i < 3 else TAKEN_OVER
        unknown = await ledger.admit(gone[0], _request(99))
        await ledger.interrupt(gone[0], unknown.call_id, 1, "read timeout")
        clock.advance(5)
        live = await _register(ledger, "live", lease_s=60)
        await ledger.admit(live, _request(100))
        # A sweep that could only fence gone-3 (its lease alone seen unchanged).
        leases = {r.worker: r.lease_expires for r in await ledger.store.live_workers()}
        held = {"gone-3": leases["gone-3"]}
        await ledger.store.write(
            live, lambda tx: operations.sweep(tx, live, interrupt_calls=False, held_still=held)
        )
        reads: list[Any] = []
        store_read = ledger.store.in_flight_except

        async def counted(*args: Any) -> Any:
            reads.append(args)
            late = await _register(ledger, "late", lease_s=60)  # after the workers' read
            await ledger.admit(late, _request(101))
            return await store_read(*args)

        ledger.store.in_flight_except = counted  # type: ignore[method-assign]
        found, more = await gone_in_flight(ledger, None, limit=50)
    assert {call.call_id: why for call, why in found} == expected
    assert not more
    assert len(reads) == 1, reads


class _CountingTx:
    """A transaction that counts its reads of calls in flight by worker."""

    def __init__(self, tx: Tx) -> None:
        self._tx = tx
        self.reads: list[list[str]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tx, name)

    def in_flight_of(self, workers: Any) -> list[WorkState]:
        self.reads.append(list(workers))
        return self._tx.in_flight_of(workers)


@pytest.mark.parametrize("url", ["memory://", "sqlite"])
async def test_a_sweep_reads_the_calls_of_every_worker_it_takes_over_in_one_query(
    tmp_path: Path, url: str
) -> None:
    """Three workers gone by their lease, two calls in flight each: one sweep takes the
    three over and marks the six calls, each worker's taken-over event before its calls'
    interrupts as before, with one read of calls in flight."""
    clock = ManualClock()
    location = str(tmp_path / "ledger.db") if url == "sqlite" else url
    async with Ledger.open(location, clock=clock) as ledger:
        gone = [await _register(ledger, f"gone-{i}", lease_s=1) for i in range(3)]
        owner = {}
        for i, writer in enumerate(gone):
            for j in range(2):
                admitted = await ledger.admit(writer, _request(10 * i + j))
                owner[admitted.call_id] = writer.worker
        clock.advance(5)
        sweeper = await _register(ledger, "sweeper", lease_s=60)
        counted: list[_CountingTx] = []

        def sweep(tx: Tx) -> list[str]:
            counted.append(_CountingTx(tx))
            return operations.sweep(counted[-1], sweeper)  # type: ignore[arg-type]

        marked = await ledger.store.write(sweeper, sweep)
        events = await ledger.store.events_after(0, 1 << 30)
    assert sorted(marked) == sorted(owner)
    order = [
        e.data["worker"] if e.kind == "worker.taken_over" else owner[str(e.call_id)]
        for e in events
        if e.kind in ("worker.taken_over", "attempt.interrupted")
    ]
    assert order == [w.worker for w in gone for _ in range(3)], order
    assert [len(tx.reads) for tx in counted] == [1], [tx.reads for tx in counted]
