"""Row encodings shared by the SQL stores: column lists, and rows to and from values.

Each ``*_COLUMNS`` string fixes a table's column order; the ``*_params``
functions produce parameters in that order and the ``*_from_row`` functions
read a row in that order, on SQLite and PostgreSQL alike.
"""

from __future__ import annotations

import json
from typing import Any

from effectguard.ledger.base import CallSpend, WorkerRow
from effectguard.rules.budget import BudgetNode, BudgetPolicy
from effectguard.rules.events import StoredEvent
from effectguard.rules.keys import LedgerKey
from effectguard.rules.periods import validate_kind
from effectguard.rules.ratelimit import RateWindow
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
#: What the spend chart reads of a call (ledger/base.CallSpend) besides its provider and
#: creation time, in this order: its model, its cost (settled, or decided by a
#: reconciliation) and what it holds. SQLite keeps them as columns of the calls row
#: (ledger/sqlitecalls); PostgreSQL reads them from the stored state.
SPEND_COLUMNS = "model, cost, held"
#: The call columns a later write may change. A call's budget, hash, provider and
#: creation time come from its manifest and never change: leaving them out of an
#: upsert leaves those columns' index pages unwritten.
MUTABLE_CALL_COLUMNS = ("stage", "idempotency_key", "worker", "state")
#: A node's counters in one period (table ``budget_periods``, keyed by path and period).
NODE_COLUMNS = "path, period, reserved, spent, held"
#: A node's declared policy (table ``budgets``, keyed by path).
POLICY_COLUMNS = "path, limit_nanos, period, tz, rpm, tpm, concurrency"
#: A node's rate window (table ``rate_windows``, keyed by path). ``since`` is NULL in a
#: row an older release wrote (SQLite migration 18, PostgreSQL migration 11 added it);
#: ``reached`` in a row a release before writer format 6 wrote (SQLite migration 23,
#: PostgreSQL migration 16), and in every window of its lineage after (not tracked).
WINDOW_COLUMNS = "path, minute, requests, tokens, since, reached"
WORKER_COLUMNS = "worker, generation, host, pid, lease_expires, fenced"
KEY_COLUMNS = "name, sha256, budget_root, created_at, expires_at, models, providers, revoked_at"


def names(columns: str) -> list[str]:
    """The column names of a ``*_COLUMNS`` string."""
    return [name.strip() for name in columns.split(",")]


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


#: A call state's fields, in the order a positional ``state`` lists their values (SQLite).
#: Part of the stored format: a field added to WorkState later is not appended here
#: (states with it are stored as objects), so a stored array never changes meaning.
STATE_FIELDS = (
    "call_id",
    "stage",
    "attempts",
    "idempotency_key",
    "request_hash",
    "provider",
    "model",
    "budget",
    "budget_root",
    "created_at",
    "last_attempt_at",
    "reserved_at_admission",
    "reserved",
    "cost",
    "held",
    "status",
    "worker",
    "flagged",
    "idempotency_window_s",
    "periods",
    "tokens",
    "resend_authorized",
)


#: The state fields the calls row holds in columns of their own, in the order SQLite
#: reads them (ledger/sqlitecalls.CALL_READ). A positional state (SQLite) leaves them
#: out: about 160 B a call less.
COLUMN_FIELDS = (
    "call_id",
    "stage",
    "request_hash",
    "provider",
    "budget",
    "budget_root",
    "created_at",
    "worker",
)
#: The fields a positional state lists, in :data:`STATE_FIELDS` order. Part of the
#: stored format, like STATE_FIELDS (an array of all 22 fields, as stored before, reads).
SLIM_FIELDS = tuple(f for f in STATE_FIELDS if f not in COLUMN_FIELDS)


