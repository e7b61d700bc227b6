"""The fault simulator (docs/simulator.md): schedules, invariant checkers, real runs.

Three parts:

* a seed gives one schedule, always the same;
* each invariant's checker catches a fabricated evidence set that breaks it
  (and stays quiet on a clean one), so a passing run means something;
* real runs: the seeds in ``tests/sim_seeds.txt`` (CI replays them all), and a
  deliberately broken build (a dropped connection booked as "not sent") that
  the receipt-count invariant must catch.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import itertools
import os
from pathlib import Path
from typing import Any

import pytest
from eventkit import completion

from effectguard.ops.cli import main
from effectguard.rules.events import (
    AttemptInterrupted,
    AttemptNotSent,
    AttemptStarted,
    BudgetHeld,
    BudgetLimitSet,
    BudgetReleased,
    BudgetReserved,
    BudgetSettled,
    CallManifest,
    CallReconciled,
    CallResendAuthorized,
    Event,
    StoredEvent,
)
from effectguard.rules.workstate import replace, work_state
from effectguard.testing.sim import faketime
from effectguard.testing.sim.clients import Answer
from effectguard.testing.sim.command import run_schedule
from effectguard.testing.sim.evidence import Evidence
from effectguard.testing.sim.invariants import INVARIANTS, check, overshoots
from effectguard.testing.sim.maintevidence import maintenance_failures
from effectguard.testing.sim.operatorchecks import HARD_BOUND_S, late_keys
from effectguard.testing.sim.pgcluster import unavailable_reason
from effectguard.testing.sim.schedule import (
    BUDGETS,
    KEY_ROOTS,
    MAX_ANSWER_BYTES,
    OPERATOR_ACTIONS,
    Call,
    Fault,
    Schedule,
    generate,
)

SEEDS = Path(__file__).parent / "sim_seeds.txt"
PG_DSN = os.environ.get("EFFECTGUARD_TEST_PG_DSN")
#: Invariants that a known, reported bug still breaks on main; a run that breaks only
#: these is an expected failure until the bug is fixed (then the test passes).
#: (Issue #13 finding 5, a stream cut cleanly counted as completed, is fixed: seed 1.)
KNOWN: dict[str, str] = {}


# -- schedules -----------------------------------------------------------------------


def test_same_seed_same_schedule() -> None:
    """A seed and its options fix the schedule byte for byte; another seed changes it."""
    one = generate(7, 10.0, replicas=3, ledger="postgres")
    assert one.to_json() == generate(7, 10.0, replicas=3, ledger="postgres").to_json()
    assert one.to_json() != generate(8, 10.0, replicas=3, ledger="postgres").to_json()
    assert Schedule.from_json(one.to_json()) == one
    assert one.calls and one.faults
    assert all(max(c.replicas) < 3 for c in one.calls)


def test_schedule_draws_every_kind_of_load_and_fault() -> None:
    """Over a few seeds the generator covers keys, streams, retries and each fault kind."""
    schedules = [generate(seed, 30.0, disk_faults=True) for seed in range(5)]
    calls = [c for s in schedules for c in s.calls]
    assert {c.route for c in calls} == {"chat", "messages", "send"}
    assert {c.key is None for c in calls} == {True, False}
    assert {c.stream for c in calls} == {True, False}
    assert {c.sdk_retries for c in calls} >= {0, 1, 2}
    items = {item.split("=")[0] for c in calls for item in c.behaviour.split(";") if item}
    assert items >= {"delay", "status", "drop", "cut", "reset", "id", "times"}
    kinds = {f.kind for s in schedules for f in s.faults}
    assert kinds == {"kill", "crash_at", "stop", "restart", "disk_full"}


def test_ledger_faults_are_drawn_only_when_asked() -> None:
    """--ledger-faults adds read_only (SQLite) or pg_outage (PostgreSQL) on replica 0,
    and leaves every schedule drawn without it unchanged."""
    for seed in range(5):
        plain = generate(seed, 30.0, disk_faults=True)
        assert plain == generate(seed, 30.0, disk_faults=True, ledger_faults=False)
    sqlite = [generate(seed, 30.0, ledger_faults=True) for seed in range(10)]
    pg = [generate(s, 30.0, replicas=3, ledger="postgres", ledger_faults=True) for s in range(10)]
    read_only = [f for s in sqlite for f in s.faults if f.kind == "read_only"]
    outages = [f for s in pg for f in s.faults if f.kind == "pg_outage"]
    assert read_only and outages
    assert {f.kind for s in sqlite for f in s.faults} & {"pg_outage", "disk_full"} == set()
    assert {f.kind for s in pg for f in s.faults} & {"read_only", "disk_full"} == set()
    assert {f.replica for f in read_only + outages} == {0}
    assert {f.point for f in outages} == {"fast", "immediate"}


def test_answer_faults_are_drawn_only_when_asked() -> None:
    """--answer-faults makes some calls' answers endless and pads others to half the run's
    max_answer_bytes, changing nothing else; every schedule drawn without it is unchanged."""
    for seed in range(10):
        plain = generate(seed, 30.0)
        assert plain == generate(seed, 30.0, answer_faults=False)
        faulty = generate(seed, 30.0, answer_faults=True)
        assert faulty.faults == plain.faults and len(faulty.calls) == len(plain.calls)
        for was, now in zip(plain.calls, faulty.calls, strict=True):
            assert dataclasses.replace(now, behaviour=was.behaviour) == was
            assert now.behaviour in (was.behaviour, "endless", f"pad={MAX_ANSWER_BYTES // 2}")
    behaviours = [
        c.behaviour for s in range(10) for c in generate(s, 30.0, answer_faults=True).calls
    ]
    assert "endless" in behaviours and f"pad={MAX_ANSWER_BYTES // 2}" in behaviours


def test_lookups_are_drawn_only_when_asked() -> None:
    """``--lookups`` adds keyed ``pay`` calls that resend in storms, lost or refused at
    times; without it the schedule is the one drawn before the option existed."""
    for seed in range(5):
        assert generate(seed, 30.0) == generate(seed, 30.0, lookups=False)
        assert not any(c.route == "pay" for c in generate(seed, 30.0).calls)
    drawn = [c for s in range(5) for c in generate(s, 30.0, lookups=True).calls]
    paid = [c for c in drawn if c.route == "pay"]
    assert paid and all(c.key is not None and c.resends >= 1 for c in paid)
    assert {c.resends for c in paid} == {1, 2, 3, 4}
    kinds = " ".join(c.behaviour for c in paid)
    assert "drop" in kinds and "reset=0" in kinds and "status=500" in kinds
    assert generate(3, 30.0) == dataclasses.replace(
        generate(3, 30.0, lookups=True),
        calls=tuple(c for c in generate(3, 30.0, lookups=True).calls if c.route != "pay"),
        lookups=False,
    )


def test_keyless_payments_are_drawn_only_when_asked() -> None:
    """``--keyless`` adds ``q`` pay calls without a key, which never repeat after their
    200 (that would be new work); the keyed calls of the schedule stay as they were."""
    for seed in range(5):
        keyed = generate(seed, 30.0, lookups=True)
        both = generate(seed, 30.0, lookups=True, keyless=True)
        assert keyed == generate(seed, 30.0, lookups=True, keyless=False)
        assert not keyed.keyless and both.keyless
        assert [c for c in both.calls if not c.id.startswith("q")] == list(keyed.calls)
        assert not generate(seed, 30.0, keyless=True).keyless  # only with --lookups
    added = [c for s in range(5) for c in generate(s, 30.0, lookups=True, keyless=True).calls]
    keyless = [c for c in added if c.id.startswith("q")]
    assert keyless and all(c.route == "pay" and c.key is None for c in keyless)
    assert not any(c.repeat for c in keyless) and all(c.resends >= 1 for c in keyless)


def test_operator_limit_changes_are_drawn_only_when_asked() -> None:
    """``--operator`` adds ``budget set`` actions (raise, lower, remove, any budget) and,
    with ``--lookups``, ``reconcile --auto``, drawn apart: the calls and faults of the
    schedule stay as they were without it."""
    for seed in range(5):
        plain = generate(seed, 30.0, disk_faults=True)
        assert plain == generate(seed, 30.0, disk_faults=True, operator=False)
        with_operator = generate(seed, 30.0, disk_faults=True, operator=True)
        assert with_operator.calls == plain.calls
        ours = [f for f in with_operator.faults if f.kind not in OPERATOR_ACTIONS]
        assert ours == list(plain.faults)
    sets = [f for s in range(5) for f in generate(s, 30.0, operator=True).faults]
    points = [f.point or "" for f in sets if f.kind == "budget_set"]
    assert {p.partition("=")[0] for p in points} == set(BUDGETS)
    assert any(p.endswith("=none") for p in points)
    assert any(p.partition("=")[2].isdigit() for p in points)
    assert "reconcile_auto" not in {f.kind for f in sets}  # only with --lookups
    looked = [f for s in range(5) for f in generate(s, 30.0, lookups=True, operator=True).faults]
    assert {"budget_set", "reconcile_auto"} <= {f.kind for f in looked}


def test_operator_key_rotations_and_rate_limits_are_drawn_apart() -> None:
    """``--operator`` also rotates keys (each root's ``ROOT.N`` revoked, ``ROOT.N+1`` made
    before, soon after or long after) and sets ``rpm``/``concurrency``, from a generator
    of its own: the ``budget set`` actions stay as they were drawn before, and the whole
    operator's list is in time order."""
    kinds = ("key_revoke", "key_new", "rate_set")
    before = generate(2, 30.0, operator=True)  # the list's `2 sqlite 4 operator`, longer
    sets = [f for f in before.faults if f.kind == "budget_set"]
    assert sets and all(f.point and "=" in f.point for f in sets)
    drawn = [f for s in range(6) for f in generate(s, 30.0, operator=True).faults]
    assert {f.kind for f in drawn} >= set(kinds)
    for seed in range(6):
        actions = [f for f in generate(seed, 30.0, operator=True).faults if f.kind in kinds]
        assert actions == sorted(actions, key=lambda f: f.at)
        names = [(f.kind, f.point or "") for f in actions if f.kind != "rate_set"]
        for root in KEY_ROOTS:  # revoked ROOT.0, made ROOT.1, revoked ROOT.1, ...
            mine = [(k, n) for k, n in names if n.rpartition(".")[0] == root]
            revoked = [int(n.rpartition(".")[2]) for k, n in mine if k == "key_revoke"]
            made = [int(n.rpartition(".")[2]) for k, n in mine if k == "key_new"]
            assert revoked == list(range(len(revoked))) and made == [r + 1 for r in revoked]
            for n in revoked[1:]:  # a key is revoked only after it was made
                assert mine.index(("key_new", f"{root}.{n}")) < mine.index(
                    ("key_revoke", f"{root}.{n}")
                )
    gaps = [
        new.at - old.at
        for s in range(20)
        for old, new in itertools.pairwise(
            f for f in generate(s, 60.0, operator=True).faults if f.kind.startswith("key_")
        )
        if old.kind == "key_revoke" and new.kind == "key_new"
    ]
    assert max(gaps) > HARD_BOUND_S  # some revoked keys are sent past the hard bound
    assert "reconcile_auto" not in {f.kind for f in drawn}


