"""``effectguard verify``: read a ledger and hand it to the independent verifier.

This module is only the reading half: it walks the store's events in pages and reads
the rows the store keeps for speed, all inside one snapshot, and passes them as plain
values to :class:`effectguard.ops.audit.Verifier`, which shares nothing with the store's
own fold (see :mod:`effectguard.ops.audit`).
"""

from __future__ import annotations

import dataclasses
import hashlib

from effectguard.ledger import Ledger
from effectguard.ledger.base import LedgerStore
from effectguard.ops.audit import (
    BodyRow,
    BudgetRow,
    KeyRow,
    PolicyRow,
    RateRow,
    Verifier,
    VerifyReport,
    WorkerRow,
    checkpoint,
)

__all__ = ["VerifyReport", "verify_ledger"]


async def verify_ledger(ledger: Ledger, page: int = 1000) -> VerifyReport:
    """Check the hash chain, every event's meaning, and every stored projection.

    Every read happens inside one snapshot, so a live ledger being written
    while it is verified shows no false corruption.
    """
    verifier = Verifier()
    async with ledger.store.snapshot():
        await _resume_at_cut(ledger, verifier)
        seq = 0
        while True:
            batch = await ledger.store.events_after(seq, page)
            if not batch:
                break
            for stored in batch:
                verifier.feed(stored)
            seq = batch[-1].seq
        await _compare_calls(ledger.store, verifier, page)
        nodes = await ledger.store.budget_nodes()
        policies = await ledger.store.budget_policies()
        workers = await ledger.store.workers()
        keys = await ledger.store.keys()
        windows = await ledger.store.rate_windows()
        lookups = await ledger.store.lookup_problems()
        bodies = await read_bodies(ledger.store)
    budget_rows = [BudgetRow(n.path, n.period, n.reserved, n.spent, n.held) for n in nodes]
    policy_rows = [
        PolicyRow(p.path, p.limit, p.period, p.tz, p.rpm, p.tpm, p.concurrency) for p in policies
    ]
    worker_rows = [WorkerRow(w.worker, w.generation, w.fenced) for w in workers]
    key_rows = [
        KeyRow(
            k.name,
            k.sha256,
            k.budget_root,
            k.created_at,
            k.expires_at,
            k.models,
            k.providers,
            k.revoked_at,
        )
        for k in keys
    ]
    rate_rows = [
        RateRow(w.path, w.minute, w.requests, w.tokens, w.since, w.reached) for w in windows
    ]
    report = verifier.finish(
        budget_rows, (), (), worker_rows, key_rows, policy_rows, rate_rows, bodies
    )
    for seq, problem in lookups:
        report.broken(seq, problem)
    return report


async def _compare_calls(store: LedgerStore, verifier: Verifier, page: int) -> None:
    """Hand the calls' stored rows, then their kept states, to the verifier a page at a
    time: it holds every call's fold already, and need not hold every row beside them."""
    verifier.end_of_events()  # its problems come before the rows', as the report says
    after: str | None = None
    while columns := await store.call_columns(after, page):
        verifier.check_columns(columns)
        after = str(columns[-1][0])
    after = None
    while states := await store.kept_states(after, page):
        verifier.check_states([dataclasses.asdict(state) for state in states])
        after = states[-1].call_id


class _Digest:
    """A sink for ``copy_body`` that keeps only the SHA-256 of what it is given."""

    def __init__(self) -> None:
        self.hash = hashlib.sha256()

    def write(self, chunk: bytes) -> int:
        self.hash.update(chunk)
        return len(chunk)


async def read_bodies(store: LedgerStore) -> list[BodyRow]:
    """Every stored body as the verifier compares it: its chunk numbers, and the size and
    SHA-256 of its chunks read in order (streamed, one chunk at a time; not read where a
    chunk is missing, which the verifier names from the numbers)."""
    seqs: dict[str, list[int]] = {}
    sizes: dict[str, int] = {}
    for call_id, seq, size in await store.body_chunks():
        seqs.setdefault(call_id, []).append(seq)
        sizes[call_id] = sizes.get(call_id, 0) + size
    rows = []
    for call_id, numbers in seqs.items():
        digest = None
        if numbers == list(range(len(numbers))):
            sink = _Digest()
            await store.copy_body(call_id, sink)  # type: ignore[arg-type]
            digest = sink.hash.hexdigest()
        rows.append(BodyRow(call_id, tuple(numbers), sizes[call_id], digest))
    return rows


async def _resume_at_cut(ledger: Ledger, verifier: Verifier) -> None:
    """Where events were archived, start the verifier from the checkpoint of the cut.

    The live chain then begins after the archived range; the checkpoint that archived
    events ``..first-1`` holds the digest the first live event must link to and the
    state the archived events left behind. Without one, the verifier names the missing
    checkpoint (and the chain check the gap).
    """
    head = await ledger.store.events_after(0, 1)
    if not head or head[0].seq == 1:
        return
    first = head[0].seq
    # Read by its kind, not found by decoding every live event before it (which read
    # the live ledger twice: once here, once to verify it).
    checkpoints = await ledger.store.checkpoint_events()
    found = next((c.data for c in checkpoints if c.data.get("last_seq") == first - 1), None)
    checkpoint.resume(verifier, found, first=first)
