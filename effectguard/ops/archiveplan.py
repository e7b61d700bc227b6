"""What an archive takes, and the proof and checkpoint it leaves: shared by both ledgers.

:func:`plan_archive` reads, in one snapshot of either ledger, the longest prefix of the
live chain that :mod:`effectguard.rules.retention` allows; :func:`prove` folds it with
the independent verifier (a range that does not verify is never archived);
:func:`seal_checkpoint` makes the ``ledger.archived`` event that records it. Where the
events go (a file for SQLite, a table for PostgreSQL) is each ledger's module's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from effectguard.errors import LedgerCorrupt
from effectguard.ledger.base import OPERATOR
from effectguard.ledger.rows import EVENT_COLUMNS, event_from_row, state_from_first
from effectguard.ops import archivefile
from effectguard.ops.audit import Verifier, checkpoint
from effectguard.rules.events import GENESIS_DIGEST, LedgerArchived, StoredEvent, seal
from effectguard.rules.retention import EventRef, cut, holder, stays_live
from effectguard.rules.workstate import WorkState, work_state


@dataclass(frozen=True, slots=True)
class ArchiveResult:
    """What an archive moved (``events`` 0: nothing could be archived yet)."""

    path: str | None
    first_seq: int
    last_seq: int
    events: int
    calls: int
    keys: int
    checkpoint_seq: int
    page_count: int
    freelist_count: int
    #: The call that stops the cut (before the cut-off), and why it stays live.
    held_by: str | None = None
    held_because: str | None = None


@dataclass
class Plan:
    first: int
    last: int
    prev_digest: str
    start_state: dict[str, Any] | None
    events: list[StoredEvent]
    calls: dict[str, tuple[str | None, str, str]]  # call id -> key, root, request hash

    def keyed(self) -> list[tuple[str, str, str, str]]:
        """``archived_keys`` rows: (root, key, call id, request hash) of keyed calls."""
        return [(r, k, c, h) for c, (k, r, h) in self.calls.items() if k is not None]


Fetch = Callable[[str, Sequence[Any]], list[Any]]


def _one_event(row: Any) -> list[StoredEvent]:
    return [event_from_row(row)]


def _whole_state(row: Any) -> tuple[WorkState, bool]:
    return state_from_first(row), True


@dataclass(frozen=True, slots=True)
class EventLayout:
    """How a ledger's events table holds events: the columns to select ``FROM events e``,
    how to read such a row (its events: a SQLite row may hold an operation's run of
    them), and how to read the ``call_id`` column alone."""

    columns: str
    decode: Callable[[Any], list[StoredEvent]]
    call: Callable[[Any], str | None]
    #: What to select ``FROM calls`` to read a call state, and how to read that row: its
    #: state, and whether the row kept it whole (False: a state of the row's columns,
    #: without the call's money or provider idempotency window).
    state_columns: str = "state"
    state: Callable[[Any], tuple[WorkState, bool]] = _whole_state


#: The layout PostgreSQL keeps (and SQLite kept before its migration 6).
FORMAT_1 = EventLayout(EVENT_COLUMNS, _one_event, lambda value: value)


@dataclass(frozen=True, slots=True)
class Survey:
    """What an archive may take now (``plan`` None: nothing), and what holds the cut."""

    plan: Plan | None
    held: tuple[str, str] | None = None


def plan_archive(fetch: Fetch, before: float, now: float, layout: EventLayout = FORMAT_1) -> Survey:
    """What may be archived, read through ``fetch`` (SQL with ``%s`` marks) in one snapshot.

    Each row is one reference (a SQLite record's seq is its last event's): a cut, which
    falls after a reference, never splits a row. A call whose row keeps no state (SQLite:
    a resolved call) is judged first by its columns, which cannot say whether its
    provider's idempotency window still holds it; the calls the cut would take are then
    folded from the events read for the archive, and the cut made again (never longer).
    """
    refs = [
        EventRef(int(s), layout.call(c), float(a))
        for s, c, a in fetch("SELECT seq, call_id, at FROM events ORDER BY seq", ())
    ]
    if not refs:
        return Survey(None)
    states: dict[str, WorkState] = {}
    partial: set[str] = set()
    for row in fetch(f"SELECT {layout.state_columns} FROM calls", ()):
        state, whole = layout.state(row)
        states[state.call_id] = state
        if not whole:
            partial.add(state.call_id)
    last, reasons = _cut(refs, states, before, now)
    events = _events(fetch, layout, refs[0].seq, last)
    taken = partial.intersection(e.call_id for e in events)
    if taken:
        states.update(_folded(events, taken))
        last, reasons = _cut(refs, states, before, now)
        events = [e for e in events if e.seq <= last]
    plan = _take(fetch, events, last, states)
    return Survey(plan, holder(refs, reasons, last=last, before=before))


def _cut(
    refs: list[EventRef], states: dict[str, WorkState], before: float, now: float
) -> tuple[int, dict[str, str | None]]:
    """The cut the retention rules allow, and why each call stays live (None: it may go)."""
    # Each call's last event: retention counts from the call's resolution, not its admission.
    last_at = {ref.call_id: ref.at for ref in refs if ref.call_id is not None}
    reasons = {
        call_id: stays_live(
            state,
            resolved_at=last_at.get(call_id, math.inf),  # no event: corrupt, it stays
            before=before,
            now=now,
        )
        for call_id, state in states.items()
    }
    archivable = {call: reason is None for call, reason in reasons.items()}
    return cut(refs, archivable, before=before), reasons


def _events(fetch: Fetch, layout: EventLayout, first_row: int, last: int) -> list[StoredEvent]:
    if last < first_row:
        return []
    rows = fetch(f"SELECT {layout.columns} FROM events e WHERE e.seq <= %s ORDER BY e.seq", (last,))
    return [e for row in rows for e in layout.decode(row)]


def _folded(events: list[StoredEvent], calls: set[str]) -> dict[str, WorkState]:
    """The states of ``calls`` (each whole in ``events``: a cut never splits a call)."""
    found: dict[str, list[StoredEvent]] = {call: [] for call in calls}
    for e in events:
        if e.call_id in found:
            found[e.call_id].append(e)
    return {call: work_state(e.event for e in mine) for call, mine in found.items()}


def _take(
    fetch: Fetch, events: list[StoredEvent], last: int, states: dict[str, WorkState]
) -> Plan | None:
    calls = {}
    for e in events:
        if e.call_id is not None and e.call_id not in calls:
            state = states[e.call_id]
            # A refused call's key is free under the contract (docs/contract.md §4): the
            # archive keeps none for it, or the key would answer 409 archived (and two
            # refused calls under one key would collide in archived_keys).
            key = None if state.stage == "refused" else state.idempotency_key
            calls[e.call_id] = (key, state.budget_root, state.request_hash)
    if not calls:
        return None  # only checkpoints and worker events: not worth a file of its own
    first = events[0].seq
    start_state, prev_digest = _previous(fetch, first)
    return Plan(first, last, prev_digest, start_state, events, calls)


def held(result: ArchiveResult, survey: Survey) -> ArchiveResult:
    """``result`` naming the call that holds the cut, if one does."""
    if survey.held is None:
        return result
    return replace(result, held_by=survey.held[0], held_because=survey.held[1])


def _previous(fetch: Fetch, first: int) -> tuple[dict[str, Any] | None, str]:
    """The state and digest the checkpoint of the previous cut left (none at event 1)."""
    if first == 1:
        return None, GENESIS_DIGEST
    # The live ledger holds few checkpoints (the last cut's, usually): read them all.
    for (text,) in fetch(
        "SELECT data FROM events WHERE kind = %s ORDER BY seq DESC", (checkpoint.KIND,)
    ):
        data = json.loads(text)
        if data.get("last_seq") == first - 1:
            return data["state"], str(data["last_digest"])
    raise LedgerCorrupt(f"events before {first} are gone and no checkpoint covers them")


def prove(plan: Plan) -> dict[str, Any]:
    """The range, folded by the independent verifier; refuses a range that does not verify."""
    verifier = Verifier()
    if plan.start_state is not None:
        checkpoint.seed(
            verifier, plan.start_state, next_seq=plan.first, prev_digest=plan.prev_digest
        )
    for stored in plan.events:
        verifier.feed(stored)
    unfinished = [c for c, fold in verifier.calls.items() if fold.unfinished is not None]
    problems = verifier.report.problems + [f"call {c} is not whole" for c in unfinished]
    if problems:
        raise LedgerCorrupt(f"refusing to archive events that do not verify: {problems[:3]}")
    return checkpoint.export_state(verifier)


def seal_checkpoint(
    plan: Plan,
    state: dict[str, Any],
    archive: str,
    lines: list[str],
    head: tuple[int, str],
    at: float,
) -> tuple[StoredEvent, str]:
    """The ``ledger.archived`` event for ``plan``, sealed as the event after ``head``."""
    mark = LedgerArchived(
        first_seq=plan.first,
        last_seq=plan.last,
        prev_digest=plan.prev_digest,
        last_digest=plan.events[-1].digest,
        events=len(plan.events),
        calls=len(plan.calls),
        keys=len(plan.keyed()),
        archive=archive,
        archive_sha256=archivefile.lines_sha256(lines),
        state=state,
    )
    return seal(
        mark,
        seq=head[0] + 1,
        worker=OPERATOR.worker,
        generation=OPERATOR.generation,
        at=at,
        prev_digest=head[1],
    )
