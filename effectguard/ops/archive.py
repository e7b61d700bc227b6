"""``effectguard archive``: move final calls' events out of a live SQLite ledger.

(A PostgreSQL ledger archives into its own ``archived_events`` table with the same plan,
proof and checkpoint: :mod:`effectguard.ops.pgarchive`.)

An archive takes the longest prefix of the live chain that :mod:`effectguard.rules.retention`
allows (every call in it final, resolved before the cut-off, past its provider's
idempotency window, and whole), and in one transaction:

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
written to ``.FILE.partial`` before the write lock is taken; under it, only the
checkpoint line is appended and fsync'd, then the transaction commits and the file is
renamed into place: a crash in between leaves a complete ``.partial`` file. Deleted
pages go to SQLite's freelist and are reused by new events, so the file stops growing
once archives keep pace.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from effectguard.errors import ConfigError, LedgerCorrupt
from effectguard.ledger import sqlitecalls, sqliteevents, sqliterecords
from effectguard.ledger.sqlite import sqlite_path
from effectguard.ledger.sqlitefile import check_ledger_file
from effectguard.ledger.sqliteschema import connect, migrate
from effectguard.ops import archivefile
from effectguard.ops.archiveplan import (
    ArchiveResult,
    EventLayout,
    Plan,
    Survey,
    held,
    plan_archive,
    prove,
    seal_checkpoint,
)
from effectguard.ops.outpath import create_private, new_file, partial_of
from effectguard.rules.events import StoredEvent
from effectguard.rules.guidance import show_command


def archive_sqlite(ledger: str, *, before: float, out: Path | None = None) -> ArchiveResult:
    """Archive what the retention rules allow of the SQLite ledger at ``ledger``."""
    path = Path(sqlite_path(ledger))
    check_ledger_file(str(path))  # before connect(), which would make any file a ledger
    if out is not None:  # checked up front, even when there turns out to be nothing to move
        new_file(out, ledger=path, command="archive", what="an archive")
    conn = connect(str(path))
    try:
        migrate(conn)
        survey = _plan(conn, before, time.time())
        plan = survey.plan
        if plan is None:
            return held(_result(conn, None, 0, 0, 0, 0, 0, 0), survey)
        target = out or path.with_name(f"{path.stem}-archive-{plan.first}-{plan.last}.jsonl.gz")
        new_file(target, ledger=path, command="archive", what="an archive")
        _refuse_stale_partial(target, path)
        return held(_commit(conn, plan, target), survey)
    finally:
        conn.close()


#: SQLite's events since migration 6 (ledger/sqliteevents.py, records since format 4:
#: ledger/sqliterecords.py), and its call states.
_FORMAT_2 = EventLayout(
    sqliteevents.SELECT_COLUMNS,
    sqliterecords.events_from_row,
    sqliteevents.call_from_key,
    sqlitecalls.CALL_READ,
    sqlitecalls.row_state,
)


def _plan(conn: sqlite3.Connection, before: float, now: float) -> Survey:
    conn.execute("BEGIN")  # one read snapshot; writers go on
    try:

        def fetch(sql: str, params: Sequence[Any]) -> list[Any]:
            return list(conn.execute(sql.replace("%s", "?"), params))

        return plan_archive(fetch, before, now, _FORMAT_2)
    finally:
        conn.execute("COMMIT")


def _commit(conn: sqlite3.Connection, plan: Plan, target: Path) -> ArchiveResult:
    state = prove(plan)
    lines = [archivefile.event_line(e) for e in plan.events]
    keyed = plan.keyed()
    header = {
        "first_seq": plan.first,
        "last_seq": plan.last,
        "prev_digest": plan.prev_digest,
        "start_state": plan.start_state,
        "keys": sorted(list(k) for k in keyed),
    }
    partial = partial_of(target)
    # Owner-only like the ledger whose events and bodies it holds: gzip.open would
    # create it with the umask's permissions, readable by anyone.
    create_private(partial)
    try:
        # Before the write lock; bodies never change once written, so they need none.
        archivefile.write_events(partial, header, lines, _bodies(conn, plan))
        conn.execute("BEGIN IMMEDIATE")
        _refuse_if_moved(conn, plan)
        head_seq, head_digest = conn.execute(
            "SELECT seq, digest FROM events ORDER BY seq DESC LIMIT 1"
        ).fetchone()
        head = (int(head_seq), sqliteevents.hex_digest(head_digest))
        stored, _ = seal_checkpoint(plan, state, target.name, lines, head, time.time())
        archivefile.append_checkpoint(partial, stored)
        _apply(conn, stored, plan, keyed)
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, target)
    _fsync_dir(target.parent)
    counts = (len(plan.events), len(plan.calls), len(keyed))
    return _result(conn, str(target), plan.first, plan.last, *counts, stored.seq)


def _refuse_stale_partial(target: Path, ledger: Path) -> None:
    """An archive that stopped after its commit and before its rename left the only copy
    of the events it moved in ``.FILE.partial``: it must never be overwritten or removed."""
    partial = partial_of(target)
    if os.path.lexists(partial):
        raise ConfigError(
            f"{partial} exists: an earlier archive to {target.name} stopped before renaming "
            f"it into place. Run `effectguard verify --archive {partial} --ledger {ledger}`: "
            f"if it passes, the file holds archived events: rename it to {target}; if not, "
            "delete it. Then run archive again"
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


def _result(
    conn: sqlite3.Connection,
    path: str | None,
    first: int,
    last: int,
    events: int,
    calls: int,
    keys: int,
    checkpoint_seq: int,
) -> ArchiveResult:
    pages = int(conn.execute("PRAGMA page_count").fetchone()[0])
    free = int(conn.execute("PRAGMA freelist_count").fetchone()[0])
    return ArchiveResult(path, first, last, events, calls, keys, checkpoint_seq, pages, free)


def cmd_archive(args: argparse.Namespace) -> int:
    """``effectguard archive [--before DATE] [--ledger L] [--out FILE] [--json]``."""
    ledger: str = args.ledger
    if ledger.startswith("memory://"):
        raise ConfigError("a memory ledger has nothing to archive")
    before = _before(args)
    if ledger.startswith(("postgresql://", "postgres://")):
        if args.out:
            raise ConfigError("a PostgreSQL ledger archives into its archived_events table")
        from effectguard.ops.pgarchive import archive_postgres

        result = archive_postgres(ledger, before=before)
    else:
        out = None if args.out is None else Path(args.out)
        result = archive_sqlite(ledger, before=before, out=out)
    if args.json:
        print(json.dumps(asdict(result), indent=2))
    elif result.events == 0:
        print("archive: nothing to archive yet (see the retention rules)")
    else:
        print(
            f"archive {result.path}: events {result.first_seq}..{result.last_seq} "
            f"({result.events} events, {result.calls} calls, {result.keys} keys kept); "
            f"checkpoint event {result.checkpoint_seq}"
        )
    if result.held_by is not None and not args.json:
        # The archive is a prefix of the chain: this call holds back every call after it.
        print(
            f"archive: the cut stops at call {result.held_by} ({result.held_because}); "
            f"resolve it to archive the calls after it (`{show_command(result.held_by)}`)"
        )
    return 0


def _before(args: argparse.Namespace) -> float:
    from effectguard.config.settings import config_retention
    from effectguard.ops.timeargs import since

    now = time.time()
    if args.before is not None:
        try:
            return since(args.before, now)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
    cutoff = config_retention(Path(args.config) if args.config else None).cutoff(now)
    if cutoff is None:
        raise ConfigError("give --before DATE, or [retention] keep_bodies_days in --config")
    return cutoff
