"""How a SQLite ledger's tables are made (migrations).

``migrate`` applies pending migrations, each recorded in the transaction that applies it
(a connection to the file: :func:`~effectguard.ledger.sqliteconnect.connect`).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable

from effectguard.ledger import sqlitecalls, sqliteevents, versions, writerformat
from effectguard.ledger.sqlparts import KEY_KINDS_SQLITE, NOT_APPLIED_INDEX

#: A migration step: SQL text, or a function of the connection (inside the migration's
#: transaction) where rows must be rewritten in Python.
Step = str | Callable[[sqlite3.Connection], None]

#: The archive's guard on ``archived_through`` (migration 5), re-made by migration 6.
_ARCHIVED_THROUGH_TRIGGER = """CREATE TRIGGER meta_archived_through BEFORE UPDATE ON meta
                WHEN NEW.key = 'archived_through' AND (
                    NEW.value < OLD.value OR NOT EXISTS (
                        SELECT 1 FROM events WHERE seq = (SELECT max(seq) FROM events)
                        AND kind = 'ledger.archived'
                        AND json_extract(data, '$.last_seq') = NEW.value))
                BEGIN SELECT RAISE(ABORT, 'archived_through moves only with a checkpoint'); END"""


def _copy_events(conn: sqlite3.Connection) -> None:
    rows = conn.execute(
        "SELECT seq, kind, call_id, data, worker, generation, at, prev_digest, digest "
        "FROM events ORDER BY seq"
    )
    # Format 2 as migration 6 made it (migration 10 adds call_prev after it).
    columns = "seq, kind, call_id, data, body, worker, generation, at, prev_digest, digest"
    marks = ", ".join("?" * 10)
    conn.executemany(
        f"INSERT INTO events_v2({columns}) VALUES ({marks})",
        sqliteevents.convert_rows(rows),
    )


#: The events table's triggers and index, as migration 11 re-makes them (the delete
#: guard as migration 8 left it).
_EVENTS_EXTRAS = [
    "CREATE INDEX events_limits ON events(seq) WHERE kind = 'budget.limit_set'",
    """CREATE TRIGGER events_no_update BEFORE UPDATE ON events
        BEGIN SELECT RAISE(ABORT, 'events are append-only'); END""",
    """CREATE TRIGGER events_no_delete BEFORE DELETE ON events
        WHEN OLD.seq > coalesce(
            (SELECT value FROM meta WHERE key = 'archived_through'), 0)
        BEGIN SELECT RAISE(ABORT, 'events are append-only'); END""",
    _ARCHIVED_THROUGH_TRIGGER,
]


def _coded_copy() -> str:
    """Migration 10's copy of every event with its kind and worker as codes."""
    kinds = " ".join(f"WHEN '{k}' THEN {c}" for k, c in sqliteevents.KIND_CODES.items())
    return f"""INSERT INTO events_v3(seq, kind, call_id, data, body, worker, generation, at,
            prev_digest, digest, call_prev)
        SELECT seq, CASE kind {kinds} ELSE kind END, call_id, data, body,
            coalesce((SELECT n.id FROM worker_names n WHERE n.name = events.worker), worker),
            generation, at, prev_digest, digest, call_prev
        FROM events ORDER BY seq"""


def _fill_last_seq(conn: sqlite3.Connection) -> None:
    rows = conn.execute(
        "SELECT call_id, max(seq) FROM events WHERE call_id IS NOT NULL GROUP BY call_id"
    ).fetchall()
    conn.executemany(
        "UPDATE calls SET last_seq = ? WHERE call_id = ?",
        [(last, sqliteevents.call_from_key(key)) for key, last in rows],
    )


