"""The invariants checked after every run: pure functions of the :class:`Evidence`.

Each check returns the violations it found, each naming its invariant, so a
test can feed a fabricated evidence set and assert which one fires. The ledger
is never trusted to judge itself where outside evidence exists: receipts prove
effects, client answers prove what was promised.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable
from typing import Final

from effectguard.rules import budget as budget_rules
from effectguard.rules.bodytext import decode_body
from effectguard.rules.budget import ancestors
from effectguard.rules.events import (
    BudgetSettled,
    BudgetUnheld,
    StoredEvent,
    event_from_data,
)
from effectguard.rules.workstate import UNRESOLVED, work_state
from effectguard.testing.sim.clockmap import real_times
from effectguard.testing.sim.evidence import Evidence
from effectguard.testing.sim.evidenceindex import applied_ops, authorizations, sha_by_call
from effectguard.testing.sim.maintchecks import MAINTENANCE_CHECKS, MAINTENANCE_INVARIANTS
from effectguard.testing.sim.operatorchecks import (
    KEY_INVARIANTS,
    new_keys_accepted,
    rate_limits_held,
    revoked_keys_refused,
)
from effectguard.testing.sim.violation import Violation

__all__ = ["CHECKS", "INVARIANTS", "Violation", "check", "overshoots"]

#: Invariant name -> what it says (docs/simulator.md lists the same).
INVARIANTS: Final = {
    "receipt_without_attempt": "every provider receipt has an earlier attempt.started",
    "effects_exceed_attempts": "no operation has more provider effects than authorized attempts",
    "call_in_flight": "no call is left in_flight",
    "unobserved_not_held": "a dispatched, unobserved attempt is effect_unknown and holds its "
    "reservation",
    "budget_over_limit": "no event that raises a budget's spent+reserved+held takes it past "
    "its limit (plus settlement overshoot)",
    "ok_not_completed": "every 200 a client received is a completed call with those bytes",
    "stream_ok_without_end": "a stream that ended cleanly for the client holds its terminal event",
    "replay_differs": "a replay returns the bytes of the first 200",
    "unavailable_with_receipt": "a 503 ledger_unavailable has no receipt, not even a "
    "declared not-processed one",
    "verify_failed": "effectguard verify passes",
    "replica_unrecovered": "every replica still running after the faults serves again by "
    "itself (/healthz 200) without a restart",
    "operation_applied_twice": "an at-most-once operation (a receipt carrying an operation "
    "id) is applied by the provider at most once",
    "decision_contradicts_receipts": "a call decided applied was applied before the "
    "decision, and a call decided not applied was not",
    "retry_applied_again": "a key-less SDK retry is not applied as new work while the call "
    "it repeats is unresolved or decided applied",
    "operator_command_failed": "an operator's command run during the load (--operator) exits "
    "0, or 4 when the ledger is unavailable; never a crash",
    **KEY_INVARIANTS,
    **MAINTENANCE_INVARIANTS,
}
_TERMINAL: Final = (b"data: [DONE]", b"event: message_stop")


def receipts_have_attempts(evidence: Evidence) -> list[Violation]:
    """The n-th receipt of a body needs n attempt.started of calls with that body before it
    (in real time: a ledger clock's steps taken back out, :mod:`.clockmap`)."""
    sha_of = sha_by_call(evidence)
    real = real_times(evidence.events, evidence.clock_steps)
    starts: dict[str, list[float]] = defaultdict(list)
    for e in evidence.events:
        if e.kind == "attempt.started" and e.call_id in sha_of:
            starts[sha_of[e.call_id]].append(real[e.seq][0])  # the earliest a step allows
    seen: dict[str, int] = defaultdict(int)
    out = []
    for receipt in sorted(evidence.receipts, key=lambda r: r["ts"]):
        sha = receipt["body_sha256"]
        seen[sha] += 1
        earlier = sum(1 for at in starts.get(sha, ()) if at <= receipt["ts"])
        if earlier < seen[sha]:
            out.append(
                Violation(
                    "receipt_without_attempt",
                    f"receipt seq {receipt['seq']} (tag {receipt.get('tag')}) is the "
                    f"{seen[sha]}th of body {sha[:12]} but only {earlier} attempt.started "
                    "precede it",
                )
            )
    return out


def effects_within_attempts(evidence: Evidence) -> list[Violation]:
    """Effects (after the provider's dedup) <= attempts not booked as not sent, per body."""
    sha_of = sha_by_call(evidence)
    authorized: dict[str, int] = defaultdict(int)
    calls: dict[str, set[str]] = defaultdict(set)
    for e in evidence.events:
        if e.call_id not in sha_of:
            continue
        sha = sha_of[e.call_id]
        calls[sha].add(e.call_id)
        if e.kind == "attempt.started":
            authorized[sha] += 1
        elif e.kind == "attempt.not_sent":
            authorized[sha] -= 1
    effects: dict[str, int] = defaultdict(int)
    for receipt in evidence.receipts:
        if not receipt.get("deduped"):
            effects[receipt["body_sha256"]] += 1
    return [
        Violation(
            "effects_exceed_attempts",
            f"body {sha[:12]} (calls {sorted(calls.get(sha, ()))}) reached the provider "
            f"{count} times; the ledger authorized {authorized.get(sha, 0)} attempts that "
            "could have been sent",
        )
        for sha, count in sorted(effects.items())
        if count > authorized.get(sha, 0)
    ]


def nothing_in_flight(evidence: Evidence) -> list[Violation]:
    """No call is left in flight once everything has restarted and gone quiet."""
    return [
        Violation("call_in_flight", f"call {c.call_id} is in_flight (attempt {c.attempts})")
        for c in evidence.calls
        if c.stage == "in_flight"
    ]


def unobserved_attempts_held(evidence: Evidence) -> list[Violation]:
    """A call whose last attempt started and was never observed is effect_unknown and
    holds its reservation, on top of any hold still standing when that attempt was
    reserved (a resend an operator authorized leaves the first attempt's hold: §8)."""
    last: dict[str, str] = {}
    due: dict[str, int] = {}
    standing: dict[str, int] = defaultdict(int)
    for e in evidence.events:
        if e.call_id is None:
            continue
        if e.kind in ("attempt.started", "attempt.observed", "attempt.not_sent"):
            last[e.call_id] = e.kind
        if e.kind == "budget.reserved":
            due[e.call_id] = standing[e.call_id] + int(e.data["amount"])
        elif e.kind == "budget.held":
            standing[e.call_id] += int(e.data["amount"])
        elif e.kind == "budget.unheld":
            standing[e.call_id] -= int(e.data["amount"])
    out = []
    for c in evidence.calls:
        if last.get(c.call_id) != "attempt.started" or c.stage == "in_flight":
            continue  # observed or not sent; in flight has its own invariant
        if c.stage.startswith("reconciled_"):
            continue
        if c.stage != "effect_unknown" or c.held != due.get(c.call_id, 0) or c.held <= 0:
            out.append(
                Violation(
                    "unobserved_not_held",
                    f"call {c.call_id} was dispatched and never observed but is {c.stage} "
                    f"holding {c.held} of its reservation and earlier holds "
                    f"{due.get(c.call_id, 0)}",
                )
            )
    return out


def overshoots(evidence: Evidence) -> list[str]:
    """Settlements above their reservation: allowed by the contract, and flagged."""
    flags = []
    for e in evidence.events:
        if e.kind == "budget.settled" and int(e.data["actual"]) > int(e.data["reserved"]):
            flags.append(f"call {e.call_id} settled {e.data['actual']} > {e.data['reserved']}")
    return flags


def budgets_within_limits(evidence: Evidence) -> list[Violation]:
    """Fold the log event by event; no limited node may go over its limit.

    The only allowance is an overshoot at settlement (or a reconcile charging
    more than was held), which the contract permits: it is added to the node's
    allowance, so later prefixes are not blamed for it.
    """
    tree = budget_rules.Tree()
    allowance: dict[str, int] = defaultdict(int)
    out = []
    for e in evidence.events:
        if not (e.kind.startswith("budget.")):
            continue
        event = event_from_data(e.kind, e.data)
        extra, path_of = 0, ""
        if isinstance(event, BudgetSettled):
            extra, path_of = event.overshoot, event.budget
        elif isinstance(event, BudgetUnheld):
            extra, path_of = max(0, event.spent - event.amount), event.budget
        if extra:
            for path in ancestors(path_of):
                allowance[path] += extra
        before = {key: node.committed for key, node in tree.nodes.items()}
        for node in tree.apply(event):
            # Only an event that raises a node's commitment, other than an allowed
            # overshoot, can break its limit: a limit set below what a node already holds
            # (``budget set`` during the load) must refuse the next admission, and the
            # releases and settlements that follow are no breach.
            raised = node.committed > before.get((node.path, node.period), 0)
            if not raised or extra or node.limit is None:
                continue
            if node.committed > node.limit + allowance[node.path]:
                out.append(
                    Violation(
                        "budget_over_limit",
                        f"after event {e.seq} ({e.kind} of {e.call_id}) budget {node.path} "
                        f"commits {node.committed} > limit {node.limit}",
                    )
                )
    return out


def answers_match_ledger(evidence: Evidence) -> list[Violation]:
    """Every clean 200 is a completed call whose stored response is the bytes received."""
    calls = {c.call_id: c for c in evidence.calls}
    stored: dict[str, bytes] = {}
    for e in evidence.events:
        if e.kind == "attempt.observed" and e.call_id is not None:
            stored[e.call_id] = decode_body(e.data["body"], e.data.get("body_encoding", "utf8"))
    recovered: dict[str, bytes] = {}
    for e in evidence.events:
        if e.kind == "call.reconciled" and e.call_id is not None and e.data.get("result"):
            encoding = e.data.get("result_encoding", "utf8")
            recovered[e.call_id] = decode_body(e.data["result"], encoding)
    out = []
    for a in evidence.answers:
        if not a.clean_ok:
            continue
        state = calls.get(a.call_id or "")
        if a.recovered and state is not None and state.stage == "reconciled_applied":
            if recovered.get(state.call_id) != a.body:  # the result the decision kept
                out.append(Violation("ok_not_completed", f"request {a.tag} got another result"))
            continue
        if state is None or state.stage != "completed":
            stage = state.stage if state else "missing"
            out.append(
                Violation(
                    "ok_not_completed",
                    f"request {a.tag} got 200 for call {a.call_id}, which is {stage}",
                )
            )
        elif stored.get(state.call_id) != a.body:
            out.append(
                Violation("ok_not_completed", f"request {a.tag} got bytes the ledger did not store")
            )
        if a.stream and not any(end in a.body for end in _TERMINAL):
            out.append(
                Violation(
                    "stream_ok_without_end",
                    f"request {a.tag} (call {a.call_id}) ended cleanly without a terminal event",
                )
            )
    return out


def replays_match(evidence: Evidence) -> list[Violation]:
    """The keyed resend of a 200 is a replay of exactly the bytes of the call's first 200,
    or 409 ``archived`` once the call was archived (``--maintenance``: never replayed from
    the archive, contract §4)."""
    first: dict[str, bytes] = {}
    out = []
    for a in evidence.answers:
        archived = a.status == 409 and a.error_type == "archived"
        if archived and a.call_id in evidence.archived_calls:
            continue
        if a.kind == "replay" and not (a.clean_ok and a.replayed):
            shown = a.transport_error or f"{a.status} {a.error_type or ''}".strip()
            out.append(Violation("replay_differs", f"request {a.tag} was not replayed: {shown}"))
            continue
        if not a.clean_ok or a.call_id is None:
            continue
        if a.call_id not in first:
            first[a.call_id] = a.body
        elif a.replayed and a.body != first[a.call_id]:
            out.append(Violation("replay_differs", f"request {a.tag} replayed other bytes"))
    return out


def unavailable_sent_nothing(evidence: Evidence) -> list[Violation]:
    """A request answered 503 ``ledger_unavailable`` never reached the provider.

    docs/contract.md §9: that answer says nothing was sent, so any receipt for the request breaks
    it — even one the provider answered with a status it declares "not processed"
    (a 429 before the lease lapsed: the client must get that 429 instead).
    """
    tags = {r.get("tag") for r in evidence.receipts}
    return [
        Violation("unavailable_with_receipt", f"request {a.tag} got 503 but reached the provider")
        for a in evidence.answers
        if a.status == 503 and a.error_type == "ledger_unavailable" and a.tag in tags
    ]


def verify_passes(evidence: Evidence) -> list[Violation]:
    """``effectguard verify`` exited 0."""
    if evidence.verify_code == 0:
        return []
    return [Violation("verify_failed", evidence.verify_output.strip()[-2000:])]


def replicas_recover(evidence: Evidence) -> list[Violation]:
    """Every replica still running after the schedule answered ``/healthz`` 200 by itself.

    A replica paused past its lease is fenced, as it must be; it must then register
    anew and serve, not refuse every request with 503 until someone restarts it.
    """
    return [
        Violation(
            "replica_unrecovered",
            f"replica {index} still refused /healthz a few leases after the last fault",
        )
        for index in evidence.unrecovered
    ]


def operator_commands_exit_cleanly(evidence: Evidence) -> list[Violation]:
    """Each operator command (``budget set``, ``reconcile --auto``) that failed, failed as
    documented: exit 4, the ledger unavailable (full, read-only, stopped)."""
    return [Violation("operator_command_failed", failure) for failure in evidence.operator_failures]


def operations_applied_once(evidence: Evidence) -> list[Violation]:
    """No operation id reaches the provider's books twice, but for a resend an operator
    authorized (``--maintenance``): each authorization allows one more."""
    authorized = authorizations(evidence)
    return [
        Violation(
            "operation_applied_twice",
            f"operation {op} was applied {len(receipts)} times "
            f"(receipts {[r['seq'] for r in receipts]}, tags {[r.get('tag') for r in receipts]})",
        )
        for op, receipts in sorted(applied_ops(evidence).items())
        if len(receipts) > 1 + len(authorized.get(op, ()))
    ]


def decisions_match_receipts(evidence: Evidence) -> list[Violation]:
    """A decision on a call that carried an operation id agrees with the provider's books
    as they stood when it was made: "applied" needs an applied receipt before it, "not
    applied" none (the id is the call id)."""
    applied = applied_ops(evidence)
    ops = {r.get("op") for r in evidence.receipts}
    real = real_times(evidence.events, evidence.clock_steps)
    out = []
    for e in evidence.events:
        if e.kind != "call.reconciled" or e.call_id is None or e.call_id not in ops:
            continue
        # After a step of the ledger's clock, the side of its real time that spares it.
        at = real[e.seq][1] if e.data.get("applied") else real[e.seq][0]
        before = [r for r in applied.get(e.call_id, ()) if r["ts"] <= at]
        if bool(e.data.get("applied")) != bool(before):
            said = "applied" if e.data.get("applied") else "not applied"
            out.append(
                Violation(
                    "decision_contradicts_receipts",
                    f"call {e.call_id} was decided {said} by {e.data.get('by')} at {at:.3f}; "
                    f"the provider had applied it {len(before)} times by then",
                )
            )
    return out


def retries_not_applied_again(evidence: Evidence) -> list[Violation]:
    """Two calls of one client's logical request (the tag's first part) that the provider
    both applied: the later one was admitted as new work, which is right only once the
    earlier one had ended (completed, failed, or decided not applied). While it was in
    flight or unknown, or after it was decided applied, its retry repeats it (contract §4).
    Keyed calls keep one call id, so this sees the key-less ones."""
    applied = applied_ops(evidence)
    by_request: dict[str, set[str]] = defaultdict(set)
    for op, receipts in applied.items():
        for r in receipts:
            by_request[str(r.get("tag", "")).split(".")[0]].add(op)
    events: dict[str, list[StoredEvent]] = defaultdict(list)
    for e in evidence.events:
        if e.call_id is not None:
            events[e.call_id].append(e)
    out = []
    for request, ops in sorted(by_request.items()):
        # The ledger's order, not its clock's times, which a step can turn round.
        admitted = sorted((events[op][0].seq, op) for op in ops if events.get(op))
        for (_, earlier), (seq, later) in itertools.combinations(admitted, 2):
            stage = work_state(e.event for e in events[earlier] if e.seq <= seq).stage
            if stage in UNRESOLVED or stage == "reconciled_applied":
                out.append(
                    Violation(
                        "retry_applied_again",
                        f"request {request}: call {later} was admitted and applied at "
                        f"event {seq} while call {earlier}, also applied, was {stage}",
                    )
                )
    return out


CHECKS: Final[tuple[Callable[[Evidence], list[Violation]], ...]] = (
    receipts_have_attempts,
    effects_within_attempts,
    nothing_in_flight,
    unobserved_attempts_held,
    budgets_within_limits,
    answers_match_ledger,
    replays_match,
    unavailable_sent_nothing,
    verify_passes,
    replicas_recover,
    operations_applied_once,
    decisions_match_receipts,
    retries_not_applied_again,
    operator_commands_exit_cleanly,
    revoked_keys_refused,
    new_keys_accepted,
    rate_limits_held,
    *MAINTENANCE_CHECKS,
)


def check(evidence: Evidence) -> list[Violation]:
    """Every invariant's violations, in the order of :data:`CHECKS`."""
    return [v for one in CHECKS for v in one(evidence)]
