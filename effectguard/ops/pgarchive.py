"""``effectguard archive`` on a PostgreSQL ledger: into the ``archived_events`` table.

The plan, the rules (:mod:`effectguard.rules.retention`), the proof by the independent
verifier and the ``ledger.archived`` checkpoint are the SQLite archive's
(:mod:`effectguard.ops.archiveplan`). Where SQLite writes a gzip'd file next to the ledger,
PostgreSQL keeps the archive in the database, each step
(:func:`effectguard.ops.archiveplan.run_steps`) in one transaction with its cut:

* ``archived_events``: the range's rows exactly as they were (append-only, as ``events``);
* ``archived_bodies``: its calls' request bodies stored by reference, chunk by chunk, as
  they were in ``call_bodies`` (append-only too);
* ``archives``: one row per step's range with what an archive file's header and last
  line hold (the range, the digest before it, the verifier state before it, the
  checkpoint).

Why a table and not a file: replicas run on many hosts and ``effectguard archive`` on
any of them, so a file would live on whichever host ran it, outside the database's
backups (``pg_dump``, point-in-time recovery), and its checkpoint would name a file no
replica can read. In the database the archive is backed up with the ledger, is written
in the same transaction as the cut (no ``.partial`` file to clean up after a crash), and
``verify --archived`` proves it from any host. The live ``events`` table (what replicas
and ``verify`` scan) stays small; the archive table can go to a cheaper tablespace.

Concurrency: in each step, the copy into ``archived_events`` runs first (events never change, so no
lock is needed to copy them), then the transaction takes the batch lock every replica's
writer takes (:mod:`effectguard.ledger.postgres`): while it holds it no replica writes,
so the checkpoint is the chain's next event and no archived call changes under it. A
second archive running at once fails on ``archived_events``' primary key and is told
to run again.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from effectguard.callpath.crash import NO_CRASH, CrashPoints
from effectguard.errors import LedgerCorrupt, LedgerUnavailable
from effectguard.ledger.pgdriver import psycopg
from effectguard.ledger.pgschema import (
    CLOCK_FUNCTION,
    IDLE_IN_TRANSACTION_MS,
    Target,
    check_ledger_schema,
    lock_key,
    migrate_on,
)
from effectguard.ledger.rows import EVENT_COLUMNS, event_from_row
from effectguard.ops import archivefile
from effectguard.ops.archiveplan import (
    ArchiveResult,
    Bounds,
    Cut,
    Plan,
    Step,
    Survey,
    bounds_of,
    done_before,
    plan_archive,
    prove,
    run_steps,
    seal_checkpoint,
    summed,
)
from effectguard.ops.audit import BodyRow, VerifyReport
from effectguard.ops.audit.archived import verify_range
from effectguard.rules.events import StoredEvent, canonical_json
from effectguard.rules.retention import STEP_EVENTS

#: What the checkpoint names as its archive.
TABLE = "archived_events"


def archive_postgres(
    url: str,
    *,
    before: float,
    size: int = STEP_EVENTS,
    say: Callable[[Step], None] | None = None,
    crash: CrashPoints = NO_CRASH,
) -> ArchiveResult:
    """Archive what the retention rules allow of the PostgreSQL ledger at ``url``, in
    steps of at most ``size`` events, each its own transaction (``say`` hears of each)."""
    check_ledger_schema(url)  # before migrate_on(), which would make a mistyped schema one
    target = Target.parse(url)
    # As the replicas' writers: an archive stopped while it holds the batch lock is ended
    # by the server, so it cannot stall every replica's writes for longer than this.
    conn = target.connect(
        idle_in_transaction_session_timeout=str(IDLE_IN_TRANSACTION_MS),
        synchronous_commit="on",
    )
    steps: list[Step] = []
    try:
        migrate_on(conn, target)
        planned = functools.partial(_plan, conn, [], before, size)
        commit = functools.partial(_commit, conn, crash)
        survey = run_steps(steps, planned, commit, say, crash)
        return summed(steps, survey)
    except psycopg.errors.UniqueViolation as exc:
        message = "another archive ran meanwhile; run archive again"
        raise LedgerCorrupt(message + done_before(steps)) from exc
    except psycopg.Error as exc:
        raise LedgerUnavailable(f"archive failed: {exc}{done_before(steps)}") from exc
    finally:
        conn.close()


def _plan(
    conn: psycopg.Connection[Any],
    bounds: list[Bounds],
    before: float,
    size: int,
    previous: Cut | None,
) -> Survey:
    """One step's plan in one snapshot (writers go on); the first fixes the bounds."""
    with conn.transaction():
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
        now = float(conn.execute(f"SELECT {CLOCK_FUNCTION}()").fetchall()[0][0])

        def fetch(sql: str, params: Sequence[Any]) -> list[Any]:
            return conn.execute(sql, params).fetchall()

        if not bounds:
            bounds.append(bounds_of(fetch, before=before, now=now, size=size))
        step = bounds[0]
        if previous is not None:
            step = replace(step, after=previous.seq, now=now)
        return plan_archive(fetch, step, previous=previous)


