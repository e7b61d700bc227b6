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
from effectguard.rules.workstate import WorkState


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


@dataclass(frozen=True, slots=True)
class EventLayout:
    """How a ledger's events table holds events: the columns to select ``FROM events e``,
    how to read such a row (its events: a SQLite row may hold an operation's run of
    them), and how to read the ``call_id`` column alone."""

    columns: str
    decode: Callable[[Any], list[StoredEvent]]
    call: Callable[[Any], str | None]
    #: What to select ``FROM calls`` to read a call state, and how to read that row.
    state_columns: str = "state"
    state: Callable[[Any], WorkState] = state_from_first


def _one_event(row: Any) -> list[StoredEvent]:
    return [event_from_row(row)]


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
    falls after a reference, never splits a row."""
    refs = [
        EventRef(int(s), layout.call(c), float(a))
        for s, c, a in fetch("SELECT seq, call_id, at FROM events ORDER BY seq", ())
    ]
    if not refs:
        return Survey(None)
    # Each call's last event: retention counts from the call's resolution, not its admission.
    last_at = {ref.call_id: ref.at for ref in refs if ref.call_id is not None}
    reasons: dict[str, str | None] = {}
    keys: dict[str, tuple[str | None, str, str]] = {}
    for row in fetch(f"SELECT {layout.state_columns} FROM calls", ()):
        state = layout.state(row)
        resolved_at = last_at.get(state.call_id, math.inf)  # no event: corrupt, it stays
        reasons[state.call_id] = stays_live(state, resolved_at=resolved_at, before=before, now=now)
        # A refused call's key is free under the contract (docs/contract.md §4): the archive
        # keeps none for it, or the key would answer 409 archived (and two refused calls
        # under one key would collide in archived_keys).
        key = None if state.stage == "refused" else state.idempotency_key
        keys[state.call_id] = (key, state.budget_root, state.request_hash)
    archivable = {call: reason is None for call, reason in reasons.items()}
    last = cut(refs, archivable, before=before)
    held = holder(refs, reasons, last=last, before=before)
    plan = _take(fetch, layout, refs[0].seq, last, keys)
    return Survey(plan, held)


def _take(
    fetch: Fetch,
    layout: EventLayout,
    first_row: int,
    last: int,
    keys: dict[str, tuple[str | None, str, str]],
) -> Plan | None:
    if last < first_row:
        return None
    rows = fetch(f"SELECT {layout.columns} FROM events e WHERE e.seq <= %s ORDER BY e.seq", (last,))
    events = [e for row in rows for e in layout.decode(row)]
    first = events[0].seq
    start_state, prev_digest = _previous(fetch, first)
    calls = {e.call_id: keys[e.call_id] for e in events if e.call_id is not None}
    if not calls:
        return None  # only checkpoints and worker events: not worth a file of its own
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
