"""How a PostgreSQL ledger's tables are made (migrations).

``Target`` (:mod:`effectguard.ledger.pgtarget`) parses the DSN and connects;
``migrate`` creates or upgrades the tables under an advisory lock, each
migration recorded in the transaction that applies it, so replicas starting at
once apply each version exactly once.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from effectguard.errors import ConfigError, LedgerUnavailable
from effectguard.ledger import versions, writerformat
from effectguard.ledger.pgdriver import psycopg, sql

# Re-exported: the ledger's modules name the connection (and ledger URLs) through this one.
from effectguard.ledger.pgtarget import CONNECT_TIMEOUT_S as CONNECT_TIMEOUT_S
from effectguard.ledger.pgtarget import IDLE_IN_TRANSACTION_MS as IDLE_IN_TRANSACTION_MS
from effectguard.ledger.pgtarget import LOCK_TIMEOUT_MS as LOCK_TIMEOUT_MS
from effectguard.ledger.pgtarget import Target as Target
from effectguard.ledger.sqlparts import KEY_KINDS_TEXT, NOT_APPLIED_INDEX
from effectguard.rules.urltext import redacted as redacted

log = logging.getLogger("effectguard.ledger")

#: The ledger's clock (seconds since the epoch, float8): every time the store reads.
CLOCK_FUNCTION = "effectguard_now"

MIGRATIONS: list[tuple[int, str, list[str]]] = [
    (
        1,
        "events, calls, budgets, workers",
        [
            """CREATE TABLE events (
                seq BIGINT PRIMARY KEY, kind TEXT NOT NULL, call_id TEXT, data TEXT NOT NULL,
                worker TEXT NOT NULL, generation BIGINT NOT NULL, at DOUBLE PRECISION NOT NULL,
                prev_digest TEXT NOT NULL, digest TEXT NOT NULL)""",
            "CREATE INDEX events_call ON events(call_id, seq) WHERE call_id IS NOT NULL",
            """CREATE FUNCTION events_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
                BEGIN RAISE EXCEPTION 'events are append-only'; END $$""",
            """CREATE TRIGGER events_no_change BEFORE UPDATE OR DELETE ON events
                FOR EACH ROW EXECUTE FUNCTION events_append_only()""",
            """CREATE TRIGGER events_no_truncate BEFORE TRUNCATE ON events
                FOR EACH STATEMENT EXECUTE FUNCTION events_append_only()""",
            """CREATE TABLE calls (
                call_id TEXT PRIMARY KEY, stage TEXT NOT NULL, budget TEXT NOT NULL,
                budget_root TEXT NOT NULL, idempotency_key TEXT, request_hash TEXT NOT NULL,
                provider TEXT NOT NULL, created_at DOUBLE PRECISION NOT NULL,
                worker TEXT NOT NULL, state TEXT NOT NULL)""",
            """CREATE UNIQUE INDEX calls_key ON calls(budget_root, idempotency_key)
                WHERE idempotency_key IS NOT NULL""",
            """CREATE INDEX calls_unresolved ON calls(budget_root, request_hash, created_at)
                WHERE stage IN ('in_flight', 'effect_unknown')""",
            "CREATE INDEX calls_stage ON calls(stage, worker)",
            "CREATE INDEX calls_created ON calls(created_at)",
            """CREATE TABLE budgets (
                path TEXT PRIMARY KEY, limit_nanos BIGINT, reserved BIGINT NOT NULL,
                spent BIGINT NOT NULL, held BIGINT NOT NULL)""",
            """CREATE TABLE workers (
                worker TEXT PRIMARY KEY, generation BIGINT NOT NULL, host TEXT NOT NULL,
                pid BIGINT NOT NULL, lease_expires DOUBLE PRECISION NOT NULL,
                fenced BOOLEAN NOT NULL)""",
            "CREATE INDEX workers_live ON workers(fenced)",
            "CREATE TABLE meta (key TEXT PRIMARY KEY, value BIGINT NOT NULL)",
            "INSERT INTO meta(key, value) VALUES ('generation', 0)",
        ],
    ),
    (
        2,
        "proxy keys; an index of limit events",
        [
            """CREATE TABLE keys (
                name TEXT PRIMARY KEY, sha256 TEXT NOT NULL, budget_root TEXT NOT NULL,
                created_at DOUBLE PRECISION NOT NULL, expires_at DOUBLE PRECISION,
                models TEXT, providers TEXT, revoked_at DOUBLE PRECISION)""",
            "CREATE INDEX keys_sha256 ON keys(sha256)",
            "CREATE INDEX events_limits ON events(seq) WHERE kind = 'budget.limit_set'",
        ],
    ),
    (
        3,
        "budget periods: counters per (path, period), policies with period, timezone, rates",
        [
            """CREATE TABLE budget_periods (
                path TEXT NOT NULL, period TEXT NOT NULL, reserved BIGINT NOT NULL,
                spent BIGINT NOT NULL, held BIGINT NOT NULL, PRIMARY KEY (path, period))""",
            """INSERT INTO budget_periods(path, period, reserved, spent, held)
                SELECT path, 'total', reserved, spent, held FROM budgets""",
            "ALTER TABLE budgets DROP COLUMN reserved, DROP COLUMN spent, DROP COLUMN held",
            """ALTER TABLE budgets ADD COLUMN period TEXT NOT NULL DEFAULT 'total',
                ADD COLUMN tz TEXT NOT NULL DEFAULT 'UTC', ADD COLUMN rpm BIGINT,
                ADD COLUMN tpm BIGINT, ADD COLUMN concurrency BIGINT""",
        ],
    ),
    (
        4,
        "rate windows: requests and tokens admitted in the current minute, per node",
        [
            """CREATE TABLE rate_windows (
                path TEXT PRIMARY KEY, minute BIGINT NOT NULL, requests BIGINT NOT NULL,
                tokens BIGINT NOT NULL)""",
        ],
    ),
    (
        5,
        "the ledger's clock: effectguard_now(), the database's clock plus a test-only offset",
        [
            # One row, 0 unless a test moved it (effectguard.testing.pgclock): a test can
            # put a period boundary seconds away and still have the database as its clock.
            """CREATE TABLE clock_offset (
                only_row BOOLEAN PRIMARY KEY DEFAULT true CHECK (only_row),
                seconds DOUBLE PRECISION NOT NULL DEFAULT 0)""",
            "INSERT INTO clock_offset DEFAULT VALUES",
            # SET search_path binds the function to this ledger's schema: whoever calls
            # it reads this ledger's offset, never another schema's table of that name.
            f"""CREATE FUNCTION {CLOCK_FUNCTION}() RETURNS DOUBLE PRECISION LANGUAGE sql VOLATILE
                SET search_path FROM CURRENT AS $$
                SELECT extract(epoch FROM clock_timestamp())::float8 + seconds FROM clock_offset
                $$""",
        ],
    ),
    (
        6,
        "archive: the one DELETE path for events, tied to a ledger.archived checkpoint; "
        "archived events, ranges and keys kept in tables of their own",
        [
            # As on SQLite: events up to meta.archived_through may be deleted, nothing
            # else; that mark moves only forward, and only to the range the newest event
            # (a checkpoint written in the same transaction) says it archived.
            "INSERT INTO meta(key, value) VALUES ('archived_through', 0)",
            "DROP TRIGGER events_no_change ON events",
            """CREATE TRIGGER events_no_update BEFORE UPDATE ON events
                FOR EACH ROW EXECUTE FUNCTION events_append_only()""",
            # coalesce: a deleted meta row must not open the table (NULL compares false).
            # SET search_path FROM CURRENT: the functions read this ledger's meta and
            # events whatever the search_path of the session that fires them.
            """CREATE FUNCTION events_delete_archived() RETURNS trigger LANGUAGE plpgsql
                SET search_path FROM CURRENT AS $$
                BEGIN
                    IF OLD.seq > coalesce(
                        (SELECT value FROM meta WHERE key = 'archived_through'), 0) THEN
                        RAISE EXCEPTION 'events are append-only';
                    END IF;
                    RETURN OLD;
                END $$""",
            """CREATE TRIGGER events_no_delete BEFORE DELETE ON events
                FOR EACH ROW EXECUTE FUNCTION events_delete_archived()""",
            """CREATE FUNCTION meta_archived_through() RETURNS trigger LANGUAGE plpgsql
                SET search_path FROM CURRENT AS $$
                BEGIN
                    IF NEW.key <> OLD.key OR NEW.value < OLD.value OR NOT EXISTS (
                        SELECT 1 FROM events WHERE seq = (SELECT max(seq) FROM events)
                        AND kind = 'ledger.archived'
                        AND (data::jsonb ->> 'last_seq')::bigint = NEW.value) THEN
                        RAISE EXCEPTION 'archived_through moves only with a checkpoint';
                    END IF;
                    RETURN NEW;
                END $$""",
            """CREATE TRIGGER meta_archived_through BEFORE UPDATE ON meta
                FOR EACH ROW WHEN (OLD.key = 'archived_through')
                EXECUTE FUNCTION meta_archived_through()""",
            """CREATE TABLE archived_keys (
                budget_root TEXT NOT NULL, idempotency_key TEXT NOT NULL, call_id TEXT NOT NULL,
                request_hash TEXT NOT NULL, PRIMARY KEY (budget_root, idempotency_key))""",
            # The archive: the events exactly as they were, and per range what an archive
            # file's header and last line hold (the state before it, its checkpoint).
            """CREATE TABLE archived_events (
                seq BIGINT PRIMARY KEY, kind TEXT NOT NULL, call_id TEXT, data TEXT NOT NULL,
                worker TEXT NOT NULL, generation BIGINT NOT NULL, at DOUBLE PRECISION NOT NULL,
                prev_digest TEXT NOT NULL, digest TEXT NOT NULL)""",
            """CREATE TABLE archives (
                checkpoint_seq BIGINT PRIMARY KEY, first_seq BIGINT NOT NULL,
                last_seq BIGINT NOT NULL, prev_digest TEXT NOT NULL, start_state TEXT,
                checkpoint TEXT NOT NULL)""",
            """CREATE TRIGGER archived_events_no_change BEFORE UPDATE OR DELETE ON archived_events
                FOR EACH ROW EXECUTE FUNCTION events_append_only()""",
            """CREATE TRIGGER archived_events_no_truncate BEFORE TRUNCATE ON archived_events
                FOR EACH STATEMENT EXECUTE FUNCTION events_append_only()""",
            """CREATE TRIGGER archives_no_change BEFORE UPDATE OR DELETE ON archives
                FOR EACH ROW EXECUTE FUNCTION events_append_only()""",
            """CREATE TRIGGER archives_no_truncate BEFORE TRUNCATE ON archives
                FOR EACH STATEMENT EXECUTE FUNCTION events_append_only()""",
        ],
    ),
    (
        7,
        "the body store: request bodies stored by reference, in chunks (rules/bodyref); "
        "archived bodies kept with their archived events",
        [
            # Chunks are written once, by the admission, and deleted only by an archive
            # (which copies them to archived_bodies first). STORAGE EXTERNAL: uploads are
            # mostly compressed formats already; PostgreSQL need not try again.
            """CREATE TABLE call_bodies (
                call_id TEXT NOT NULL, seq INTEGER NOT NULL, chunk BYTEA NOT NULL,
                PRIMARY KEY (call_id, seq))""",
            "ALTER TABLE call_bodies ALTER COLUMN chunk SET STORAGE EXTERNAL",
            """CREATE TRIGGER call_bodies_no_update BEFORE UPDATE ON call_bodies
                FOR EACH ROW EXECUTE FUNCTION events_append_only()""",
            """CREATE TABLE archived_bodies (
                call_id TEXT NOT NULL, seq INTEGER NOT NULL, chunk BYTEA NOT NULL,
                PRIMARY KEY (call_id, seq))""",
            "ALTER TABLE archived_bodies ALTER COLUMN chunk SET STORAGE EXTERNAL",
            """CREATE TRIGGER archived_bodies_no_change BEFORE UPDATE OR DELETE ON archived_bodies
                FOR EACH ROW EXECUTE FUNCTION events_append_only()""",
            """CREATE TRIGGER archived_bodies_no_truncate BEFORE TRUNCATE ON archived_bodies
                FOR EACH STATEMENT EXECUTE FUNCTION events_append_only()""",
        ],
    ),
    (
        8,
        "writer format 1: releases before it (which fold a resend's budget.held as "
        "not_processed) may no longer write this ledger",
        writerformat.pg_require(1),
    ),
    (
        9,
        "an index of the calls decided applied, by request hash",
        [
            # As SQLite's migration 16: a key-less declared retry matched by hash repeats
            # a call decided applied too (ledger/retries).
            """CREATE INDEX calls_decided ON calls(budget_root, request_hash, created_at)
                WHERE stage = 'reconciled_applied'""",
        ],
    ),
    (
        10,
        "operator-page sessions ended by a logout, outside the hash chain",
        [
            # As SQLite's migration 17 (ledger/endedsessions).
            """CREATE TABLE ended_sessions (
                token_sha256 TEXT NOT NULL PRIMARY KEY, expires_at DOUBLE PRECISION NOT NULL)""",
        ],
    ),
    (
        11,
        "writer format 2: a rate window records where a declaration started it mid-minute "
        "(since); releases before it may no longer write this ledger",
        [
            # As SQLite's migration 18: NULL in the windows an older release counted.
            "ALTER TABLE rate_windows ADD COLUMN since BIGINT",
            *writerformat.pg_require(2),
        ],
    ),
    (
        12,
        "writer format 3: an attempt records where, and with which credential, it was "
        "sent (attempt.started's sent_to and key_digest); releases before it may no longer "
        "write this ledger",
        [*writerformat.pg_require(3)],
    ),
    (
        13,
        "an index of the key events, by seq",
        [
            # As SQLite's migration 20 (ingress/keyring reads the key events it lacks).
            f"CREATE INDEX events_keys ON events(seq) WHERE kind IN ({KEY_KINDS_TEXT})",
        ],
    ),
    (
        14,
        "writer format 4: a [[keys]] entry whose ledger key was revoked or expired is refused, "
        "usage far past a request's output cap is not believed, and a call a late answer "
        "says was applied is not resent; releases before it may no longer write this ledger",
        [NOT_APPLIED_INDEX, *writerformat.pg_require(4)],  # as SQLite's migration 21
    ),
    (
        15,
        "writer format 5: a rate window records where the clock stepped back (since); "
        "releases before it may no longer write this ledger",
        writerformat.pg_require(5),  # as SQLite's migration 22
    ),
    (
        16,
        "writer format 6: a rate window records the highest minute it reached (reached); "
        "releases before it may no longer write this ledger",
        # As SQLite's migration 23: NULL in the windows kept now (not tracked).
        ["ALTER TABLE rate_windows ADD COLUMN reached BIGINT", *writerformat.pg_require(6)],
    ),
]


def lock_key(conn: psycopg.Connection[Any], purpose: str) -> int:
    """An advisory-lock key for ``purpose`` in this connection's schema (signed 64-bit)."""
    row = conn.execute("SELECT current_setting('search_path')").fetchone()
    digest = hashlib.sha256(f"effectguard:{purpose}:{row[0] if row else ''}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def migrate(url: str) -> list[int]:
    """Apply pending migrations to the ledger at ``url``; returns the versions applied.

    Safe when many replicas start at once: an advisory lock serializes them and
    each migration is recorded in the transaction that applies it (PostgreSQL
    DDL is transactional), so a migration is applied exactly once.
    """
    target = Target.parse(url)
    conn = target.connect()
    try:
        return migrate_on(conn, target)
    except psycopg.Error as exc:
        raise LedgerUnavailable(f"ledger migration failed: {exc}") from exc
    finally:
        conn.close()


def check_ledger_schema(url: str) -> None:
    """Refuse (``ConfigError``) a PostgreSQL ``url`` that names no effectguard ledger.

    The PostgreSQL twin of :func:`~effectguard.ledger.sqlitefile.check_ledger_file`: it
    only reads, because opening a store migrates, and so would create a mistyped
    ``?schema=`` (or fill an empty one) instead of refusing it. A ledger is a schema (the
    connection's ``search_path`` without one) holding our ``migrations`` table.
    """
    target = Target.parse(url)
    conn = target.connect()  # an unreachable server: LedgerUnavailable (exit 4)
    try:
        found = _applied_on(conn)
        schema_missing = (
            target.schema is not None
            and not conn.execute(
                "SELECT 1 FROM pg_namespace WHERE nspname = %s", (target.schema,)
            ).fetchone()
        )
    except psycopg.Error as exc:
        raise LedgerUnavailable(f"cannot read ledger {redacted(url)}: {exc}") from exc
    finally:
        conn.close()
    if schema_missing:
        raise ConfigError(
            f"no ledger at {redacted(url)}: schema {target.schema} does not exist (use "
            "--ledger; `effectguard serve` or `effectguard migrate` creates one)"
        )
    if found is None:
        raise ConfigError(
            f"{redacted(url)} is not an effectguard ledger: no migrations table in "
            f"{'schema ' + target.schema if target.schema else 'the search_path'} "
            "(effectguard migrate --ledger DSN makes one)"
        )
    versions.check_current(redacted(url), found, (m[0] for m in MIGRATIONS))


def applied_versions(url: str) -> list[int]:
    """The migrations applied to the ledger at ``url``, read only; none where there is no
    ledger yet (no schema, no ``migrations`` table)."""
    conn = Target.parse(url).connect()  # an unreachable server: LedgerUnavailable (exit 4)
    try:
        return _applied_on(conn) or []
    except psycopg.Error as exc:
        raise LedgerUnavailable(f"cannot read ledger {redacted(url)}: {exc}") from exc
    finally:
        conn.close()


def _applied_on(conn: psycopg.Connection[Any]) -> list[int] | None:
    """The versions in the ``migrations`` table on ``conn``'s search_path (None: no table).

    With ?schema=, the search_path is that schema alone, so a table of that name elsewhere
    (public) is not taken for it; to_regclass reads a missing schema as NULL."""
    found = conn.execute("SELECT to_regclass('migrations') IS NOT NULL").fetchone()
    if not (found and found[0]):
        return None
    return [int(r[0]) for r in conn.execute("SELECT version FROM migrations")]


def clock_offset(conn: psycopg.Connection[Any]) -> float:
    """The seconds ``effectguard_now()`` adds to the database's clock (0 unless a test set it).

    A non-zero offset in a ledger that is not a test's is a mistake, so it is logged.
    """
    row = conn.execute("SELECT seconds FROM clock_offset").fetchone()
    seconds = float(row[0]) if row else 0.0
    if seconds:
        log.warning(
            "the ledger's clock is shifted by %+.3f s (table clock_offset): a seam for tests; "
            "outside a test set it back to 0",
            seconds,
            extra={"event": "ledger_clock_shifted", "seconds": seconds},
        )
    return seconds


def migrate_on(
    conn: psycopg.Connection[Any], target: Target, *, refuse_newer: bool = True
) -> list[int]:
    """Apply pending migrations on ``conn``; with ``refuse_newer``, refuse (``ConfigError``,
    nothing written) a ledger a newer release migrated, as ``serve`` and ``migrate`` do."""
    applied: list[int] = []
    done: set[int] = set()
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock_key(conn, "migrate"),))
        if target.schema is not None:
            conn.execute(
                sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(target.schema))
            )
        conn.execute(
            "CREATE TABLE IF NOT EXISTS migrations (version INTEGER PRIMARY KEY, "
            "name TEXT NOT NULL, applied_at DOUBLE PRECISION NOT NULL)"
        )
        done = {row[0] for row in conn.execute("SELECT version FROM migrations")}
        if refuse_newer:
            schema = f" schema {target.schema}" if target.schema else ""
            shown = redacted(target.conninfo) + schema
            versions.check_not_newer(shown, done, (m[0] for m in MIGRATIONS))
        for version, name, statements in MIGRATIONS:
            if version in done:
                continue
            for statement in statements:
                conn.execute(statement)
            conn.execute(
                "INSERT INTO migrations(version, name, applied_at) "
                "VALUES (%s, %s, extract(epoch FROM clock_timestamp()))",
                (version, name),
            )
            applied.append(version)
    if done:  # not a new ledger's creation: an upgrade
        names = {m[0]: m[1] for m in MIGRATIONS}
        versions.announce((v, names[v]) for v in applied)
    return applied