def _commit(conn: psycopg.Connection[Any], crash: CrashPoints, plan: Plan) -> Step:
    state = prove(plan)
    digest = archivefile.lines_sha256(archivefile.event_line(e) for e in plan.events)
    keyed = plan.keyed()
    with conn.transaction():
        conn.execute(
            f"INSERT INTO archived_events({EVENT_COLUMNS}) SELECT {EVENT_COLUMNS} FROM events "
            "WHERE seq BETWEEN %s AND %s",
            (plan.first, plan.last),
        )
        # Bodies never change once written: copied, like the events, before the lock.
        conn.execute(
            "INSERT INTO archived_bodies(call_id, seq, chunk) SELECT call_id, seq, chunk "
            "FROM call_bodies WHERE call_id = ANY(%s)",
            (list(plan.calls),),
        )
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock_key(conn, "batch"),))
        _refuse_if_moved(conn, plan)
        row = conn.execute(
            f"SELECT seq, digest, {CLOCK_FUNCTION}() FROM events ORDER BY seq DESC LIMIT 1"
        ).fetchall()[0]
        stored, data_json = seal_checkpoint(
            plan, state, TABLE, digest, (int(row[0]), str(row[1])), float(row[2])
        )
        _apply(conn, stored, data_json, plan, keyed)
    crash.hit("after:archive-commit")
    counts = (len(plan.events), len(plan.calls), len(keyed))
    cut = Cut(plan.last, plan.events[-1].digest, state)
    return Step(TABLE, plan.first, plan.last, *counts, stored.seq, cut)


def _refuse_if_moved(conn: psycopg.Connection[Any], plan: Plan) -> None:
    # As on SQLite: a failed call can still be reconciled, and another archive may
    # have cut first; either makes the plan stale.
    moved = conn.execute(
        "SELECT call_id FROM events WHERE seq > %s AND call_id = ANY(%s) LIMIT 1",
        (plan.last, list(plan.calls)),
    ).fetchall()
    if moved:
        raise LedgerCorrupt(f"call {moved[0][0]} changed while archiving; run archive again")
    first = conn.execute("SELECT min(seq) FROM events").fetchall()[0][0]
    if first != plan.first:
        raise LedgerCorrupt("another archive ran meanwhile; run archive again")


def _apply(
    conn: psycopg.Connection[Any],
    stored: StoredEvent,
    data_json: str,
    plan: Plan,
    keyed: list[tuple[str, str, str, str]],
) -> None:
    conn.execute(
        f"INSERT INTO events({EVENT_COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)",
        (
            stored.seq,
            stored.kind,
            stored.call_id,
            data_json,
            stored.worker,
            stored.generation,
            stored.at,
            stored.prev_digest,
            stored.digest,
        ),
    )
    start = None if plan.start_state is None else canonical_json(plan.start_state)
    conn.execute(
        "INSERT INTO archives(checkpoint_seq, first_seq, last_seq, prev_digest, start_state, "
        "checkpoint) VALUES (%s, %s, %s, %s, %s, %s)",
        (stored.seq, plan.first, plan.last, plan.prev_digest, start, _line(stored)),
    )
    with conn.cursor() as cursor:
        cursor.executemany(
            "INSERT INTO archived_keys(budget_root, idempotency_key, call_id, request_hash) "
            "VALUES (%s, %s, %s, %s)",
            keyed,
        )
    conn.execute("UPDATE meta SET value = %s WHERE key = 'archived_through'", (plan.last,))
    conn.execute("DELETE FROM events WHERE seq <= %s", (plan.last,))
    conn.execute("DELETE FROM calls WHERE call_id = ANY(%s)", (list(plan.calls),))
    conn.execute("DELETE FROM call_bodies WHERE call_id = ANY(%s)", (list(plan.calls),))


def _line(stored: StoredEvent) -> str:
    return archivefile.event_line(stored)