def test_maintenance_is_drawn_only_when_asked() -> None:
    """``--maintenance`` adds backups, archives (in steps of several sizes) and authorized
    resends, drawn apart: the calls and faults of the schedule stay as they were."""
    kinds = {"backup", "archive", "resend"}
    for seed in range(5):
        plain = generate(seed, 30.0, disk_faults=True, operator=True)
        assert plain == generate(seed, 30.0, disk_faults=True, operator=True, maintenance=False)
        with_maintenance = generate(seed, 30.0, disk_faults=True, operator=True, maintenance=True)
        assert with_maintenance.calls == plain.calls
        assert [f for f in with_maintenance.faults if f.kind not in kinds] == list(plain.faults)
    drawn = [f for s in range(5) for f in generate(s, 30.0, maintenance=True).faults]
    assert kinds <= {f.kind for f in drawn}
    assert len({f.point for f in drawn if f.kind == "archive"}) > 1


def test_maintenance_on_postgres_draws_no_backup() -> None:
    """On PostgreSQL (backed up with its own tools, not ``effectguard backup``)
    ``--maintenance`` draws archives and authorized resends only, and the schedule's
    calls and other faults stay as they were without it."""
    drawn = []
    for seed in range(5):
        plain = generate(seed, 30.0, replicas=3, ledger="postgres", ledger_faults=True)
        with_maintenance = generate(
            seed, 30.0, replicas=3, ledger="postgres", ledger_faults=True, maintenance=True
        )
        assert with_maintenance.calls == plain.calls
        mine = [f for f in with_maintenance.faults if f.kind in {"backup", "archive", "resend"}]
        assert [f for f in with_maintenance.faults if f not in mine] == list(plain.faults)
        drawn += mine
    assert {f.kind for f in drawn} == {"archive", "resend"}


