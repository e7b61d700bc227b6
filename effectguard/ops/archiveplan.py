"""What an archive takes, and the proof and checkpoint it leaves: shared by both ledgers.

An archive cuts the chain in bounded steps (:func:`in_steps`), each its own transaction
with its own ``ledger.archived`` checkpoint: a step reads at most ``size`` events after
the last cut (:data:`STEP_EVENTS` unless the operator says otherwise; more only where
calls overlap across that bound, since a cut never splits a call), and the states of
only the calls in them, so an archive's memory and each transaction's hold on the
ledger's write lock are bounded by the step, not by the ledger (docs/operations.md,
"Retention and archives"). No step reads past the head the archive found when it began.

:func:`plan_archive` reads, in one snapshot of either ledger, the longest prefix of a
step's window that :mod:`effectguard.rules.retention` allows; :func:`prove` folds it
with the independent verifier (a range that does not verify is never archived);
:func:`seal_checkpoint` makes the ``ledger.archived`` event that records it. Where the
events go (a file for SQLite, a table for PostgreSQL) is each ledger's module's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from effectguard.callpath.crash import NO_CRASH, CrashPoints
from effectguard.errors import ConfigError, LedgerCorrupt, LedgerUnavailable
from effectguard.ledger.base import OPERATOR
from effectguard.ledger.rows import EVENT_COLUMNS, event_from_row, state_from_first
from effectguard.ops.audit import Verifier, checkpoint
from effectguard.rules.events import GENESIS_DIGEST, LedgerArchived, StoredEvent, seal
from effectguard.rules.retention import EventRef, closes, cut, holder, stays_live
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
    #: How many steps (transactions, checkpoints) the archive took, and the file each
    #: wrote (SQLite; none on PostgreSQL, whose steps are ``archives`` rows).
    steps: int = 0
    files: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Cut:
    """Where the chain was last cut: its last archived event, that event's digest, and
    the verifier state the archived events leave behind (what the next range starts
    from, without looking up the checkpoint again)."""

    seq: int
    digest: str
    state: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Step:
    """What one step of an archive moved, and where it left the cut."""

    path: str
    first_seq: int
    last_seq: int
    events: int
    calls: int
    keys: int
    checkpoint_seq: int
    cut: Cut


@dataclass(frozen=True, slots=True)
class Bounds:
    """What a step may read: events after ``after`` (the last cut) and at most ``until``
    (the head when the archive began), ``size`` of them unless a call runs past that."""

    after: int
    until: int
    size: int
    before: float
    now: float


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
    #: SQL ``FROM calls``: the seq of the call's last event (SQLite's row names it).
    end_column: str = "(SELECT max(e.seq) FROM events e WHERE e.call_id = calls.call_id)"


#: The layout PostgreSQL keeps (and SQLite kept before its migration 6).
FORMAT_1 = EventLayout(EVENT_COLUMNS, _one_event, lambda value: value)


@dataclass(frozen=True, slots=True)
class Survey:
    """What an archive may take now (``plan`` None: nothing), and what holds the cut."""

    plan: Plan | None
    held: tuple[str, str] | None = None


def bounds_of(fetch: Fetch, *, before: float, now: float, size: int) -> Bounds:
    """An archive's first step: after the last cut (``meta.archived_through``, 0 before
    any), up to the head it finds now."""
    mark = fetch("SELECT value FROM meta WHERE key = 'archived_through'", ())
    head = fetch("SELECT max(seq) FROM events", ())[0][0]
    after = int(mark[0][0]) if mark else 0
    return Bounds(after, after if head is None else int(head), size, before, now)


def run_steps(
    steps: list[Step],
    survey: Callable[[Cut | None], Survey],
    commit: Callable[[Plan], Step],
    say: Callable[[Step], None] | None = None,
    crash: CrashPoints = NO_CRASH,
) -> Survey:
    """Plan and commit steps, each from the cut the one before left, until a plan takes
    nothing; return that last survey (what holds the cut). Each step committed is added
    to ``steps`` and told to ``say``. A step that fails leaves the steps before it
    archived (each is whole on its own): the error says which they are."""
    previous: Cut | None = None
    try:
        while True:
            found = survey(previous)
            if found.plan is None:
                return found
            step = commit(found.plan)
            steps.append(step)
            if say is not None:
                say(step)
            crash.hit("after:archive-step")
            previous = step.cut
    except (ConfigError, LedgerCorrupt, LedgerUnavailable) as exc:
        if not steps:
            raise
        raise type(exc)(f"{exc}{done_before(steps)}") from exc


def done_before(steps: list[Step]) -> str:
    """What an archive that stopped midway had committed before (kept: each step is a
    whole archive of its own), for its error message."""
    if not steps:
        return ""
    files = (
        "" if steps[0].path == steps[-1].path else f", files {steps[0].path} .. {steps[-1].path}"
    )
    done = "the step before it is" if len(steps) == 1 else f"the {len(steps)} steps before it are"
    return f" ({done} archived: events {steps[0].first_seq}..{steps[-1].last_seq}{files})"


def summed(steps: list[Step], survey: Survey, pages: int = 0, free: int = 0) -> ArchiveResult:
    """What an archive's steps moved, as one result (the range from the first step's
    start to the last one's end; the last checkpoint)."""
    if not steps:
        return held(ArchiveResult(None, 0, 0, 0, 0, 0, 0, pages, free), survey)
    last = steps[-1]
    result = ArchiveResult(
        last.path,
        steps[0].first_seq,
        last.last_seq,
        sum(s.events for s in steps),
        sum(s.calls for s in steps),
        sum(s.keys for s in steps),
        last.checkpoint_seq,
        pages,
        free,
        steps=len(steps),
    )
    return held(result, survey)