def _copy_calls(conn: sqlite3.Connection) -> None:
    """Migration 14's copy of every call row: its key and hash as bytes, its worker by id,
    its spend (model, cost, held) read from its state."""
    conn.create_function("eg_call_key", 1, sqliteevents.call_key, deterministic=True)
    conn.create_function("eg_hash_key", 1, sqlitecalls.hash_key, deterministic=True)
    conn.create_function("eg_field", 2, sqlitecalls.stored_field, deterministic=True)
    conn.execute(
        """INSERT INTO calls_v3(call_id, stage, budget, budget_root, idempotency_key,
            request_hash, provider, created_at, worker, state, last_seq, model, cost, held)
        SELECT eg_call_key(call_id), stage, budget, budget_root,
            idempotency_key, eg_hash_key(request_hash), provider, created_at,
            (SELECT n.id FROM worker_names n WHERE n.name = calls.worker), state, last_seq,
            eg_field(state, 'model'), eg_field(state, 'cost'),
            coalesce(eg_field(state, 'held'), 0)
        FROM calls"""
    )


MIGRATIONS: list[tuple[int, str, list[Step]]] = [
    (
        1,
        "events, calls, budgets, workers",
        [
            """CREATE TABLE events (
                seq INTEGER PRIMARY KEY, kind TEXT NOT NULL, call_id TEXT, data TEXT NOT NULL,
                worker TEXT NOT NULL, generation INTEGER NOT NULL, at REAL NOT NULL,
                prev_digest TEXT NOT NULL, digest TEXT NOT NULL)""",
            "CREATE INDEX events_call ON events(call_id, seq) WHERE call_id IS NOT NULL",
            """CREATE TRIGGER events_no_update BEFORE UPDATE ON events
                BEGIN SELECT RAISE(ABORT, 'events are append-only'); END""",
            """CREATE TRIGGER events_no_delete BEFORE DELETE ON events
                BEGIN SELECT RAISE(ABORT, 'events are append-only'); END""",
            """CREATE TABLE calls (
                call_id TEXT PRIMARY KEY, stage TEXT NOT NULL, budget TEXT NOT NULL,
                budget_root TEXT NOT NULL, idempotency_key TEXT, request_hash TEXT NOT NULL,
                provider TEXT NOT NULL, created_at REAL NOT NULL, worker TEXT NOT NULL,
                state TEXT NOT NULL)""",
            """CREATE UNIQUE INDEX calls_key ON calls(budget_root, idempotency_key)
                WHERE idempotency_key IS NOT NULL""",
            """CREATE INDEX calls_unresolved ON calls(budget_root, request_hash, created_at)
                WHERE stage IN ('in_flight', 'effect_unknown')""",
            "CREATE INDEX calls_stage ON calls(stage, worker)",
            "CREATE INDEX calls_created ON calls(created_at)",
            """CREATE TABLE budgets (
                path TEXT PRIMARY KEY, limit_nanos INTEGER, reserved INTEGER NOT NULL,
                spent INTEGER NOT NULL, held INTEGER NOT NULL)""",
            """CREATE TABLE workers (
                worker TEXT PRIMARY KEY, generation INTEGER NOT NULL, host TEXT NOT NULL,
                pid INTEGER NOT NULL, lease_expires REAL NOT NULL, fenced INTEGER NOT NULL)""",
            "CREATE INDEX workers_live ON workers(fenced)",
            "CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL)",
            "INSERT INTO meta(key, value) VALUES ('generation', 0)",
        ],
    ),
    (
        2,
        "proxy keys; an index of limit events",
        [
            """CREATE TABLE keys (
                name TEXT PRIMARY KEY, sha256 TEXT NOT NULL, budget_root TEXT NOT NULL,
                created_at REAL NOT NULL, expires_at REAL, models TEXT, providers TEXT,
                revoked_at REAL)""",
            "CREATE INDEX keys_sha256 ON keys(sha256)",
            "CREATE INDEX events_limits ON events(seq) WHERE kind = 'budget.limit_set'",
        ],
    ),
    (
        3,
        "budget periods: counters per (path, period), policies with period, timezone, rates",
        [
            """CREATE TABLE budget_periods (
                path TEXT NOT NULL, period TEXT NOT NULL, reserved INTEGER NOT NULL,
                spent INTEGER NOT NULL, held INTEGER NOT NULL, PRIMARY KEY (path, period))""",
            """INSERT INTO budget_periods(path, period, reserved, spent, held)
                SELECT path, 'total', reserved, spent, held FROM budgets""",
            "ALTER TABLE budgets DROP COLUMN reserved",
            "ALTER TABLE budgets DROP COLUMN spent",
            "ALTER TABLE budgets DROP COLUMN held",
            "ALTER TABLE budgets ADD COLUMN period TEXT NOT NULL DEFAULT 'total'",
            "ALTER TABLE budgets ADD COLUMN tz TEXT NOT NULL DEFAULT 'UTC'",
            "ALTER TABLE budgets ADD COLUMN rpm INTEGER",
            "ALTER TABLE budgets ADD COLUMN tpm INTEGER",
            "ALTER TABLE budgets ADD COLUMN concurrency INTEGER",
        ],
    ),
    (
        4,
        "rate windows: requests and tokens admitted in the current minute, per node",
        [
            """CREATE TABLE rate_windows (
                path TEXT PRIMARY KEY, minute INTEGER NOT NULL, requests INTEGER NOT NULL,
                tokens INTEGER NOT NULL)""",
        ],
    ),
    (
        5,
        "archive: the one DELETE path for events, tied to a ledger.archived checkpoint; keys kept",
        [
            # Events up to meta.archived_through may be deleted, nothing else; that mark
            # moves only forward, and only to the range the newest event (a checkpoint
            # written in the same transaction) says it archived.
            "INSERT INTO meta(key, value) VALUES ('archived_through', 0)",
            "DROP TRIGGER events_no_delete",
            """CREATE TRIGGER events_no_delete BEFORE DELETE ON events
                WHEN OLD.seq > (SELECT value FROM meta WHERE key = 'archived_through')
                BEGIN SELECT RAISE(ABORT, 'events are append-only'); END""",
            _ARCHIVED_THROUGH_TRIGGER,
            """CREATE TABLE archived_keys (
                budget_root TEXT NOT NULL, idempotency_key TEXT NOT NULL, call_id TEXT NOT NULL,
                request_hash TEXT NOT NULL, PRIMARY KEY (budget_root, idempotency_key))""",
        ],
    ),
    (
        6,
        "events format 2: binary digests, derived predecessor links, bodies as BLOBs",
        [
            # See sqliteevents: the events themselves and their digests do not change.
            "DROP TRIGGER meta_archived_through",
            """CREATE TABLE events_v2 (
                seq INTEGER PRIMARY KEY, kind TEXT NOT NULL, call_id TEXT, data TEXT NOT NULL,
                body BLOB, worker TEXT NOT NULL, generation INTEGER NOT NULL, at REAL NOT NULL,
                prev_digest BLOB, digest BLOB NOT NULL)""",
            _copy_events,
            "DROP TABLE events",
            "ALTER TABLE events_v2 RENAME TO events",
            "CREATE INDEX events_call ON events(call_id, seq) WHERE call_id IS NOT NULL",
            "CREATE INDEX events_limits ON events(seq) WHERE kind = 'budget.limit_set'",
            """CREATE TRIGGER events_no_update BEFORE UPDATE ON events
                BEGIN SELECT RAISE(ABORT, 'events are append-only'); END""",
            """CREATE TRIGGER events_no_delete BEFORE DELETE ON events
                WHEN OLD.seq > (SELECT value FROM meta WHERE key = 'archived_through')
                BEGIN SELECT RAISE(ABORT, 'events are append-only'); END""",
            _ARCHIVED_THROUGH_TRIGGER,
            # Where an archive deleted event N-1, the link of event N (written by archive).
            """CREATE TABLE chain_cuts (
                seq INTEGER PRIMARY KEY, prev_digest BLOB NOT NULL)""",
        ],
    ),
    (
        7,
        "calls keyed by call id alone (WITHOUT ROWID); no index on every call's stage",
        [
            # A rowid table with a TEXT primary key is two b-trees (rows, and the key's
            # index): one b-tree here, one page less per admission. calls_stage indexed
            # every call by stage, although only unresolved calls are ever looked up by
            # stage, and those are in calls_unresolved (queries.UNRESOLVED_SQL).
            """CREATE TABLE calls_v2 (
                call_id TEXT PRIMARY KEY, stage TEXT NOT NULL, budget TEXT NOT NULL,
                budget_root TEXT NOT NULL, idempotency_key TEXT, request_hash TEXT NOT NULL,
                provider TEXT NOT NULL, created_at REAL NOT NULL, worker TEXT NOT NULL,
                state TEXT NOT NULL) WITHOUT ROWID""",
            "INSERT INTO calls_v2 SELECT * FROM calls",
            "DROP TABLE calls",
            "ALTER TABLE calls_v2 RENAME TO calls",
            """CREATE UNIQUE INDEX calls_key ON calls(budget_root, idempotency_key)
                WHERE idempotency_key IS NOT NULL""",
            """CREATE INDEX calls_unresolved ON calls(budget_root, request_hash, created_at)
                WHERE stage IN ('in_flight', 'effect_unknown')""",
            "CREATE INDEX calls_created ON calls(created_at)",
        ],
    ),
    (
        8,
        "the events' delete guard holds without its meta row",
        [
            # With the archived_through row gone, `OLD.seq > (SELECT ...)` was NULL and
            # every event could be deleted; a missing mark now means 0, and the row
            # itself cannot be deleted.
            "DROP TRIGGER events_no_delete",
            """CREATE TRIGGER events_no_delete BEFORE DELETE ON events
                WHEN OLD.seq > coalesce(
                    (SELECT value FROM meta WHERE key = 'archived_through'), 0)
                BEGIN SELECT RAISE(ABORT, 'events are append-only'); END""",
            """CREATE TRIGGER meta_keeps_archived_through BEFORE DELETE ON meta
                WHEN OLD.key = 'archived_through'
                BEGIN SELECT RAISE(ABORT, 'archived_through cannot be deleted'); END""",
        ],
    ),
    (
        9,
        "no index of every call by creation time: calls list in call-id order",
        [
            # Call ids begin with their creation time in ms (operations.new_call_id), so
            # the table's own key lists calls newest first (queries.SQLITE.newest_first);
            # the index cost a b-tree page in every admission's commit.
            "DROP INDEX calls_created",
        ],
    ),
    (
        10,
        "a call's events linked from its row, not indexed: events.call_prev, calls.last_seq",
        [
            # See sqliteevents: the index of every event by call cost a b-tree page in
            # every commit and about 30 B per event; a link costs a few bytes in the row.
            "ALTER TABLE events ADD COLUMN call_prev INTEGER",
            "ALTER TABLE calls ADD COLUMN last_seq INTEGER",
            "DROP TRIGGER events_no_update",
            # Filled while events_call still serves the lookups of each event's previous.
            """UPDATE events SET call_prev = (
                SELECT max(p.seq) FROM events p
                WHERE p.call_id = events.call_id AND p.seq < events.seq)
                WHERE call_id IS NOT NULL""",
            """CREATE TRIGGER events_no_update BEFORE UPDATE ON events
                BEGIN SELECT RAISE(ABORT, 'events are append-only'); END""",
            _fill_last_seq,
            "DROP INDEX events_call",
        ],
    ),
    (
        11,
        "events format 3: kinds and workers as small integers (worker_names)",
        [
            # See sqliteevents: about 200 B a call. The columns have no type, so an
            # integer stays an integer (TEXT affinity would store it as text).
            """CREATE TABLE worker_names (
                id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE)""",
            """INSERT INTO worker_names(name)
                SELECT worker FROM events GROUP BY worker ORDER BY min(seq)""",
            "DROP TRIGGER meta_archived_through",
            """CREATE TABLE events_v3 (
                seq INTEGER PRIMARY KEY, kind NOT NULL, call_id TEXT, data TEXT NOT NULL,
                body BLOB, worker NOT NULL, generation INTEGER NOT NULL, at REAL NOT NULL,
                prev_digest BLOB, digest BLOB NOT NULL, call_prev INTEGER)""",
            _coded_copy(),
            "DROP TABLE events",
            "ALTER TABLE events_v3 RENAME TO events",
            *_EVENTS_EXTRAS,
        ],
    ),
    (
        12,
        "the body store: request bodies stored by reference, in chunks (rules/bodyref)",
        [
            # call_id as the events table holds it (sqliteevents.call_key: 16 bytes for
            # a ``call_`` id). A rowid table, not WITHOUT ROWID: its rows are 256 KiB.
            # Chunks are written once, by the admission; an archive deletes them with
            # their call's events.
            """CREATE TABLE call_bodies (
                call_id NOT NULL, seq INTEGER NOT NULL, chunk BLOB NOT NULL,
                PRIMARY KEY (call_id, seq))""",
            """CREATE TRIGGER call_bodies_no_update BEFORE UPDATE ON call_bodies
                BEGIN SELECT RAISE(ABORT, 'stored bodies do not change'); END""",
        ],
    ),
    (
        13,
        "events format 4: an operation's events as one record; request hashes as bytes",
        [
            # See sqliterecords: rows written before are single events and read as they
            # are, so nothing is copied. A record's manifest's request hash, raw.
            "ALTER TABLE events ADD COLUMN hash BLOB",
        ],
    ),
    (
        14,
        "calls keyed by the call id's bytes, hashes as bytes, workers by id; "
        "a state kept only while the call is unresolved; its spend in columns",
        [
            # See sqlitecalls: states stored before are copied as they are (and read).
            # A call's model, cost and held amount are columns, for the spend chart.
            "INSERT OR IGNORE INTO worker_names(name) SELECT DISTINCT worker FROM calls",
            """CREATE TABLE calls_v3 (
                call_id NOT NULL PRIMARY KEY, stage TEXT NOT NULL, budget TEXT NOT NULL,
                budget_root TEXT NOT NULL, idempotency_key TEXT, request_hash NOT NULL,
                provider TEXT NOT NULL, created_at REAL NOT NULL, worker NOT NULL, state TEXT,
                last_seq INTEGER, model TEXT, cost INTEGER, held INTEGER NOT NULL DEFAULT 0)
                WITHOUT ROWID""",
            _copy_calls,
            "DROP TABLE calls",
            "ALTER TABLE calls_v3 RENAME TO calls",
            """CREATE UNIQUE INDEX calls_key ON calls(budget_root, idempotency_key)
                WHERE idempotency_key IS NOT NULL""",
            """CREATE INDEX calls_unresolved ON calls(budget_root, request_hash, created_at)
                WHERE stage IN ('in_flight', 'effect_unknown')""",
        ],
    ),
    (
        15,
        "writer format 1: releases before it (which fold a resend's budget.held as "
        "not_processed) may no longer write this ledger",
        list(writerformat.sqlite_require(1)),
    ),
    (
        16,
        "an index of the calls decided applied, by request hash",
        [
            # A key-less declared retry matched by hash repeats a call decided applied
            # too (ledger/retries). Only such calls enter the index: none of the hot
            # path's commits writes a page of it.
            """CREATE INDEX calls_decided ON calls(budget_root, request_hash, created_at)
                WHERE stage = 'reconciled_applied'""",
        ],
    ),
    (
        17,
        "operator-page sessions ended by a logout, outside the hash chain",
        [
            # ledger/endedsessions: a token's SHA-256 (never the token) and its expiry;
            # a logout deletes the rows long expired. Older releases never read it.
            """CREATE TABLE ended_sessions (
                token_sha256 TEXT NOT NULL PRIMARY KEY, expires_at REAL NOT NULL)""",
        ],
    ),
    (
        18,
        "writer format 2: a rate window records where a declaration started it mid-minute "
        "(since); releases before it may no longer write this ledger",
        [
            # A window kept now was counted by a release that did not record it: NULL,
            # which this release reads as "from the start of its minute", as that release
            # counted it, and which verify judges by that release's rules (contract §5.6).
            "ALTER TABLE rate_windows ADD COLUMN since INTEGER",
            *writerformat.sqlite_require(2),
        ],
    ),
    (
        19,
        "writer format 3: an attempt records where, and with which credential, it was "
        "sent (attempt.started's sent_to and key_digest); releases before it may no longer "
        "write this ledger",
        [*writerformat.sqlite_require(3)],
    ),
    (
        20,
        "an index of the key events, by seq",
        [
            # A replica's key refresh reads the key events after the last it folded
            # (ingress/keyring), not every key row. Only key events enter the index: no
            # commit of the hot path writes a page of it, and older releases keep it up.
            f"CREATE INDEX events_keys ON events(seq) WHERE kind IN ({KEY_KINDS_SQLITE})",
        ],
    ),
    (
        21,
        "writer format 4: a [[keys]] entry whose ledger key was revoked or expired is refused, "
        "usage far past a request's output cap is not believed, and a call a late answer "
        "says was applied is not resent; releases before it may no longer write this ledger",
        # No table changes but an index: beside this release, one of format 3 would serve
        # by its own rules (a revoked key spending there); only the ledger can stop it
        # (writerformat). The index holds the calls decided not applied, by request hash:
        # a key-less declared retry of one a late answer contradicts is refused
        # (ledger/retries). Both came in one release, so no release of format 4 lacks it.
        [NOT_APPLIED_INDEX, *writerformat.sqlite_require(4)],
    ),
    (
        22,
        "writer format 5: a rate window records where the clock stepped back (since); "
        "releases before it may no longer write this ledger",
        # No table changes: one of format 4 beside this release would count a step back
        # without recording it, leaving windows verify cannot re-derive (contract §5.6).
        [*writerformat.sqlite_require(5)],
    ),
    (
        23,
        "writer format 6: a rate window records the highest minute it reached (reached); "
        "releases before it may no longer write this ledger",
        # NULL in the windows kept now: their lineage is not tracked (contract §5.6), as
        # the release that counted them did not; a declaration that starts one tracks it.
        ["ALTER TABLE rate_windows ADD COLUMN reached INTEGER", *writerformat.sqlite_require(6)],
    ),
]