def verify_archived(url: str) -> VerifyReport:
    """Prove the archive table on its own, range by range, and tie it to the ledger.

    Each ``archives`` row is checked as an archive file would be (its events chain from
    the digest before it to its checkpoint's, hash to its checkpoint's digest, fold from
    its starting state to its checkpoint's state, are whole and final calls). Ranges
    must follow one another from event 1. Each range's checkpoint must be the event the
    chain holds at that number (in ``archived_events`` once a later range took it, else
    in ``events``): a table rewritten and resealed end to end does not match the chain.
    """
    target = Target.parse(url)
    conn = target.connect()
    try:
        with conn.transaction():
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            return _verify_ranges(conn)
    except psycopg.Error as exc:
        raise LedgerUnavailable(f"cannot read the archive table: {exc}") from exc
    finally:
        conn.close()


def _verify_ranges(conn: psycopg.Connection[Any]) -> VerifyReport:
    total = VerifyReport()
    expected_first = 1
    archived: set[str] = set()
    ranges = conn.execute(
        "SELECT checkpoint_seq, first_seq, last_seq, prev_digest, start_state, checkpoint "
        "FROM archives ORDER BY first_seq"
    ).fetchall()
    for seq, first, last, prev, start, line in ranges:
        tail = StoredEvent(**json.loads(line))
        header = {
            "first_seq": int(first),
            "last_seq": int(last),
            "prev_digest": prev,
            "start_state": None if start is None else json.loads(start),
        }
        rows = conn.execute(
            f"SELECT {EVENT_COLUMNS} FROM archived_events WHERE seq BETWEEN %s AND %s ORDER BY seq",
            (first, last),
        ).fetchall()
        events = [event_from_row(r) for r in rows]
        lines = [archivefile.event_line(e) for e in events]
        calls = sorted({e.call_id for e in events if e.call_id is not None})
        archived.update(calls)
        report = verify_range(header, lines, tail, _bodies(conn, calls))
        if int(first) != expected_first:
            report.broken(
                int(first), f"archived range {first}..{last} follows event {expected_first - 1}"
            )
        _check_checkpoint(conn, report, int(seq), tail)
        _merge(total, report)
        expected_first = int(last) + 1
    stray = conn.execute(
        "SELECT count(*) FROM archived_events WHERE seq >= %s", (expected_first,)
    ).fetchall()[0][0]
    if stray:
        total.broken(expected_first, f"{stray} archived events belong to no archived range")
    for (call_id,) in conn.execute(
        "SELECT DISTINCT call_id FROM archived_bodies WHERE NOT call_id = ANY(%s)",
        (sorted(archived),),
    ).fetchall():
        total.broken(expected_first - 1, f"call {call_id}: orphan body: in no archived range")
    return total


def _bodies(conn: psycopg.Connection[Any], calls: list[str]) -> list[BodyRow]:
    """The archived bodies of ``calls`` as the verifier compares them, each streamed
    through its hash one chunk (one query) at a time."""
    found: dict[str, list[tuple[int, int]]] = {}
    for call_id, seq, size in conn.execute(
        "SELECT call_id, seq, length(chunk) FROM archived_bodies WHERE call_id = ANY(%s) "
        "ORDER BY call_id, seq",
        (calls,),
    ).fetchall():
        found.setdefault(str(call_id), []).append((int(seq), int(size)))
    rows = []
    for call_id, chunks in found.items():
        seqs = tuple(seq for seq, _ in chunks)
        digest = None
        if seqs == tuple(range(len(seqs))):
            h = hashlib.sha256()
            for seq in seqs:
                (chunk,) = conn.execute(
                    "SELECT chunk FROM archived_bodies WHERE call_id = %s AND seq = %s",
                    (call_id, seq),
                ).fetchall()[0]
                h.update(chunk)
            digest = h.hexdigest()
        rows.append(BodyRow(call_id, seqs, sum(size for _, size in chunks), digest))
    return rows


def _check_checkpoint(
    conn: psycopg.Connection[Any], report: VerifyReport, seq: int, tail: StoredEvent
) -> None:
    found = conn.execute(
        "SELECT digest FROM archived_events WHERE seq = %s UNION ALL "
        "SELECT digest FROM events WHERE seq = %s",
        (seq, seq),
    ).fetchall()
    if not found:
        report.broken(seq, f"event {seq}: the ledger holds no such checkpoint")
    elif any(str(d) != tail.digest for (d,) in found):
        report.broken(seq, f"event {seq}: the ledger's checkpoint is not this archive's")


def _merge(total: VerifyReport, part: VerifyReport) -> None:
    total.events += part.events
    total.calls += part.calls
    total.problems.extend(part.problems)
    seqs = [s for s in (total.first_broken_seq, part.first_broken_seq) if s is not None]
    total.first_broken_seq = min(seqs, default=None)