# -- the checkers, on fabricated evidence --------------------------------------------

BODY = b'{"model":"gpt-4o-mini","messages":[]}'
SHA = hashlib.sha256(BODY).hexdigest()
ANSWER = b'{"id":"x","choices":[]}'


def _stored(events: list[tuple[float, Event]]) -> list[StoredEvent]:
    return [
        StoredEvent(i, e.kind, e.call_id, e.to_data(), "w", 1, at, "0", "0")
        for i, (at, e) in enumerate(events, start=1)
    ]


def _call_events(call: str = "c1", *, observed: bool = True) -> list[tuple[float, Event]]:
    """One call's events: admitted at t=1, and (by default) answered and settled at t=3."""
    events: list[tuple[float, Event]] = [
        (1.0, _manifest(call)),
        (1.0, BudgetReserved(call=call, budget="team", amount=5)),
        (1.0, AttemptStarted(call=call, attempt=1, worker="w", generation=1)),
    ]
    if observed:
        outcome = completion(call, budget="team", reserved=5, actual=4, body=ANSWER.decode())
        events += [(3.0, e) for e in outcome]
    return events


def _manifest(call: str) -> CallManifest:
    return CallManifest(
        call=call,
        request_hash="h",
        provider="openai",
        endpoint="/v1/chat/completions",
        method="POST",
        model="gpt-4o-mini",
        idempotency_key=None,
        budget="team",
        budget_root="team",
        effect_kind="billable",
        body=BODY.decode(),
    )


def _evidence(events: list[tuple[float, Event]], **changes: Any) -> Evidence:
    """Evidence over ``events``: one receipt of BODY at t=2 and a clean 200 of ANSWER."""
    stored = _stored(events)
    by_call: dict[str, list[Event]] = {}
    for _, e in events:
        if e.call_id is not None:
            by_call.setdefault(e.call_id, []).append(e)
    calls = [work_state(evs) for evs in by_call.values()]
    receipt = {"seq": 1, "ts": 2.0, "body_sha256": SHA, "deduped": False, "tag": "c1.0"}
    receipt |= {"path": "/v1/chat/completions", "status": 200}
    answer = _answer()
    base = Evidence(stored, calls, [receipt], [answer], 0, "")
    return dataclasses.replace(base, **changes)


def _answer(**changes: Any) -> Answer:
    answer = Answer("c1", "first", "c1.0", 0, False, None, status=200, call_id="c1")
    answer.body_b64 = base64.b64encode(ANSWER).decode()
    return dataclasses.replace(answer, **changes)


def _fired(evidence: Evidence) -> set[str]:
    return {v.invariant for v in check(evidence)}


def test_clean_evidence_breaks_nothing() -> None:
    """The baseline: an admitted, dispatched, answered, settled call with one receipt."""
    assert check(_evidence(_call_events())) == []


def test_receipt_without_attempt_is_caught() -> None:
    """An extra receipt that no attempt.started precedes breaks the first invariant."""
    evidence = _evidence(_call_events())
    evidence.receipts.append({"seq": 2, "ts": 5.0, "body_sha256": SHA, "deduped": False})
    assert "receipt_without_attempt" in _fired(evidence)
    early = _evidence(_call_events())
    early.receipts[0]["ts"] = 0.5  # before the attempt was durable
    assert _fired(early) == {"receipt_without_attempt"}


def test_effect_of_an_attempt_booked_not_sent_is_caught() -> None:
    """A receipt for an attempt the ledger booked "not sent" (the broken classifier)."""
    events = _call_events(observed=False)
    events.append((3.0, AttemptNotSent(call="c1", attempt=1, reason="connect")))
    evidence = _evidence(events, answers=[])
    assert _fired(evidence) == {"effects_exceed_attempts"}


def test_deduplicated_receipts_are_not_effects() -> None:
    """A receipt the provider answered from its dedup store adds no effect."""
    evidence = _evidence(_call_events())
    evidence.receipts.append({"seq": 2, "ts": 5.0, "body_sha256": SHA, "deduped": True})
    assert "effects_exceed_attempts" not in _fired(evidence)


def test_call_left_in_flight_is_caught() -> None:
    """A call still in flight after the quiet period breaks ``call_in_flight``."""
    evidence = _evidence(_call_events(observed=False), answers=[])
    assert _fired(evidence) == {"call_in_flight"}


def test_unobserved_attempt_without_hold_is_caught() -> None:
    """A dispatched, unobserved attempt must be effect_unknown holding its reservation."""
    evidence = _evidence(_call_events(observed=False), answers=[])
    (state,) = evidence.calls
    evidence.calls = [replace(state, stage="effect_unknown", held=0, reserved=0)]
    assert _fired(evidence) == {"unobserved_not_held"}
    evidence.calls = [replace(state, stage="effect_unknown", held=5, reserved=0)]
    assert _fired(evidence) == set()