def migrate(conn: sqlite3.Connection) -> list[int]:
    """Apply pending migrations, each recorded in the transaction that applies it; refuse
    (``ConfigError``, nothing written) a ledger a newer release migrated. Returns the
    versions this call applied (none where another connection applied them first)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS migrations "
            "(version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at REAL NOT NULL)"
        )
        done = {row[0] for row in conn.execute("SELECT version FROM migrations")}
        # Every opener (a transport's first call too) refuses what serve and migrate refuse
        # up front: writing beside a later release's rules, which this one would misread.
        known = {m[0] for m in MIGRATIONS}
        if not done <= known:  # the message names the file conn has open
            file = str(conn.execute("PRAGMA database_list").fetchone()[2])
            versions.check_not_newer(file, done, known)
        applied: list[tuple[int, str]] = []
        for version, name, statements in MIGRATIONS:
            if version in done:
                continue
            for step in statements:
                if isinstance(step, str):
                    conn.execute(step)
                else:
                    step(conn)
            conn.execute(
                "INSERT INTO migrations(version, name, applied_at) VALUES (?, ?, ?)",
                (version, name, time.time()),
            )
            applied.append((version, name))
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    if done:  # not a new ledger's creation: an upgrade
        versions.announce(applied)
    return [version for version, _ in applied]
