"""Row encodings shared by the SQL stores (events, call states, workers)."""

from __future__ import annotations

import json
from typing import Any

from effectguard.ledger.base import WorkerRow
from effectguard.rules.events import StoredEvent
from effectguard.rules.workstate import WorkState, as_dict

EVENT_COLUMNS = "seq, kind, call_id, data, worker, generation, at, prev_digest, digest"
INDEX_COLUMNS = (
    "call_id, stage, budget, budget_root, idempotency_key, request_hash, provider, "
    "created_at, worker"
)
CALL_COLUMNS = (
    "call_id, stage, budget, budget_root, idempotency_key, request_hash, provider, "
    "created_at, worker, state"
)


def event_params(event: StoredEvent, data_json: str) -> tuple[Any, ...]:
    """Parameters for inserting one event, in :data:`EVENT_COLUMNS` order."""
    return (
        event.seq,
        event.kind,
        event.call_id,
        data_json,
        event.worker,
        event.generation,
        event.at,
        event.prev_digest,
        event.digest,
    )


def event_from_row(row: tuple[Any, ...] | Any) -> StoredEvent:
    """A stored event from a row in :data:`EVENT_COLUMNS` order."""
    seq, kind, call_id, data, worker, generation, at, prev_digest, digest = row
    return StoredEvent(
        seq=int(seq),
        kind=kind,
        call_id=call_id,
        data=json.loads(data),
        worker=worker,
        generation=int(generation),
        at=float(at),
        prev_digest=prev_digest,
        digest=digest,
    )


_COMPACT = json.JSONEncoder(separators=(",", ":"))


def state_params(state: WorkState) -> tuple[Any, ...]:
    """Parameters for storing a call state, in :data:`CALL_COLUMNS` order.

    A refused call does not hold its idempotency key: the key stays free for
    the client's next try.
    """
    key = None if state.stage == "refused" else state.idempotency_key
    return (
        state.call_id,
        state.stage,
        state.budget,
        state.budget_root,
        key,
        state.request_hash,
        state.provider,
        state.created_at,
        state.worker,
        _COMPACT.encode(as_dict(state)),
    )


def state_from_json(text: str) -> WorkState:
    """A call state from its stored JSON."""
    return WorkState(**json.loads(text))


WORKER_COLUMNS = "worker, generation, host, pid, lease_expires, fenced"


def worker_from_row(row: tuple[Any, ...] | Any) -> WorkerRow:
    """A worker row from a row in :data:`WORKER_COLUMNS` order."""
    worker, generation, host, pid, lease_expires, fenced = row
    return WorkerRow(
        worker=worker,
        generation=int(generation),
        host=host,
        pid=int(pid),
        lease_expires=float(lease_expires),
        fenced=bool(fenced),
    )


def list_calls_query(
    stage: str | None, budget: str | None, limit: int, mark: str
) -> tuple[str, list[Any]]:
    """The SQL (with ``mark`` as placeholder: ``?`` or ``%s``) listing calls, newest first.

    ``budget`` selects the path and its subtree; ``LIKE`` wildcards in it are escaped.
    """
    where: list[str] = []
    params: list[Any] = []
    if stage is not None:
        where.append(f"stage = {mark}")
        params.append(stage)
    if budget is not None:
        where.append(f"(budget = {mark} OR budget LIKE {mark} ESCAPE '\\')")
        escaped = budget.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        params += [budget, escaped + "/%"]
    clause = f"WHERE {' AND '.join(where)}" if where else ""
    sql = f"SELECT state FROM calls {clause} ORDER BY created_at DESC LIMIT {mark}"
    return sql, [*params, min(limit, (1 << 63) - 1)]