def test_budget_prefix_over_limit_is_caught_and_overshoot_is_only_flagged() -> None:
    """Two reservations past the limit break it; a settlement above its reservation does not."""
    limit: list[tuple[float, Event]] = [(0.5, BudgetLimitSet(path="team", limit=8))]
    over = [
        *limit,
        (1.0, BudgetReserved(call="c1", budget="team", amount=5)),
        (1.0, BudgetReserved(call="c2", budget="team", amount=5)),
    ]
    violations = check(_evidence(over, receipts=[], answers=[]))
    assert [v.invariant for v in violations if v.invariant == "budget_over_limit"]
    assert "team" in str(violations[-1])
    overshoot = [
        *limit,
        (1.0, BudgetReserved(call="c1", budget="team", amount=5)),
        (2.0, BudgetSettled(call="c1", budget="team", reserved=5, actual=9)),
    ]
    evidence = _evidence(overshoot, receipts=[], answers=[])
    assert "budget_over_limit" not in _fired(evidence)
    assert len(overshoots(evidence)) == 1


def test_limit_lowered_below_what_a_budget_holds_is_no_breach_until_an_admission() -> None:
    """An operator's ``budget set`` below what a node holds breaks nothing, nor do the
    releases and settlements after it (even one that overshoots); an admission that
    commits past the lowered limit does."""
    lowered: list[tuple[float, Event]] = [
        (0.5, BudgetLimitSet(path="team", limit=20)),
        (1.0, BudgetReserved(call="c1", budget="team", amount=5)),
        (1.0, BudgetReserved(call="c2", budget="team", amount=5)),
        (1.5, BudgetLimitSet(path="team", limit=4)),
        (2.0, BudgetSettled(call="c1", budget="team", reserved=5, actual=7)),
        (2.0, BudgetReleased(call="c2", budget="team", amount=5)),
    ]
    assert "budget_over_limit" not in _fired(_evidence(lowered, receipts=[], answers=[]))
    admitted = [*lowered, (3.0, BudgetReserved(call="c3", budget="team", amount=1))]
    violations = check(_evidence(admitted, receipts=[], answers=[]))
    assert [v for v in violations if v.invariant == "budget_over_limit" and "c3" in str(v)]


def test_ok_for_a_call_that_is_not_completed_is_caught() -> None:
    """A 200 for a failed (or unknown) call, or bytes the ledger did not store, is caught."""
    evidence = _evidence(_call_events())
    (state,) = evidence.calls
    evidence.calls = [replace(state, stage="failed")]
    assert _fired(evidence) == {"ok_not_completed"}
    other_bytes = _evidence(_call_events(), answers=[_answer(body_b64="e30=")])
    assert _fired(other_bytes) == {"ok_not_completed"}


def test_clean_stream_without_terminal_event_is_caught() -> None:
    """A stream that ended cleanly for the client must hold [DONE] or message_stop."""
    evidence = _evidence(_call_events(), answers=[_answer(stream=True)])
    assert "stream_ok_without_end" in _fired(evidence)


def test_replay_with_other_bytes_or_refused_is_caught() -> None:
    """The keyed resend of a 200 is a replay of the same bytes."""
    changed = _answer(kind="replay", replayed=True, body_b64="e30=")
    assert "replay_differs" in _fired(_evidence(_call_events(), answers=[_answer(), changed]))
    refused = _answer(kind="replay", status=409, error_type="effect_unknown")
    assert _fired(_evidence(_call_events(), answers=[_answer(), refused])) == {"replay_differs"}


def test_ledger_unavailable_with_a_receipt_is_caught() -> None:
    """A request answered 503 ledger_unavailable never reached the provider, not even
    to be answered with a declared not-processed 429 (the client must get that 429)."""
    answer = _answer(status=503, error_type="ledger_unavailable", call_id=None)
    assert _fired(_evidence(_call_events(), answers=[answer])) == {"unavailable_with_receipt"}
    declined = _evidence(_call_events(), answers=[answer])
    declined.receipts[0]["status"] = 429
    assert _fired(declined) == {"unavailable_with_receipt"}


def test_failed_verify_is_caught() -> None:
    """A non-zero ``effectguard verify`` exit is a violation carrying its output."""
    evidence = _evidence(_call_events(), verify_code=1, verify_output="event 7: bad digest")
    (violation,) = check(evidence)
    assert violation.invariant == "verify_failed" and "event 7" in violation.detail


def test_replica_that_never_recovers_is_caught() -> None:
    """A replica that refused /healthz long after the last fault (fenced for good)."""
    assert _fired(_evidence(_call_events(), unrecovered=[0])) == {"replica_unrecovered"}


def _paid(seq: int, ts: float, status: int = 200, *, op: str = "c1") -> dict[str, Any]:
    """A receipt of operation ``op`` (the call id the ``payments`` tool carries)."""
    return {"seq": seq, "ts": ts, "body_sha256": SHA, "deduped": False, "op": op} | {
        "tag": f"{op}.{seq}",
        "path": "/v1/send",
        "status": status,
    }


def test_an_operation_applied_twice_is_caught() -> None:
    """Two applied receipts of one operation id; a refused (500) or deduplicated one, or
    another operation's, is no second effect."""
    twice = _evidence(_call_events(), receipts=[_paid(1, 2.0), _paid(2, 2.6)])
    assert "operation_applied_twice" in _fired(twice)
    for receipts in [
        [_paid(1, 2.0, 500), _paid(2, 2.6)],
        [_paid(1, 2.0), _paid(2, 2.6) | {"deduped": True}],
        [_paid(1, 2.0), _paid(2, 2.6, op="c2")],
    ]:
        assert "operation_applied_twice" not in _fired(_evidence(_call_events(), receipts=receipts))


