"""``effectguard archive``: move final calls' events out of a live SQLite ledger.

(A PostgreSQL ledger archives into its own ``archived_events`` table with the same plan,
proof and checkpoint: :mod:`effectguard.ops.pgarchive`.)

An archive takes the longest prefix of the live chain that :mod:`effectguard.rules.retention`
allows (every call in it final, resolved before the cut-off, past its provider's
idempotency window, and whole), in steps of at most ``size`` events
(:mod:`effectguard.ops.archiveplan`); each step writes its own file and, in one
transaction of its own:

1. appends a ``ledger.archived`` checkpoint (the range, its last digest, counts, the
   archive file's digest, and the verifier state the range leaves behind);
2. keeps each archived call's idempotency key in ``archived_keys`` (a resend answers
   409 ``archived``);
3. raises ``meta.archived_through`` to the range's end (a trigger lets it move only
   forward, and only to what the newest event, the checkpoint, names), which is the one
   condition under which the events trigger allows a DELETE;
4. deletes the range's events, its calls' rows and their bodies stored by reference
   (which the archive file holds, after the events).

The range is first proved by the independent verifier, seeded with the previous
checkpoint's state: a range that does not verify is never archived. The events are
streamed to ``.FILE.partial`` before the write lock is taken; under it, only the
checkpoint line is appended and fsync'd, then the transaction commits and the file is
renamed into place: a crash in between leaves a complete ``.partial`` file, which the
next archive finds (:mod:`effectguard.ops.archivenames`) and refuses to run past. A
crash between steps leaves the steps done archived and verified, and the next archive
goes on from their cut. Deleted pages go to SQLite's freelist and are reused by new
events, so the file stops growing once archives keep pace.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from effectguard.callpath.crash import NO_CRASH, CrashPoints
from effectguard.errors import ConfigError, LedgerCorrupt, LedgerUnavailable
from effectguard.ledger import sqlitecalls, sqliteevents, sqliterecords
from effectguard.ledger.sqlite import sqlite_path
from effectguard.ledger.sqliteconnect import connect
from effectguard.ledger.sqlitefile import check_ledger_file
from effectguard.ledger.sqliteschema import migrate
from effectguard.ops import archivefile, archivenames
from effectguard.ops.archiveplan import (
    ArchiveResult,
    Bounds,
    Cut,
    EventLayout,
    Plan,
    Step,
    Survey,
    bounds_of,
    plan_archive,
    prove,
    run_steps,
    seal_checkpoint,
    summed,
)
from effectguard.ops.outpath import Held, hold_new, new_file, partial_of
from effectguard.rules.events import StoredEvent
from effectguard.rules.retention import STEP_EVENTS


def archive_sqlite(
    ledger: str,
    *,
    before: float,
    out: Path | None = None,
    size: int = STEP_EVENTS,
    say: Callable[[Step], None] | None = None,
    crash: CrashPoints = NO_CRASH,
) -> ArchiveResult:
    """Archive what the retention rules allow of the SQLite ledger at ``ledger``, in steps
    of at most ``size`` events, each its own file and transaction (``say`` hears of each
    as it commits)."""
    path = Path(sqlite_path(ledger))
    check_ledger_file(str(path))  # before connect(), which would make any file a ledger
    if out is not None:  # checked up front, even when there turns out to be nothing to move
        new_file(out, ledger=path, command="archive", what="an archive")
    names = archivenames.Names(path, out)
    names.refuse_stale_partials()
    with _translated(path):
        conn = connect(str(path))
    try:
        with _translated(path):
            migrate(conn)
        steps: list[Step] = []
        bounds: list[Bounds] = []

        def planned(previous: Cut | None) -> Survey:
            with _translated(path):
                return _plan(conn, bounds, before, size, previous)

        def commit(plan: Plan) -> Step:
            target = names.target(plan.first, plan.last, len(steps))
            new_file(target, ledger=path, command="archive", what="an archive")
            _refuse_stale_partial(target, path)
            with _translated(path, target):
                return _commit(conn, plan, target, crash)

        survey = run_steps(steps, planned, commit, say, crash)
        with _translated(path):
            return _result(conn, steps, survey)
    finally:
        conn.close()


@contextlib.contextmanager
def _translated(ledger: Path, target: Path | None = None) -> Iterator[None]:
    """The driver's and the file system's errors as effectguard's (a busy or full ledger,
    a full disk under the archive file), so that an archive stopped by one says which
    steps it archived before (``run_steps``) instead of ending in a traceback."""
    try:
        yield
    except sqlite3.Error as exc:
        raise LedgerUnavailable(f"archive of {ledger} failed: {exc}") from exc
    except OSError as exc:
        where = f" writing {target}" if target is not None else ""
        raise ConfigError(f"archive of {ledger} failed{where}: {exc}") from exc


#: SQLite's events since migration 6 (ledger/sqliteevents.py, records since format 4:
#: ledger/sqliterecords.py), and its call states; a call's row names its last event.
_FORMAT_2 = EventLayout(
    sqliteevents.SELECT_COLUMNS,
    sqliterecords.events_from_row,
    sqliteevents.call_from_key,
    sqlitecalls.CALL_READ,
    sqlitecalls.row_state,
    "last_seq",
)


def _plan(
    conn: sqlite3.Connection, bounds: list[Bounds], before: float, size: int, previous: Cut | None
) -> Survey:
    """One step's plan, in one read snapshot (writers go on); the first step also fixes
    the bounds every step keeps to (``bounds``: empty until then)."""
    conn.execute("BEGIN")
    try:

        def fetch(sql: str, params: Sequence[Any]) -> list[Any]:
            return list(conn.execute(sql.replace("%s", "?"), params))

        now = time.time()
        if not bounds:
            bounds.append(bounds_of(fetch, before=before, now=now, size=size))
        step = bounds[0]
        if previous is not None:
            step = replace(step, after=previous.seq, now=now)
        return plan_archive(fetch, step, _FORMAT_2, previous)
    finally:
        conn.execute("COMMIT")


def _commit(conn: sqlite3.Connection, plan: Plan, target: Path, crash: CrashPoints) -> Step:
    state = prove(plan)
    keyed = plan.keyed()
    header = {
        "first_seq": plan.first,
        "last_seq": plan.last,
        "prev_digest": plan.prev_digest,
        "start_state": plan.start_state,
        "keys": sorted(list(k) for k in keyed),
    }
    partial = partial_of(target)
    # Owner-only like the ledger whose events and bodies it holds, and held (a lock) while
    # this step writes it: a second archive sees it is not left over (archivenames).
    held = hold_new(partial, busy=archivenames.running(partial))
    try:
        # Before the write lock; bodies never change once written, so they need none.
        lines = (archivefile.event_line(e) for e in plan.events)
        digest = archivefile.write_events(held.file, header, lines, _bodies(conn, plan))
        conn.execute("BEGIN IMMEDIATE")
        _refuse_if_moved(conn, plan)
        head_seq, head_digest = conn.execute(
            "SELECT seq, digest FROM events ORDER BY seq DESC LIMIT 1"
        ).fetchone()
        head = (int(head_seq), sqliteevents.hex_digest(head_digest))
        stored, _ = seal_checkpoint(plan, state, target.name, digest, head, time.time())
        archivefile.append_checkpoint(held.file, stored)
        _refuse_if_gone(held)
        _apply(conn, stored, plan, keyed)
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        if held.in_place():  # never a file that someone else put under that name
            partial.unlink(missing_ok=True)
        held.close()
        raise
    try:
        crash.hit("after:archive-commit")
        os.replace(partial, target)
    finally:
        held.close()
    _fsync_dir(target.parent)
    cut = Cut(plan.last, plan.events[-1].digest, state)
    counts = (len(plan.events), len(plan.calls), len(keyed))
    return Step(str(target), plan.first, plan.last, *counts, stored.seq, cut)


def _refuse_stale_partial(target: Path, ledger: Path) -> None:
    """An archive that stopped after its commit and before its rename left the only copy
    of the events it moved in ``.FILE.partial``: it must never be overwritten or removed."""
    partial = partial_of(target)
    if os.path.lexists(partial):
        raise ConfigError(archivenames.left_or_running(partial, target, ledger))


def _refuse_if_gone(held: Held) -> None:
    """The events are in the file this step wrote and holds open; the ledger may let them
    go only while that file is still where the rename after the commit expects it."""
    if not held.in_place():
        raise ConfigError(
            f"{held.path} was removed or replaced while this archive wrote it: this step "
            "archived nothing (its events stay in the ledger); run archive again"
        )


def _bodies(conn: sqlite3.Connection, plan: Plan) -> Iterator[tuple[str, int, bytes]]:
    """The archived calls' bodies stored by reference, one chunk (one row) at a time."""
    for call_id in plan.calls:
        rows = conn.execute(
            "SELECT seq, chunk FROM call_bodies WHERE call_id = ? ORDER BY seq",
            (sqliteevents.call_key(call_id),),
        )
        for seq, chunk in rows:
            yield call_id, int(seq), bytes(chunk)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _refuse_if_moved(conn: sqlite3.Connection, plan: Plan) -> None:
    # Archived calls are final, yet a failed call can still be reconciled: if any event
    # of an archived call came after the plan, the plan is stale.
    ids = [sqliteevents.call_key(c) for c in plan.calls]  # as the calls table keys them
    for i in range(0, len(ids), 500):
        chunk = ids[i : i + 500]
        marks = ",".join("?" * len(chunk))
        # A call's row names its last event (sqliteevents), so no scan of later events.
        moved = conn.execute(
            f"SELECT call_id FROM calls WHERE last_seq > ? AND call_id IN ({marks}) LIMIT 1",
            (plan.last, *chunk),
        ).fetchone()
        if moved is not None:
            call_id = sqliteevents.call_from_key(moved[0])
            raise LedgerCorrupt(f"call {call_id} changed while archiving; run archive again")
    first = conn.execute(
        f"SELECT {sqliteevents.first_seq('e')} FROM events e ORDER BY seq LIMIT 1"
    ).fetchone()
    if first is None or first[0] != plan.first:
        raise LedgerCorrupt("another archive ran meanwhile; run archive again")


