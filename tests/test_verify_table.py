"""The verifier's table of legal sequences, on plain lists of events: the contract's paths pass.

Each path below is what the store writes for one call (docs/contract.md §3–§6 and §12). The verifier
must accept every one of them, derive the projection the store would keep, and still refuse
the same path with one event out of place.
"""

from __future__ import annotations

from typing import Any

import pytest

from effectguard.ops.audit import BudgetRow, Verifier
from effectguard.rules.events import GENESIS_DIGEST, StoredEvent, canonical_json, event_digest

W = ("w1", 1)
OP = ("operator", 0)
R = 100


def seal_all(rows: list[tuple[str, dict[str, Any], tuple[str, int]]]) -> list[StoredEvent]:
    """Number and chain ``(kind, data, writer)`` rows, after w1's registration."""
    rows = [
        ("worker.registered", {"worker": "w1", "generation": 1, "host": "h", "pid": 1}, W),
        *rows,
    ]
    prev, out = GENESIS_DIGEST, []
    for seq, (kind, data, (worker, generation)) in enumerate(rows, start=1):
        call = data.get("call")
        digest = event_digest(
            seq=seq,
            kind=kind,
            call_id=call,
            data_json=canonical_json(data),
            worker=worker,
            generation=generation,
            at=1.0,
            prev_digest=prev,
        )
        out.append(StoredEvent(seq, kind, call, data, worker, generation, 1.0, prev, digest))
        prev = digest
    return out


def admit(
    attempt: int = 1, first: bool = True
) -> list[tuple[str, dict[str, Any], tuple[str, int]]]:
    """Admission of call c (manifest only the first time), reserving R."""
    manifest = {
        "call": "c",
        "request_hash": "h",
        "provider": "p",
        "endpoint": "/e",
        "method": "POST",
        "model": "m",
        "idempotency_key": "k",
        "budget": "t/r",
        "budget_root": "t",
        "effect_kind": "billable",
        "body": "{}",
    }
    rows = [("call.manifest", manifest, W)] if first else []
    rows.append(("budget.reserved", {"call": "c", "budget": "t/r", "amount": R}, W))
    rows.append(
        (
            "attempt.started",
            {"call": "c", "attempt": attempt, "worker": "w1", "generation": 1, "at": 1.0},
            W,
        )
    )
    return rows


def observed(
    attempt: int, status: int, **flags: bool
) -> tuple[str, dict[str, Any], tuple[str, int]]:
    """Attempt ``attempt`` answered with ``status``."""
    return ("attempt.observed", {"call": "c", "attempt": attempt, "status": status, **flags}, W)


def call(
    kind: str, writer: tuple[str, int] = W, **data: Any
) -> tuple[str, dict[str, Any], tuple[str, int]]:
    """A call event of ``kind`` with ``data``."""
    return (kind, {"call": "c", **data}, writer)


def late(
    attempt: int = 1, observer: tuple[str, int] = W
) -> tuple[str, dict[str, Any], tuple[str, int]]:
    """A late answer to ``attempt`` kept as evidence, naming ``observer`` as who dispatched it."""
    data = {
        "attempt": attempt,
        "status": 200,
        "effect": "applied",
        "body_digest": "sha256:00",
        "body_bytes": 2,
        "usage": None,
        "usage_problem": None,
        "cost": 40,
        "observed_by": observer[0],
        "generation": observer[1],
        "reason": "fenced",
    }
    return call("attempt.late_answer", **data)