def _decided(applied: bool, at: float) -> list[tuple[float, Event]]:
    """c1 lost after it was sent (effect unknown), then decided at ``at``."""
    events = _call_events(observed=False)
    decision = CallReconciled(call="c1", applied=applied, cost=5, note="n", by="lookup:payments")
    return [*events, (at, decision)]


def test_a_decision_the_receipts_contradict_is_caught() -> None:
    """ "Not applied" after the provider applied the operation, or "applied" before it
    did, contradicts its books; agreeing decisions are quiet."""
    for applied, receipts, fired in [
        (False, [_paid(1, 2.0)], {"decision_contradicts_receipts"}),
        (True, [_paid(1, 2.0, 500)], {"decision_contradicts_receipts"}),
        (True, [_paid(1, 5.0)], {"decision_contradicts_receipts"}),
        (True, [_paid(1, 2.0)], set()),
        (False, [_paid(1, 2.0, 500)], set()),
    ]:
        evidence = _evidence(_decided(applied, 4.0), receipts=receipts, answers=[])
        (state,) = evidence.calls
        stage = "reconciled_applied" if applied else "reconciled_not_applied"
        evidence.calls = [replace(state, stage=stage, held=0)]
        assert _fired(evidence) == fired, (applied, receipts)


def _later(call: str, after: float) -> list[tuple[float, Event]]:
    """``call``'s events (admitted, answered, settled) ``after`` seconds later than c1's."""
    return [(at + after, e) for at, e in _call_events(call)]


def _unknown(decided: bool | None = None, at: float = 0.0) -> list[tuple[float, Event]]:
    """c1 sent, its answer lost at t=2.5 (effect unknown), then ``decided`` at ``at``."""
    lost = AttemptInterrupted(call="c1", attempt=1, reason="read timeout", by="w")
    events = [*_call_events(observed=False), (2.5, lost)]
    if decided is not None:
        events.append((at, CallReconciled(call="c1", applied=decided, cost=5, note="n", by="p")))
    return events


def test_a_keyless_retry_applied_again_is_caught() -> None:
    """Two calls of one logical request (tags ``q1.*``), both applied: the second was
    admitted while the first was in flight, unknown or decided applied (fires), or after
    it had completed or was decided not applied (quiet: a retry is new work then)."""
    first, again = _paid(1, 2.0) | {"tag": "q1.0"}, _paid(2, 6.0, op="c2") | {"tag": "q1.s0.0"}
    for events, fired in [
        (_call_events(observed=False), True),  # in flight when c2 came
        (_unknown(), True),
        (_unknown(True, 4.0), True),
        (_unknown(True, 5.5), True),  # decided only after c2 was admitted: unknown then
        (_call_events(), False),  # completed at 3, before c2 came at 5
        (_unknown(False, 4.0), False),
    ]:
        evidence = _evidence(events + _later("c2", 4.0), receipts=[first, again], answers=[])
        assert ("retry_applied_again" in _fired(evidence)) == fired, events[-1]
    alone = _evidence(_unknown(True, 4.0) + _later("c2", 4.0), receipts=[first], answers=[])
    assert "retry_applied_again" not in _fired(alone)  # c2 never reached the provider


def test_a_recovered_result_is_checked_against_the_decision() -> None:
    """A 200 marked recovered matches the result the applied decision kept."""
    events = _call_events(observed=False)
    result = CallReconciled(call="c1", applied=True, cost=5, note="n", by="lookup:p", result="{}")
    events.append((4.0, result))
    recovered = _answer(recovered="lookup:p", replayed=True, body_b64="e30=")
    evidence = _evidence(events, answers=[recovered])
    (state,) = evidence.calls
    evidence.calls = [replace(state, stage="reconciled_applied", held=0)]
    assert _fired(evidence) == set()
    evidence.answers = [_answer(recovered="lookup:p", replayed=True)]
    assert _fired(evidence) == {"ok_not_completed"}


def test_an_operator_command_that_crashed_is_caught() -> None:
    """An operator's command (``--operator``) that failed other than "ledger unavailable"
    (exit 4) is a violation; the run's summary of it names the command and its words."""
    crashed = ["budget_set_failed at 6.5 s (team-a=100) exit 1: Traceback ..."]
    assert _fired(_evidence(_call_events(), operator_failures=crashed)) == {
        "operator_command_failed"
    }


def _keyed(status: int | None, sent_at: float, **changes: Any) -> Answer:
    """A request of scheduled call c0001 with key ``team.0``."""
    fields = {"status": status, "sent_at": sent_at, "proxy_key": "team.0", "tag": "c0001.0"}
    return _answer(**({"call": "c0001", "call_id": None} | fields | changes))


def _key_action(action: str, returned: float) -> dict[str, Any]:
    return {"action": action, "name": "team.0", "began": returned - 0.5, "returned": returned}


def test_a_revoked_key_admitted_past_the_bound_is_caught() -> None:
    """Past ``key_refresh_s`` + 5 s after ``key revoke`` returned, a request with the key
    answered anything but 401 (or 503 ``ledger_unavailable``), or reaching the provider
    (its tag in a receipt), or a scheduled call whose every request was such that still
    has a manifest, breaks ``revoked_key_admitted``; within the bound it is only flagged."""
    revoked = [_key_action("key_revoke", 100.0)]
    late = 100.0 + HARD_BOUND_S + 0.5
    refused = _evidence(_call_events(), key_actions=revoked, answers=[_keyed(401, late)])
    assert check(refused) == []
    admitted = dataclasses.replace(refused, answers=[_keyed(200, late)])
    assert _fired(admitted) == {"revoked_key_admitted", "ok_not_completed"}
    lost = dataclasses.replace(refused, answers=[_keyed(None, late, transport_error="reset")])
    receipt = lost.receipts[0] | {"tag": "c0001.0"}
    assert _fired(dataclasses.replace(lost, receipts=[receipt])) == {"revoked_key_admitted"}
    named = _call_events()
    named[0] = (1.0, dataclasses.replace(_manifest("c1"), body='{"x": "sim 7 c0001: alpha"}'))
    assert "revoked_key_admitted" in _fired(dataclasses.replace(lost, events=_stored(named)))
    soon = dataclasses.replace(refused, answers=[_keyed(200, 101.5, call_id="c1")])
    assert "revoked_key_admitted" not in _fired(soon)
    assert late_keys(soon) == ["c0001.0: revoked key team.0 answered 200, 1.50 s after"]