def plan_archive(
    fetch: Fetch, bounds: Bounds, layout: EventLayout = FORMAT_1, previous: Cut | None = None
) -> Survey:
    """What one step may archive, read through ``fetch`` (SQL with ``%s`` marks) in one
    snapshot: the longest prefix of the window after ``bounds.after`` the rules allow.

    Each row is one reference (a SQLite record's seq is its last event's): a cut, which
    falls after a reference, never splits a row. A call whose row keeps no state (SQLite:
    a resolved call) is judged first by its columns, which cannot say whether its
    provider's idempotency window still holds it; the calls the cut would take are then
    folded from the events read for the archive, and the cut made again (never longer).
    """
    while True:
        survey, grow = _survey(fetch, layout, bounds, previous)
        if not grow:
            return survey
        # Nothing but worker events and checkpoints, or one run of calls still open, up
        # to the window's end: the window must grow for a step to take a call.
        bounds = replace(bounds, size=bounds.size * 2)


def _survey(
    fetch: Fetch, layout: EventLayout, bounds: Bounds, previous: Cut | None
) -> tuple[Survey, bool]:
    """One window's plan, and whether only the window's end stopped it taking a call."""
    refs, ends, states, partial = _window(fetch, layout, bounds)
    if not refs:
        return Survey(None), False
    last, reasons = _cut(refs, ends, states, bounds)
    events = _events(fetch, layout, bounds.after, last)
    taken = partial.intersection(e.call_id for e in events)
    if taken:
        states.update(_folded(events, taken))
        last, reasons = _cut(refs, ends, states, bounds)
        events = [e for e in events if e.seq <= last]
    plan = _take(fetch, events, last, states, previous)
    survey = Survey(plan, holder(refs, reasons, last=last, before=bounds.before))
    stopped = any(
        r.at >= bounds.before or (r.call_id is not None and reasons.get(r.call_id, "") is not None)
        for r in refs
        if r.seq > last
    )
    return survey, plan is None and not stopped and bounds.after + bounds.size < bounds.until


_Window = tuple[list[EventRef], dict[str, int], dict[str, WorkState], set[str]]


def _window(fetch: Fetch, layout: EventLayout, bounds: Bounds) -> _Window:
    """The step's events (as references), and the last event, state and whether the row
    kept that state whole of each call in them: ``bounds.size`` events, or as many more
    as it takes for a run of overlapping calls to end inside them."""
    limit = min(bounds.after + bounds.size, bounds.until)
    while True:
        refs = [
            EventRef(int(s), layout.call(c), float(a))
            for s, c, a in fetch(
                "SELECT seq, call_id, at FROM events WHERE seq > %s AND seq <= %s ORDER BY seq",
                (bounds.after, limit),
            )
        ]
        ends: dict[str, int] = {}
        states: dict[str, WorkState] = {}
        partial: set[str] = set()
        for row in fetch(
            f"SELECT {layout.end_column}, {layout.state_columns} FROM calls WHERE call_id IN "
            "(SELECT call_id FROM events WHERE seq > %s AND seq <= %s AND call_id IS NOT NULL)",
            (bounds.after, limit),
        ):
            state, whole = layout.state(row[1:])
            states[state.call_id] = state
            if row[0] is not None:  # else the window's own last event of the call
                ends[state.call_id] = int(row[0])
            if not whole:
                partial.add(state.call_id)
        if limit >= bounds.until or not refs or closes(refs, ends):
            return refs, ends, states, partial
        limit = min(max(ends.values()), bounds.until)


def _cut(
    refs: list[EventRef], ends: dict[str, int], states: dict[str, WorkState], bounds: Bounds
) -> tuple[int, dict[str, str | None]]:
    """The cut the retention rules allow, and why each call stays live (None: it may go)."""
    # Each call's last event: retention counts from the call's resolution, not its admission.
    last_at = {ref.call_id: ref.at for ref in refs if ref.call_id is not None}
    reasons = {
        call_id: (
            "it went on after this archive began"
            if ends.get(call_id, 0) > bounds.until
            else stays_live(
                state,
                resolved_at=last_at.get(call_id, math.inf),  # no event: corrupt, it stays
                before=bounds.before,
                now=bounds.now,
            )
        )
        for call_id, state in states.items()
    }
    archivable = {call: reason is None for call, reason in reasons.items()}
    return cut(refs, archivable, before=bounds.before, ends=ends), reasons


def _events(fetch: Fetch, layout: EventLayout, after: int, last: int) -> list[StoredEvent]:
    if last <= after:
        return []
    rows = fetch(
        f"SELECT {layout.columns} FROM events e WHERE e.seq > %s AND e.seq <= %s ORDER BY e.seq",
        (after, last),
    )
    return [e for row in rows for e in layout.decode(row)]


def _folded(events: list[StoredEvent], calls: set[str]) -> dict[str, WorkState]:
    """The states of ``calls`` (each whole in ``events``: a cut never splits a call)."""
    found: dict[str, list[StoredEvent]] = {call: [] for call in calls}
    for e in events:
        if e.call_id in found:
            found[e.call_id].append(e)
    return {call: work_state(e.event for e in mine) for call, mine in found.items()}


def _take(
    fetch: Fetch,
    events: list[StoredEvent],
    last: int,
    states: dict[str, WorkState],
    previous: Cut | None,
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
    start_state: dict[str, Any] | None
    if previous is not None and previous.seq == first - 1:
        start_state, prev_digest = previous.state, previous.digest
    else:
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
    lines_sha256: str,
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
        archive_sha256=lines_sha256,
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