def state_params(state: WorkState) -> tuple[Any, ...]:
    """Parameters for storing a call state, in :data:`CALL_COLUMNS` order (its state an
    object; SQLite lays its rows out in ledger/sqlitecalls).

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
    """A call state from its stored JSON: an object, or the array of its STATE_FIELDS."""
    stored = json.loads(text)
    if type(stored) is list:
        return WorkState(**dict(zip(STATE_FIELDS, stored, strict=True)))
    return WorkState(**stored)


def state_from_first(row: tuple[Any, ...] | Any) -> WorkState:
    """A call state from a row whose first column is its stored JSON (``state``)."""
    return state_from_json(row[0])


def spend_from_row(row: tuple[Any, ...] | Any) -> CallSpend:
    """A call's spend from a row of ``created_at, provider`` and :data:`SPEND_COLUMNS`."""
    created_at, provider, model, cost, held = row
    return CallSpend(float(created_at), provider, model, _int(cost), int(held))


def limit_param(limit: int) -> int:
    """A ``LIMIT`` parameter: ``limit``, at most the largest 64-bit integer."""
    return min(limit, (1 << 63) - 1)


def node_params(node: BudgetNode) -> tuple[Any, ...]:
    """Parameters for storing a node's counters, in :data:`NODE_COLUMNS` order."""
    return (node.path, node.period, node.reserved, node.spent, node.held)


def node_from_row(row: tuple[Any, ...] | Any) -> BudgetNode:
    """A node's counters (``limit`` None) from a row in :data:`NODE_COLUMNS` order."""
    path, period, reserved, spent, held = row
    return BudgetNode(path, None, int(reserved), int(spent), int(held), period=period)


def policy_params(policy: BudgetPolicy) -> tuple[Any, ...]:
    """Parameters for storing a policy, in :data:`POLICY_COLUMNS` order."""
    p = policy
    return (p.path, p.limit, p.period, p.tz, p.rpm, p.tpm, p.concurrency)


def policy_from_row(row: tuple[Any, ...] | Any) -> BudgetPolicy:
    """A policy from a row in :data:`POLICY_COLUMNS` order."""
    path, limit, period, tz, rpm, tpm, concurrency = row
    return BudgetPolicy(
        path, _int(limit), validate_kind(period), tz, _int(rpm), _int(tpm), _int(concurrency)
    )


def window_params(window: RateWindow) -> tuple[Any, ...]:
    """Parameters for storing a rate window, in :data:`WINDOW_COLUMNS` order."""
    w = window
    return (w.path, w.minute, w.requests, w.tokens, w.since, w.reached)


def window_from_row(row: tuple[Any, ...] | Any) -> RateWindow:
    """A rate window from a row in :data:`WINDOW_COLUMNS` order."""
    path, minute, requests, tokens, since, reached = row
    return RateWindow(path, int(minute), int(requests), int(tokens), _int(since), _int(reached))


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def worker_params(row: WorkerRow) -> tuple[Any, ...]:
    """Parameters for storing a worker row, in :data:`WORKER_COLUMNS` order."""
    return (row.worker, row.generation, row.host, row.pid, row.lease_expires, row.fenced)


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


def _names_json(values: tuple[str, ...] | None) -> str | None:
    return None if values is None else _COMPACT.encode(list(values))


def _names_from_json(text: str | None) -> tuple[str, ...] | None:
    return None if text is None else tuple(json.loads(text))


def key_params(row: LedgerKey) -> tuple[Any, ...]:
    """Parameters for storing a proxy key row, in :data:`KEY_COLUMNS` order."""
    return (
        row.name,
        row.sha256,
        row.budget_root,
        row.created_at,
        row.expires_at,
        _names_json(row.models),
        _names_json(row.providers),
        row.revoked_at,
    )


def key_from_row(row: tuple[Any, ...] | Any) -> LedgerKey:
    """A proxy key row from a row in :data:`KEY_COLUMNS` order."""
    name, sha256, root, created_at, expires_at, models, providers, revoked_at = row
    return LedgerKey(
        name=name,
        sha256=sha256,
        budget_root=root,
        created_at=float(created_at),
        expires_at=None if expires_at is None else float(expires_at),
        models=_names_from_json(models),
        providers=_names_from_json(providers),
        revoked_at=None if revoked_at is None else float(revoked_at),
    )