def test_a_new_key_refused_past_the_bound_is_caught() -> None:
    """Past the bound after ``key new`` returned, a 401 for the key breaks
    ``new_key_refused``; not once its revocation has begun, nor when the 401 came back
    after it began."""
    made = [_key_action("key_new", 100.0)]
    late = 100.0 + HARD_BOUND_S + 0.5
    refused = _evidence(_call_events(), key_actions=made, answers=[_keyed(401, late)])
    assert _fired(refused) == {"new_key_refused"}
    ended = [*made, _key_action("key_revoke", late - 1)]
    assert check(dataclasses.replace(refused, key_actions=ended)) == []
    assert check(dataclasses.replace(refused, answers=[_keyed(401, 101.0)])) == []
    # Sent before the revocation began, answered after it (the replica was paused between):
    # refused as the key then stood (seed 307 sqlite 15 --ledger-faults --disk-faults).
    paused = [*made, _key_action("key_revoke", late + 1.5)]
    answered = _keyed(401, late, answered_at=late + 3.0)
    assert check(dataclasses.replace(refused, key_actions=paused, answers=[answered])) == []


def _reserved(call: str, at: float) -> list[tuple[float, Event]]:
    """A call admitted under ``team`` at ``at`` (and left in flight)."""
    return [
        (at, _manifest(call)),
        (at, BudgetReserved(call=call, budget="team", amount=5)),
        (at, AttemptStarted(call=call, attempt=1, worker="w", generation=1)),
    ]


def test_an_admission_past_a_rate_limit_is_caught() -> None:
    """An attempt admitted past the ``rpm`` in force (counted from the declaration that
    gave the node rates, in its calendar minute) or past ``concurrency`` (the node's
    other calls in flight) breaks ``rate_limit_exceeded``; a new minute starts empty, and
    attempts admitted before the declaration count for nothing."""

    def fired(*events: tuple[float, Event]) -> set[str]:
        return {v.invariant for v in check(_evidence(list(events), answers=[], receipts=[]))}

    rpm = (600.0, BudgetLimitSet(path="team", limit=None, rpm=1))
    assert "rate_limit_exceeded" in fired(rpm, *_reserved("a", 601.0), *_reserved("b", 602.0))
    assert "rate_limit_exceeded" not in fired(
        *_reserved("z", 600.0), rpm, *_reserved("a", 601.0), *_reserved("b", 661.0)
    )
    lowered = (602.0, BudgetLimitSet(path="team", limit=None, rpm=1))
    raised = (600.0, BudgetLimitSet(path="team", limit=None, rpm=5))
    assert "rate_limit_exceeded" in fired(
        raised, *_reserved("a", 601.0), lowered, *_reserved("b", 603.0)
    )
    one = (600.0, BudgetLimitSet(path="team", limit=None, concurrency=1))
    assert "rate_limit_exceeded" in fired(one, *_reserved("a", 601.0), *_reserved("b", 602.0))
    done = [(601.5, e) for e in completion("a", budget="team", reserved=5, actual=4, body="{}")]
    assert "rate_limit_exceeded" not in fired(
        one, *_reserved("a", 601.0), *done, *_reserved("b", 602.0)
    )


def test_a_backup_that_does_not_verify_is_caught() -> None:
    """A backup that exited 0 and whose copy ``verify`` refuses; a verified one is quiet."""
    good = ("backups/backup-000.db", 0, "ok: 12 events")
    bad = ("backups/backup-001.db", 1, "BROKEN at event 7: ...")
    assert _fired(_evidence(_call_events(), backup_checks=[good])) == set()
    assert _fired(_evidence(_call_events(), backup_checks=[good, bad])) == {"backup_unverified"}


def test_an_archive_file_that_does_not_verify_or_is_missing_is_caught() -> None:
    """An archive file ``verify --archive`` refuses, or one an archive that exited 0 named
    and that is not there (code -1)."""
    good = ("ledger/ledger-archive-1-40.jsonl.gz", 0, "ok")
    for bad in [
        ("ledger/ledger-archive-41-90.jsonl.gz", 1, "BROKEN at event 60"),
        ("ledger/ledger-archive-91-99.jsonl.gz", -1, "named by an archive; not there"),
    ]:
        evidence = _evidence(_call_events(), archive_checks=[good, bad])
        assert _fired(evidence) == {"archive_unverified"}
    assert _fired(_evidence(_call_events(), archive_checks=[good])) == set()


def test_an_event_lost_or_held_twice_is_caught() -> None:
    """A gap in the numbers of the events held (archives and live ledger together), an
    event held twice, or a call a client got a 200 for that is nowhere."""
    evidence = _evidence(_call_events())
    gap = dataclasses.replace(evidence, events=[e for e in evidence.events if e.seq != 2])
    assert "event_lost" in _fired(gap)
    twice = dataclasses.replace(evidence, events=[evidence.events[0], *evidence.events])
    assert "event_lost" in _fired(twice)
    head = dataclasses.replace(evidence, events=[e for e in evidence.events if e.seq != 1])
    assert "event_lost" in _fired(head)  # the first events gone (an archive file lost)
    stranger = dataclasses.replace(evidence, answers=[*evidence.answers, _answer(call_id="c9")])
    assert "event_lost" in _fired(stranger)


def _authorized(*more: tuple[float, Event]) -> list[tuple[float, Event]]:
    """c1 lost (effect unknown, held 5) and its resend authorized at t=3, then ``more``."""
    auth = CallResendAuthorized(call="c1", note="n", by="sim-operator")
    return [*_unknown(), (2.5, BudgetHeld(call="c1", budget="team", amount=5)), (3.0, auth), *more]