PATHS: dict[str, tuple[list[Any], str, tuple[int, int, int]]] = {
    "completed": (
        [
            *admit(),
            observed(1, 200),
            call("budget.settled", budget="t/r", reserved=R, actual=70),
            call("call.completed", outcome="completed"),
        ],
        "completed",
        (0, 70, 0),
    ),
    "failed then reconciled not applied (docs/contract.md §12)": (
        [
            *admit(),
            observed(1, 400),
            call("budget.settled", budget="t/r", reserved=R, actual=R),
            call("call.completed", outcome="failed"),
            call("call.reconciled", OP, applied=False, cost=0, note="", by="ann"),
            call("budget.corrected", OP, budget="t/r", settled=R, actual=0),
        ],
        "reconciled_not_applied",
        (0, 0, 0),
    ),
    "not sent, retried, not processed": (
        [
            *admit(),
            call("attempt.not_sent", attempt=1, reason="connect"),
            call("budget.released", budget="t/r", amount=R),
            *admit(2, first=False),
            observed(2, 429, not_processed=True),
            call("budget.released", budget="t/r", amount=R),
            call("call.completed", outcome="not_processed"),
        ],
        "not_processed",
        (0, 0, 0),
    ),
    "interrupted, reconciled applied": (
        [
            *admit(),
            call("attempt.interrupted", attempt=1, reason="t", by="w1"),
            call("budget.held", budget="t/r", amount=R),
            call("call.reconciled", OP, applied=True, cost=40, note="", by="ann"),
            call("budget.unheld", OP, budget="t/r", amount=R, spent=40),
        ],
        "reconciled_applied",
        (0, 40, 0),
    ),
    "interrupted, late answer kept (docs/contract.md §6.1)": (
        [
            *admit(),
            call("attempt.interrupted", attempt=1, reason="t", by="w1"),
            call("budget.held", budget="t/r", amount=R),
            late(),
        ],
        "effect_unknown",
        (0, 0, R),
    ),
    "interrupted, late answer accepted": (
        [
            *admit(),
            call("attempt.interrupted", attempt=1, reason="t", by="w1"),
            call("budget.held", budget="t/r", amount=R),
            late(),
            call("call.reconciled", OP, applied=True, cost=40, note="", by="ann"),
            call("budget.unheld", OP, budget="t/r", amount=R, spent=40),
        ],
        "reconciled_applied",
        (0, 40, 0),
    ),
    "unknown answer, provider resend": (
        [
            *admit(),
            observed(1, 500, effect_unknown=True),
            call("attempt.interrupted", attempt=1, reason="500", by="w1"),
            call("budget.held", budget="t/r", amount=R),
            call("budget.unheld", budget="t/r", amount=R, spent=0),
            *admit(2, first=False),
        ],
        "in_flight",
        (R, 0, 0),
    ),
}


@pytest.mark.parametrize("name", sorted(PATHS))
def test_contract_paths_are_legal_and_project(name: str) -> None:
    """Each path the store writes verifies, with the stage and money the store would keep."""
    rows, stage, (reserved, spent, held) = PATHS[name]
    verifier = Verifier()
    for stored in seal_all(rows):
        verifier.feed(stored)
    fold = verifier.calls["c"]
    budgets = [BudgetRow(p, "total", reserved, spent, held) for p in ("t", "t/r")]
    report = verifier.finish(budgets, [fold.projection()], [tuple(fold.columns().values())])
    assert report.ok, report.problems
    assert fold.projection()["stage"] == stage


@pytest.mark.parametrize("name", sorted(PATHS))
def test_contract_paths_with_two_events_swapped_are_refused(name: str) -> None:
    """The same path with its last two events swapped is named as illegal."""
    rows = list(PATHS[name][0])
    rows[-1], rows[-2] = rows[-2], rows[-1]
    verifier = Verifier()
    for stored in seal_all(rows):
        verifier.feed(stored)
    assert any("illegal transition" in p for p in verifier.report.problems)


def test_rows_compared_in_pages_are_named_after_what_the_events_lack() -> None:
    """verify compares the stored rows a page at a time after the events: a call that
    ends without an event it needs is still named before any row's problem, as the
    report promises (the chain, the events' meaning, then the stored projections)."""
    verifier = Verifier()
    for stored in seal_all([*admit(), observed(1, 200)]):  # no settlement follows
        verifier.feed(stored)
    verifier.end_of_events()
    columns = verifier.calls["c"].columns() | {"provider": "elsewhere"}
    verifier.check_columns([tuple(columns.values())])
    problems = verifier.finish([], [], worker_rows=None).problems
    ends = [i for i, p in enumerate(problems) if "without the" in p]
    rows = [i for i, p in enumerate(problems) if "columns differ" in p]
    assert ends and rows and max(ends) < min(rows), problems


def verify_rows(rows: list[Any]) -> list[str]:
    """The verifier's problems with ``rows``."""
    verifier = Verifier()
    for stored in seal_all(rows):
        verifier.feed(stored)
    return verifier.report.problems


def test_late_answer_in_flight_changes_nothing() -> None:
    """A late answer kept while its call is still in flight (fenced, not yet marked) is
    legal and leaves the call in flight."""
    verifier = Verifier()
    for stored in seal_all([*admit(), late()]):
        verifier.feed(stored)
    assert verifier.report.problems == []
    assert verifier.calls["c"].projection()["stage"] == "in_flight"


def test_late_answer_naming_another_observer_is_named() -> None:
    """A late answer must name the worker and generation that started its attempt."""
    problems = verify_rows([*admit(), late(observer=("w9", 1))])
    assert any("names w9 (generation 1) as its observer" in p for p in problems), problems


def test_late_answer_to_an_attempt_never_started_is_named() -> None:
    """A late answer to an attempt the call never started is named."""
    problems = verify_rows([*admit(), late(attempt=2)])
    assert any("attempt 2, which never started" in p for p in problems), problems
