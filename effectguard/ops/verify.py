"""``effectguard verify``: read a ledger and hand it to the independent verifier.

This module is only the reading half: it walks the store's events in pages and reads
the rows the store keeps for speed, all inside one snapshot, and passes them as plain
values to :class:`effectguard.ops.audit.Verifier`, which shares nothing with the store's
own fold (see :mod:`effectguard.ops.audit`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from effectguard.ledger import Ledger
from effectguard.ops.audit import (
    BudgetRow,
    KeyRow,
    PolicyRow,
    Verifier,
    VerifyReport,
    WorkerRow,
)

__all__ = ["VerifyReport", "verify_ledger"]


async def verify_ledger(ledger: Ledger, page: int = 5000) -> VerifyReport:
    """Check the hash chain, every event's meaning, and every stored projection.

    Every read happens inside one snapshot, so a live ledger being written
    while it is verified shows no false corruption.
    """
    verifier = Verifier()
    async with ledger.store.snapshot():
        seq = 0
        while True:
            batch = await ledger.store.events_after(seq, page)
            if not batch:
                break
            for stored in batch:
                verifier.feed(stored)
            seq = batch[-1].seq
        nodes = await ledger.store.budget_nodes()
        policies = await ledger.store.budget_policies()
        calls = await ledger.store.list_calls(limit=1 << 62)
        columns = await ledger.store.call_columns()
        workers = await ledger.store.workers()
        keys = await ledger.store.keys()
    budget_rows = [BudgetRow(n.path, n.period, n.reserved, n.spent, n.held) for n in nodes]
    policy_rows = [
        PolicyRow(p.path, p.limit, p.period, p.tz, p.rpm, p.tpm, p.concurrency) for p in policies
    ]
    states: list[dict[str, Any]] = [dataclasses.asdict(state) for state in calls]
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
    return verifier.finish(budget_rows, states, columns, worker_rows, key_rows, policy_rows)