def test_a_resend_beyond_its_authorization_is_caught() -> None:
    """After an authorization, two provider effects of the call fire; one effect, a second
    request the provider declares did nothing (429) or answered from its dedup store, or
    a second effect after another authorization or a decision "not applied", is quiet.
    The receipt before the authorization (the lost first attempt) never counts."""
    again = (5.0, CallResendAuthorized(call="c1", note="n", by="o"))
    not_applied = (5.0, CallReconciled(call="c1", applied=False, cost=0, note="n", by="p"))
    for events, second, fired in [
        (_authorized(), _paid(3, 6.0), True),
        (_authorized(), None, False),
        (_authorized(), _paid(3, 6.0, 429), False),
        (_authorized(), _paid(3, 6.0) | {"deduped": True}, False),
        (_authorized(again), _paid(3, 6.0), False),
        (_authorized(not_applied), _paid(3, 6.0), False),
    ]:
        receipts = [_paid(1, 2.0), _paid(2, 4.0)] + ([second] if second else [])
        evidence = _evidence(events, receipts=receipts, answers=[])
        evidence.no_effect = {"openai": frozenset({429})}
        assert ("resend_beyond_authorized" in _fired(evidence)) == fired, (events[-1], second)
        if second is None:  # an authorized resend applies the operation once more, allowed
            assert "operation_applied_twice" not in _fired(evidence)


def test_an_authorized_resend_lost_in_turn_holds_both_reservations() -> None:
    """contract §8 ``--resend``: a resend whose effect is unknown in turn holds its own
    reservation on top of the first attempt's hold; holding only its own is caught."""
    resent = [
        (4.0, BudgetReserved(call="c1", budget="team", amount=5)),
        (4.0, AttemptStarted(call="c1", attempt=2, worker="w", generation=1)),
        (4.5, AttemptInterrupted(call="c1", attempt=2, reason="reset", by="w")),
        (4.5, BudgetHeld(call="c1", budget="team", amount=5)),
    ]
    evidence = _evidence(_authorized(*resent), receipts=[], answers=[])
    (state,) = evidence.calls
    assert state.held == 10 and _fired(evidence) == set()
    evidence.calls = [replace(state, held=5)]
    assert _fired(evidence) == {"unobserved_not_held"}


def test_a_maintenance_command_that_crashed_is_caught() -> None:
    """A maintenance command that exited with a code not documented for it, or printed a
    traceback whatever its code, is a violation; a documented refusal is not."""
    actions: list[dict[str, Any]] = [
        {"at": 1.0, "action": "backup", "code": 0, "path": "b"},
        {"at": 2.0, "action": "backup_failed", "code": 4, "error": "ledger unavailable"},
        {"at": 3.0, "action": "archive_failed", "code": 3, "error": "run archive again"},
        {"at": 4.0, "action": "resend_failed", "code": 3, "error": "not effect_unknown"},
        {"at": 5.0, "action": "budget_set_failed", "code": 1, "error": "not maintenance"},
    ]
    assert maintenance_failures(actions) == []
    crashed = [
        {"at": 6.0, "action": "archive_failed", "code": 1, "error": "Traceback ..."},
        {"at": 7.0, "action": "backup_failed", "code": 4, "error": "...", "crashed": True},
        {"at": 8.0, "action": "resend_failed", "code": 2, "error": "usage"},
    ]
    failures = maintenance_failures(actions + crashed)
    assert [f.split(" at ")[0] for f in failures] == ["archive", "backup", "resend"]
    evidence = _evidence(_call_events(), maintenance_failures=failures)
    assert _fired(evidence) == {"maintenance_command_failed"}


def test_every_invariant_has_a_checker_test() -> None:
    """Each named invariant is exercised by a test above (keep the list and tests in step)."""
    source = Path(__file__).read_text()
    assert all(f'"{name}"' in source for name in INVARIANTS)


# -- real runs -----------------------------------------------------------------------


def _seeds() -> list[tuple[int, str, float, frozenset[str]]]:
    """``tests/sim_seeds.txt``: ``SEED LEDGER DURATION [lookups] [keyless] [operator]
    [maintenance] [ledger-faults] [clock-steps]`` per line, ``#`` comments."""
    out = []
    for line in SEEDS.read_text().splitlines():
        fields = line.split("#")[0].split()
        if fields:
            out.append((int(fields[0]), fields[1], float(fields[2]), frozenset(fields[3:])))
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("seed", "ledger", "duration", "options"), _seeds())
def test_seed_from_the_list_keeps_every_invariant(
    tmp_path: Path, seed: int, ledger: str, duration: float, options: frozenset[str]
) -> None:
    """A listed seed runs against real processes and every invariant holds."""
    if ledger == "postgres" and not PG_DSN:
        pytest.skip("needs EFFECTGUARD_TEST_PG_DSN")
    ledger_faults = "ledger-faults" in options
    if ledger_faults and ledger == "postgres" and (reason := unavailable_reason()) is not None:
        pytest.skip(f"ledger-faults: {reason}")
    if ledger_faults and ledger == "sqlite" and os.geteuid() != 0:
        pytest.skip("ledger-faults: a SQLite ledger remounted read-only needs root")
    if "clock-steps" in options and (reason := faketime.unavailable_reason()) is not None:
        pytest.skip(f"clock-steps: {reason}")
    replicas = 3 if ledger == "postgres" else 1
    lookups, keyless = "lookups" in options, "keyless" in options
    schedule = generate(
        seed,
        duration,
        replicas=replicas,
        ledger=ledger,
        ledger_faults=ledger_faults,
        lookups=lookups,
        keyless=keyless,
        operator="operator" in options,
        maintenance="maintenance" in options,
        clock_steps="clock-steps" in options,
    )
    result = run_schedule(
        schedule,
        tmp_path / "run",
        pg_dsn=PG_DSN,
        ledger_faults=ledger_faults,
        bundle=tmp_path / "bundle",
    )
    unexpected = [v for v in result.violations if v.invariant not in KNOWN]
    assert not unexpected, f"{result.summary()}\n" + "\n".join(map(str, unexpected))
    if "clock-steps" in options:  # the replica's ledger times went back: libfaketime loaded
        ats = [e.at for e in result.evidence.events]
        assert any(
            at < before - 0.5
            for before, at in zip(itertools.accumulate(ats, max), ats[1:], strict=False)
        ), result.summary()
    known = {v.invariant for v in result.violations}
    if known:
        pytest.xfail("; ".join(KNOWN[name] for name in sorted(known)))


