"""Which releases may write a ledger: the writer format (docs/operations.md, "Mixed versions").

A release that writes an event sequence an older release would fold differently (the
``budget.held`` that makes a call effect_unknown again, which a release before it folds
as ``not_processed`` and so sends again) must keep older releases from writing beside it:
their admissions, retries and sweeps would act on that wrong fold. Ignoring migrations it
does not know, an older release would otherwise open a migrated ledger and serve.
Format 1 came with that ``budget.held``; format 2 with the rate window that records where
a declaration started it mid-minute (``rate_windows.since``, docs/contract.md §5.6),
which a release before it neither writes nor starts, leaving windows verify cannot
re-derive; format 3 with the ``attempt.started`` that records where, and with which
credential, an attempt was sent (``sent_to``, ``key_digest``), which a release before it
cannot read at all. Format 4 changed no event but rules a release before it breaks,
serving the same ledger by its own: a ``[[keys]]`` entry whose secret the ledger revoked
(or let expire) is refused, where such a release lets it spend; usage far past a
request's output cap is not believed, where such a release charges it. Those rules came
without a raise (SQLite's migration 20, PostgreSQL's 13, only added an index), so until
format 4 nothing stopped such a release serving beside this one. Format 5 changed no
event either: a rate window records where the clock stepped back (``since``), which a
release before it does not, leaving windows verify cannot re-derive. Format 6 neither:
a rate window records the highest minute it reached (``reached``), so that a clock
stepped back far and then forward into a minute an earlier window counted starts the
window over exactly; a release before it would keep the column as it found it.

So every writer declares the format it writes, on each connection, and the ledger refuses
a write (an event, a worker's registration or heartbeat) from a connection that declares
less than the ledger requires. The requirement is raised by a migration, in the same
transaction as the rest of the upgrade. On PostgreSQL the declaration is the session
setting :data:`SETTING`; a connection that never set it (a release before this one)
declares 0. On SQLite it is the SQL function :data:`FUNCTION`, which a release before this
one does not define: its writes fail with "no such function".
"""

from __future__ import annotations

import sqlite3
from typing import Final

#: The format this release writes. Raise it (with a migration calling :func:`pg_require` /
#: :func:`sqlite_require` with it) when events change so that an older release misreads
#: them, or when an older release serving beside this one would break a rule it keeps.
WRITER_FORMAT: Final = 6
#: The PostgreSQL session setting a connection declares its format in.
SETTING: Final = "effectguard.writer_format"
#: The SQLite function a connection declares its format with.
FUNCTION: Final = "effectguard_writer_format"

_ADVICE = (
    "an older effectguard would misread the events this ledger holds, or break rules its "
    "writers keep: upgrade this process (docs/operations.md, Upgrades and migrations)"
)


def refusal(required: int) -> str:
    """What a writer of an older format is told."""
    return f"this ledger requires effectguard writer format {required} or later; {_ADVICE}"


def pg_require(required: int) -> list[str]:
    """PostgreSQL statements making the ledger refuse writers below ``required``."""
    declared = f"coalesce(nullif(current_setting('{SETTING}', true), ''), '0')"
    return [
        f"""CREATE OR REPLACE FUNCTION effectguard_writer_check() RETURNS trigger
            LANGUAGE plpgsql AS $$
            BEGIN
                IF {declared}::int < {required} THEN
                    RAISE EXCEPTION '{refusal(required)} (this connection declares %)',
                        {declared};
                END IF;
                RETURN NULL;
            END $$""",
        "DROP TRIGGER IF EXISTS events_writer_format ON events",
        """CREATE TRIGGER events_writer_format BEFORE INSERT ON events
            FOR EACH STATEMENT EXECUTE FUNCTION effectguard_writer_check()""",
        "DROP TRIGGER IF EXISTS workers_writer_format ON workers",
        """CREATE TRIGGER workers_writer_format BEFORE INSERT OR UPDATE ON workers
            FOR EACH STATEMENT EXECUTE FUNCTION effectguard_writer_check()""",
    ]


def sqlite_require(required: int) -> list[str]:
    """SQLite statements making the ledger refuse writers below ``required`` (a connection
    without :data:`FUNCTION`, a release before this one, fails with "no such function")."""
    out: list[str] = []
    for name, when in (
        ("events_writer_format", "BEFORE INSERT ON events"),
        ("workers_writer_format_insert", "BEFORE INSERT ON workers"),
        ("workers_writer_format_update", "BEFORE UPDATE ON workers"),
    ):
        out += [
            f"DROP TRIGGER IF EXISTS {name}",
            f"""CREATE TRIGGER {name} {when} WHEN {FUNCTION}() < {required}
                BEGIN SELECT RAISE(ABORT, '{refusal(required)}'); END""",
        ]
    return out


def declare_sqlite(conn: sqlite3.Connection) -> None:
    """Declare this release's format on a SQLite connection that may write the ledger."""
    conn.create_function(FUNCTION, 0, lambda: WRITER_FORMAT, deterministic=True)