def _apply(
    conn: sqlite3.Connection,
    stored: StoredEvent,
    plan: Plan,
    keyed: list[tuple[str, str, str, str]],
) -> None:
    conn.execute(
        f"INSERT INTO events({sqliteevents.INSERT_COLUMNS}) VALUES ({sqliteevents.INSERT_MARKS})",
        sqliteevents.event_params(stored),
    )
    # The event after the cut links to one this deletes: keep that link where reads find it.
    conn.execute(
        "INSERT OR REPLACE INTO chain_cuts(seq, prev_digest) VALUES (?, ?)",
        (plan.last + 1, sqliteevents.digest_column(plan.events[-1].digest)),
    )
    conn.executemany(
        "INSERT INTO archived_keys(budget_root, idempotency_key, call_id, request_hash) "
        "VALUES (?, ?, ?, ?)",
        keyed,
    )
    conn.execute("UPDATE meta SET value = ? WHERE key = 'archived_through'", (plan.last,))
    conn.execute("DELETE FROM events WHERE seq <= ?", (plan.last,))
    keys = [(sqliteevents.call_key(c),) for c in plan.calls]  # calls and bodies alike
    conn.executemany("DELETE FROM calls WHERE call_id = ?", keys)
    # Their bodies are in the archive file now (written before this transaction).
    conn.executemany("DELETE FROM call_bodies WHERE call_id = ?", keys)


def _result(conn: sqlite3.Connection, steps: list[Step], survey: Survey) -> ArchiveResult:
    pages = int(conn.execute("PRAGMA page_count").fetchone()[0])
    free = int(conn.execute("PRAGMA freelist_count").fetchone()[0])
    result = summed(steps, survey, pages, free)
    return replace(result, files=[s.path for s in steps])