def _dropping_schedule(seed: int) -> Schedule:
    """Key-less chat calls whose first request the provider reads and then hangs up on."""
    calls = tuple(
        Call(
            id=f"c{n:04d}",
            at=0.2 * n,
            route="chat",
            stream=False,
            key=None,
            budget="default",
            max_tokens=4,
            prompt=f"drop {seed} {n}",
            behaviour=f"drop;id=c{n:04d};times=1",
            sdk_retries=0,
            replicas=(0, 0),
            repeat=False,
        )
        for n in range(4)
    )
    return Schedule(seed, 1.0, 1, "sqlite", 2.0, {"default": None}, calls, ())


@pytest.mark.slow
def test_broken_classifier_is_caught_by_the_receipt_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build booking a dropped connection as "not sent" breaks effects_exceed_attempts."""
    control = run_schedule(_dropping_schedule(1), tmp_path / "control")
    assert control.ok, control.summary() + "\n" + "\n".join(map(str, control.violations))
    assert {c.stage for c in control.evidence.calls} == {"effect_unknown"}
    monkeypatch.setenv("EFFECTGUARD_TEST_BREAK", "classify_disconnect_as_not_sent")
    broken = run_schedule(_dropping_schedule(1), tmp_path / "broken", bundle=tmp_path / "b")
    fired = {v.invariant for v in broken.violations}
    assert "effects_exceed_attempts" in fired, broken.summary()
    assert broken.bundle is not None and (broken.bundle / "schedule.json").exists()
    assert Schedule.from_json((broken.bundle / "schedule.json").read_text()).calls


def _ledger_fault_run(tmp_path: Path, ledger: str, fault: Fault) -> Any:
    """Six seconds of seed 307's load with ``fault`` as the only fault, on a faultable ledger."""
    replicas = 3 if ledger == "postgres" else 1
    load = generate(307, 6.0, replicas=replicas, ledger=ledger, ledger_faults=True)
    schedule = dataclasses.replace(load, faults=(fault,))
    return run_schedule(schedule, tmp_path / "run", ledger_faults=True, bundle=tmp_path / "b")


def _done(result: Any) -> list[str]:
    return [str(a["action"]) for a in result.actions]


@pytest.mark.slow
def test_read_only_ledger_fault_keeps_every_invariant(tmp_path: Path) -> None:
    """The SQLite ledger's tmpfs remounted read-only, then read-write: every invariant holds."""
    if os.geteuid() != 0:
        pytest.skip("remounting the ledger's tmpfs read-only needs root")
    result = _ledger_fault_run(tmp_path, "sqlite", Fault(1.5, "read_only", 0, seconds=1.5))
    done = _done(result)
    assert "read_only" in done and "read_write" in done, result.actions
    assert done.index("read_only") < done.index("read_write")
    # serve refuses to start on a read-only ledger (it cannot open it for writing)
    assert "start_failed" in done[done.index("read_only") : done.index("read_write")]
    assert result.ok, result.summary() + "\n" + "\n".join(map(str, result.violations))


@pytest.mark.slow
def test_postgres_outage_keeps_every_invariant(tmp_path: Path) -> None:
    """The run's own PostgreSQL cluster stopped like a crash for two seconds under three
    replicas: admissions meet 503 ledger_unavailable, replicas serve again without a
    restart, every invariant holds."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    fault = Fault(1.5, "pg_outage", 0, seconds=2.0, point="immediate")
    result = _ledger_fault_run(tmp_path, "postgres", fault)
    done = _done(result)
    assert "pg_stopped" in done and "pg_started" in done, result.actions
    assert "unrecovered" not in done
    refused = [a for a in result.evidence.answers if a.error_type == "ledger_unavailable"]
    assert refused, result.summary()
    assert result.ok, result.summary() + "\n" + "\n".join(map(str, result.violations))


@pytest.mark.slow
def test_endless_and_padded_answers_keep_every_invariant(tmp_path: Path) -> None:
    """--answer-faults against a real proxy: endless answers are cut off at the run's
    max_answer_bytes (their calls effect_unknown and held), padded ones complete, and
    every invariant holds. No process faults and no budget limits here, so that every
    call reaches the provider (seeds with both run as `effectguard sim --answer-faults`)."""
    drawn = generate(5002, 6.0, answer_faults=True)
    schedule = dataclasses.replace(drawn, faults=(), limits=dict.fromkeys(drawn.limits))
    result = run_schedule(schedule, tmp_path / "run", bundle=tmp_path / "bundle")
    assert result.ok, result.summary() + "\n" + "\n".join(map(str, result.violations))
    applied = {r["behaviour"] for r in result.evidence.receipts}
    assert {"endless", f"pad={MAX_ANSWER_BYTES // 2}"} <= applied, applied


def test_a_postgres_run_without_a_dsn_is_refused_before_it_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.delenv("EFFECTGUARD_TEST_PG_DSN", raising=False)
    keep = tmp_path / "work"
    code = main(
        ["sim", "--seed", "3", "--duration", "5", "--ledger", "postgres", "--keep", str(keep)]
    )
    assert code == 2 and not keep.exists()
    assert "--ledger postgres needs EFFECTGUARD_TEST_PG_DSN" in capsys.readouterr().err
