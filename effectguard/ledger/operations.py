"""Write operations shared by every store: the ledger's rules over a :class:`Tx`.

Each public function here is run by a store as one operation inside a durable
transaction. Appending an event always does three things together: seal it into
the hash chain, fold it into its call's projected state, and fold it into the
budget counters — so the stored state is, by construction, a fold of events.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from effectguard.errors import FencedError, Refusal
from effectguard.ledger import bodystore, budgetfold, rates, room
from effectguard.ledger.base import Tx, WorkerRow, Writer
from effectguard.ledger.retries import contradiction, retried_call
from effectguard.rules import budget as budgets
from effectguard.rules import evidence, keys, workstate
from effectguard.rules.admission import (
    AdmitRequest,
    Decision,
    Sending,
    decide_keyed,
    decide_retry,
)
from effectguard.rules.bodyref import refused_manifest
from effectguard.rules.budget import BudgetPolicy
from effectguard.rules.events import (
    AttemptInterrupted,
    AttemptObserved,
    AttemptStarted,
    BudgetHeld,
    BudgetLimitSet,
    BudgetReserved,
    BudgetUnheld,
    CallManifest,
    CallReconciled,
    CallRefused,
    Event,
    WorkerRegistered,
    WorkerTakenOver,
    seal,
)
from effectguard.rules.liveness import LEASE_EXPIRED, PROCESS_GONE
from effectguard.rules.quickinit import quick_init
from effectguard.rules.retention import decide_archived
from effectguard.rules.workstate import WorkState


def new_call_id() -> str:
    """A fresh call id: ``call_`` and 32 hex digits, the first 12 of them the time in ms.

    Ids made one after another sort together, so the ledger's indexes on call ids
    grow at their right edge instead of touching a random page per call (fewer
    pages written per commit). The other 80 bits are random.
    """
    return f"call_{time.time_ns() // 1_000_000:012x}{secrets.token_hex(10)}"


def append(
    tx: Tx,
    writer: Writer,
    events: Sequence[Event],
    known: dict[str, WorkState] | None = None,
) -> dict[str, WorkState]:
    """Seal ``events`` into the chain and fold them into calls and budgets.

    ``known`` holds call states the caller already read in this transaction (a new
    call's is ``WorkState()``), saving a read. Returns the calls' new states.
    """
    seq, prev = tx.head()
    now = tx.now()
    calls: dict[str, WorkState] = dict(known or {})
    touched: set[str] = set()
    tree = budgets.Tree()
    changed: set[budgets.Key] = set()
    for event in events:
        call_id = event.call_id
        state = None
        if call_id is not None:
            state = calls.get(call_id) or tx.get_call(call_id) or WorkState()
            event = budgetfold.in_admission_periods(event, state)
        seq += 1
        stored, data_json = seal(
            event,
            seq=seq,
            worker=writer.worker,
            generation=writer.generation,
            at=now,
            prev_digest=prev,
        )
        tx.insert_event(stored, data_json)
        prev = stored.digest
        if isinstance(event, BudgetLimitSet):
            rates.fold_declared(tx, event, seq, now)
        if call_id is not None and state is not None:
            rates.fold_rates(tx, event, seq, state, now)
            calls[call_id] = workstate.apply(state, event)
            touched.add(call_id)
        name = keys.key_name(event)
        if name is not None:
            row = keys.apply(tx.get_key(name), event, now)
            if row is not None:
                tx.put_key(row)
        budgetfold.fold_budget(tx, tree, event, changed)
    for call_id in touched:
        tx.put_call(calls[call_id])
    for key in changed:
        tx.put_node(tree.nodes[key])
    return {c: calls[c] for c in touched}


@quick_init
@dataclass(frozen=True, slots=True)
class Admitted:
    """What admission decided: dispatch ``attempt``, replay, recover, join or refuse.

    ``writer`` is the writer that decided (and started ``attempt``). The attempt's
    outcome is written as that writer, so once it is fenced the store refuses
    everything about the attempt, even after this process has registered anew.
    """

    action: str
    call_id: str
    writer: Writer
    attempt: int = 0
    state: WorkState | None = None
    provider_idempotency_key: str | None = None
    observed: AttemptObserved | None = None
    refusal: Refusal | None = None
    #: For ``recover``: the applied decision whose kept result is replayed.
    recovered: CallReconciled | None = None
    #: When (this process's wall clock) the writer's lease lapses, as admission saw it:
    #: an attempt not yet sent by then is never sent (docs/contract.md §7).
    send_by: float | None = None


def check_lease(tx: Tx, writer: Writer) -> float | None:
    """A worker whose lease has lapsed starts no new dispatch (docs/contract.md §7).

    Returns the moment, on this process's wall clock, the lease lapses unless renewed
    (None for a writer with no lease): an attempt started now is not sent past it.
    """
    row = tx.get_worker(writer.worker)
    if row is None:
        return None
    now = tx.now()
    if row.lease_expires < now:
        raise FencedError(f"worker {writer.worker} lease lapsed; it starts no new dispatch")
    # The wall clock, not a monotonic one: a suspended machine's sleep must count.
    return time.time() + (row.lease_expires - now)


def attempt_started(
    call_id: str, attempt: int, writer: Writer, provider_key: str | None, at: float, how: Sending
) -> AttemptStarted:
    """The event that starts attempt ``attempt`` of a call, recording how it goes out."""
    return AttemptStarted(
        call=call_id,
        attempt=attempt,
        worker=writer.worker,
        generation=writer.generation,
        provider_idempotency_key=provider_key,
        at=at,
        op_id_in=how.op_id_in,
        sent_to=how.sent_to,
        key_digest=how.key_digest,
    )


def admit(tx: Tx, writer: Writer, req: AdmitRequest) -> Admitted:
    """docs/contract.md §3.2 in one transaction: idempotency check, budget reservation, manifest."""
    bodystore.check_spool(req.body, req.body_encoding, req.spool)
    now = tx.now()
    decision = _decide(tx, req, now)
    if decision.action in ("refuse", "replay", "join"):
        return _answer_from_ledger(tx, writer, decision)
    send_by = check_lease(tx, writer)
    existing = decision.existing
    call_id = existing.call_id if existing is not None else new_call_id()
    events: list[Event] = [] if existing is not None else [_manifest(req, call_id, now)]
    # A later attempt of an existing call is charged where the call was admitted.
    budget = existing.budget if existing is not None else req.budget
    released = 0
    if decision.action == "provider_resend" and existing is not None:
        # The provider dedups the resend: the earlier attempt's effect, if any, is the
        # same effect. Its hold is released as this attempt's reservation replaces it.
        released = existing.held
    policies = tx.get_policies(budgets.ancestors(budget))
    # A new call is charged to the periods it is admitted in; a later attempt to its own.
    periods = room.admission_periods(tx, policies, budget, now, existing)
    refusal = rates.rate_refusal(tx, policies, budget, call_id, req.tokens, now)
    refusal = refusal or room.budget_refusal(
        tx, req, policies, budget, periods, call_id, req.reserve - released, now
    )
    if refusal is not None:
        return _refused(tx, writer, events, call_id, refusal)
    attempt = (existing.attempts if existing is not None else 0) + 1
    provider_key = _provider_key(tx, req, existing, call_id)
    if released:
        events.append(
            BudgetUnheld(call=call_id, budget=budget, amount=released, spent=0, periods=periods)
        )
    events.append(
        BudgetReserved(
            call=call_id, budget=budget, amount=req.reserve, periods=periods, tokens=req.tokens
        )
    )
    events.append(attempt_started(call_id, attempt, writer, provider_key, now, req.sending))
    states = append(tx, writer, events, {call_id: existing or WorkState()})
    _store_body(tx, req, call_id, existing)
    return Admitted(
        decision.action if existing else "admit",
        call_id,
        writer,
        attempt,
        state=states[call_id],
        provider_idempotency_key=provider_key,
        send_by=send_by,
    )


def _store_body(tx: Tx, req: AdmitRequest, call_id: str, existing: WorkState | None) -> None:
    """A new call's by-reference body goes in with its manifest, in this transaction. A
    refused call's is not stored (it is never sent); a later attempt's is its call's."""
    if existing is None and req.spool is not None:
        tx.put_body(call_id, req.spool)


def _provider_key(
    tx: Tx, req: AdmitRequest, existing: WorkState | None, call_id: str
) -> str | None:
    """The idempotency key the provider sees for this attempt (docs/contract.md §4).

    A new call's is its call id, never the client's ``Idempotency-Key``: clients of
    different budget roots sharing one provider account may use the same key string, and
    the provider would fold one's call into the other's effect. A later attempt keeps the
    key its call's earlier attempt sent, read from the ledger (never recomputed), so the
    provider dedups the resend, whatever rule chose that key when it was first sent.
    """
    if not req.provider_idempotency_window_s:
        return None
    if existing is not None:
        for stored in reversed(tx.events_of(existing.call_id)):
            event = stored.event
            if isinstance(event, AttemptStarted) and event.provider_idempotency_key is not None:
                return event.provider_idempotency_key
    return call_id


def _decide(tx: Tx, req: AdmitRequest, now: float) -> Decision:
    """docs/contract.md §4: what a request is, given the call its key or its retry marks name."""
    if req.idempotency_key is not None:
        existing = tx.find_keyed(req.budget_root, req.idempotency_key)
        if existing is None:
            archived = tx.find_archived(req.budget_root, req.idempotency_key)
            if archived is not None:
                return decide_archived(*archived, req.request_hash)
        late = None if existing is None else contradiction(tx, existing)
        return decide_keyed(existing, req.request_hash, now, late)
    if req.is_retry:
        return decide_retry(*retried_call(tx, req, now))
    return Decision("admit")


def _answer_from_ledger(tx: Tx, writer: Writer, decision: Decision) -> Admitted:
    """A request answered without dispatch: refused, replayed or joined to its call."""
    existing = decision.existing
    assert existing is not None
    if decision.action == "refuse":
        assert decision.refusal is not None
        if decision.refusal.type == "reconciled_applied":
            # Evidence that recovered the effect's result kept it: replay that instead.
            found = evidence.recovered(tx.events_of(existing.call_id))
            if found is not None:
                return Admitted(
                    "recover", existing.call_id, writer, state=existing, recovered=found
                )
        return Admitted("refuse", existing.call_id, writer, refusal=decision.refusal)
    if decision.action == "replay":
        observed = _last_observed(tx, existing.call_id)
        return Admitted("replay", existing.call_id, writer, state=existing, observed=observed)
    return Admitted("join", existing.call_id, writer, state=existing)


def _manifest(req: AdmitRequest, call_id: str, now: float) -> CallManifest:
    """The ``call.manifest`` of a new call: what was intended, as the request said it."""
    return CallManifest(
        call=call_id,
        request_hash=req.request_hash,
        provider=req.provider,
        endpoint=req.endpoint,
        method=req.method,
        model=req.model,
        idempotency_key=req.idempotency_key,
        budget=req.budget,
        budget_root=req.budget_root,
        effect_kind=req.effect_kind,
        body=req.body,
        body_encoding=req.body_encoding,
        headers=dict(req.headers),
        stream=req.stream,
        retry_of=req.retry_of,
        provider_idempotency_window_s=req.provider_idempotency_window_s,
        at=now,
    )


def _refused(
    tx: Tx, writer: Writer, events: list[Event], call_id: str, refusal: Refusal
) -> Admitted:
    if events:  # a new call: record the refused manifest so the refusal is auditable
        assert isinstance(events[0], CallManifest)
        events[0] = refused_manifest(events[0])
        events.append(
            CallRefused(
                call=call_id, reason=refusal.type, status=refusal.status, message=refusal.message
            )
        )
        append(tx, writer, events, {call_id: WorkState()})
    return Admitted("refuse", call_id, writer, refusal=refusal)


def _last_observed(tx: Tx, call_id: str) -> AttemptObserved | None:
    for stored in reversed(tx.events_of(call_id)):
        if stored.kind == AttemptObserved.kind:
            event = stored.event
            assert isinstance(event, AttemptObserved)
            return event
    return None


def last_observed(tx: Tx, call_id: str) -> AttemptObserved | None:
    """The call's last observed response (for replay), as an operation."""
    return _last_observed(tx, call_id)


def interrupt(tx: Tx, writer: Writer, state: WorkState, reason: str) -> WorkState:
    """Mark the in-flight attempt of ``state`` interrupted: effect unknown, reservation held."""
    events: list[Event] = [
        AttemptInterrupted(
            call=state.call_id, attempt=state.attempts, reason=reason, by=writer.worker
        )
    ]
    if state.reserved:
        events.append(BudgetHeld(call=state.call_id, budget=state.budget, amount=state.reserved))
    return append(tx, writer, events, {state.call_id: state})[state.call_id]


def set_limit(tx: Tx, writer: Writer, path: str, limit: int | None) -> None:
    """Set (or clear) a budget node's limit, keeping the rest of its policy."""
    change_policy(tx, writer, path, {"limit": limit})


def set_limit_if(
    tx: Tx, writer: Writer, path: str, limit: int | None, expected: BudgetPolicy | None
) -> bool:
    """Set a node's limit as :func:`set_limit` does, but only while its policy is still
    ``expected`` (None: it has none); whether it was set.

    For a decision made from an earlier read (``serve`` seeding the config's limits): a
    policy changed since, an operator's ``budget set`` above all, must not be overwritten
    by a choice that did not know of it.
    """
    if tx.get_policies([path]).get(path) != expected:
        return False
    set_limit(tx, writer, path, limit)
    return True


def change_policy(tx: Tx, writer: Writer, path: str, changes: Mapping[str, Any]) -> BudgetPolicy:
    """Change the named fields of a node's policy; the others keep the value this
    transaction reads. Returns the policy declared.

    The read is in the write's transaction on purpose: a policy read before it and
    written back whole would undo whatever another operator changed in between (a
    ``budget set --rpm`` racing a ``budget set --limit`` put the old limit back).
    """
    path = budgets.validate_path(path)
    policy = tx.get_policies([path]).get(path) or BudgetPolicy(path)
    policy = dataclasses.replace(policy, **changes)
    set_policy(tx, writer, policy)
    return policy


def set_policy(tx: Tx, writer: Writer, policy: BudgetPolicy) -> None:
    """Declare a budget node's whole policy: limit, period, timezone and rate limits."""
    budgets.validate_policy(policy)
    event = BudgetLimitSet(
        path=policy.path,
        limit=policy.limit,
        period=policy.period,
        tz=policy.tz,
        rpm=policy.rpm,
        tpm=policy.tpm,
        concurrency=policy.concurrency,
    )
    append(tx, writer, [event])


def register_worker(tx: Tx, *, worker: str, host: str, pid: int, lease_s: float) -> Writer:
    """Register a new worker with a fresh fencing generation and a lease."""
    generation = tx.next_generation()
    writer = Writer(worker, generation)
    tx.put_worker(WorkerRow(worker, generation, host, pid, tx.now() + lease_s))
    append(tx, writer, [WorkerRegistered(worker=worker, generation=generation, host=host, pid=pid)])
    return writer


def heartbeat(tx: Tx, writer: Writer, lease_s: float) -> float:
    """Renew ``writer``'s lease; returns the new expiry (ledger clock)."""
    row = tx.get_worker(writer.worker)
    if row is None or row.fenced or row.generation != writer.generation:
        raise FencedError(f"worker {writer.worker} was fenced")
    expires = tx.now() + lease_s
    tx.put_worker(WorkerRow(row.worker, row.generation, row.host, row.pid, expires))
    return expires


def sweep(
    tx: Tx,
    writer: Writer,
    provably_dead: frozenset[str] = frozenset(),
    *,
    interrupt_calls: bool = True,
    held_still: Mapping[str, float] | None = None,
) -> list[str]:
    """Take over dead workers and interrupt their in-flight attempts (docs/contract.md §7).

    A worker is dead when its lease has expired (ledger clock) or when it is in
    ``provably_dead`` (its OS lock was found free on this host). With ``held_still``
    (worker -> the lease expiry the sweeper saw at its previous sweep), a lapsed lease
    counts only if it is still that one: a worker that heartbeated since is alive and
    the clock jumped. Returns the calls marked ``attempt.interrupted``. Without
    ``interrupt_calls`` the workers are only fenced: each call is then marked in a
    transaction of its own, so one call that cannot commit blocks no other."""
    now = tx.now()
    taken: list[tuple[WorkerRow, str]] = []
    for row in tx.live_workers():
        lapsed = row.lease_expires < now
        if held_still is not None and held_still.get(row.worker) != row.lease_expires:
            lapsed = False
        if row.worker != writer.worker and (lapsed or row.worker in provably_dead):
            taken.append((row, LEASE_EXPIRED if lapsed else PROCESS_GONE))
    # One read for every worker taken over: on SQLite each read walks every unresolved
    # call (no index has the worker), inside the transaction every writer waits on.
    calls: dict[str, list[WorkState]] = {row.worker: [] for row, _ in taken}
    for state in tx.in_flight_of(list(calls)) if interrupt_calls and calls else ():
        calls[state.worker].append(state)
    interrupted: list[str] = []
    for row, reason in taken:
        tx.put_worker(
            WorkerRow(row.worker, row.generation, row.host, row.pid, row.lease_expires, fenced=True)
        )
        append(
            tx,
            writer,
            [
                WorkerTakenOver(
                    worker=row.worker, generation=row.generation, by=writer.worker, reason=reason
                )
            ],
        )
        for state in calls[row.worker]:
            interrupt(tx, writer, state, f"worker {row.worker} {reason}")
            interrupted.append(state.call_id)
    return interrupted


def check_writer(tx: Tx, writer: Writer) -> None:
    """Refuse a fenced writer: the store decides, not the worker (docs/contract.md §7)."""
    if writer.generation == 0:  # operators and single-shot tools are not workers
        return
    row = tx.get_worker(writer.worker)
    if row is not None and (row.fenced or row.generation != writer.generation):
        raise FencedError(f"worker {writer.worker} (generation {writer.generation}) is fenced")
