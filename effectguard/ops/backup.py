"""``effectguard backup PATH``: a consistent copy of a SQLite ledger while it serves.

The copy is taken with SQLite's online backup API from a connection of its own, in a
single step: that step is one read transaction, so under WAL it sees one committed state
of the whole file (every event, call and budget row as of one commit) while the proxy
keeps writing. Writers are never blocked; only the WAL checkpoint waits for the copy.

The copy is written next to ``PATH`` under a temporary name, checked
(``PRAGMA integrity_check``), checkpointed into one self-contained file, fsync'd, and
only then renamed to ``PATH``: a crash during a backup never leaves a half copy under
the name an operator would restore from. PostgreSQL ledgers are backed up with
PostgreSQL's own tools (``pg_dump`` or point-in-time recovery), see the operations docs.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
from dataclasses import asdict, dataclass
from pathlib import Path

from effectguard.errors import ConfigError, LedgerUnavailable
from effectguard.ledger.sqlite import sqlite_path
from effectguard.ledger.sqliteconnect import BUSY_TIMEOUT_MS
from effectguard.ledger.sqliteevents import ROW_EVENTS, hex_digest
from effectguard.ledger.sqlitefile import COMPANIONS, check_ledger_file
from effectguard.ledger.sqlitefrozen import connect_frozen, or_frozen
from effectguard.ops.outpath import Held, hold_new, new_file, partial_of, remove_left_over
from effectguard.ops.render import say


@dataclass(frozen=True, slots=True)
class BackupResult:
    """What a backup copied: where, how many events, and the chain head it ends at."""

    path: str
    events: int
    head_seq: int
    head_digest: str
    bytes: int


def backup_sqlite(ledger: str, target: str | Path) -> BackupResult:
    """Copy the SQLite ledger at ``ledger`` (path or ``sqlite:///`` URL) to ``target``."""
    source = Path(sqlite_path(ledger))
    check_ledger_file(str(source), current=False)  # the backup before an upgrade
    target = new_file(target, ledger=source, command="backup", what="a backup")
    partial = partial_of(target)
    busy = (
        f"another backup to {target} is running now (it is writing {partial}); let it "
        "finish, or back up to another name"
    )
    # A backup that was killed left its partial copy (and SQLite's files beside it): that
    # is removed, but never the one a backup running now holds.
    remove_left_over(partial, busy=busy)
    for leftover in _companions(partial):
        leftover.unlink(missing_ok=True)
    # Owner-only like the ledger itself (it holds prompts, responses and key digests);
    # SQLite would create it with the umask's permissions, readable by anyone.
    held = hold_new(partial, busy=busy)
    try:
        _copy(source, partial)
        result = _check(partial, target)
        for leftover in _companions(partial):  # SQLite's, of the copy this backup holds
            leftover.unlink(missing_ok=True)
        _fsync(partial)
        _put_in_place(held, target, busy)
        _fsync(target.parent)
    except sqlite3.Error as exc:
        raise LedgerUnavailable(f"backup of {source} failed: {exc}") from exc
    finally:
        if held.in_place():  # only ever the copy this backup holds (not yet in place)
            for leftover in (partial, *_companions(partial)):
                leftover.unlink(missing_ok=True)
        held.close()
    return result


def _companions(partial: Path) -> list[Path]:
    return [Path(f"{partial}{suffix}") for suffix in COMPANIONS]


def _put_in_place(held: Held, target: Path, busy: str) -> None:
    """Give the copy its name, never over a file there (another backup's, finished while
    this one ran), and only while the partial name is still this copy's."""
    if not held.in_place():
        raise ConfigError(busy)
    try:
        os.link(held.path, target)  # fails where a file is: no overwrite, unlike rename
    except FileExistsError:
        raise ConfigError(f"{target} exists; a backup never overwrites a file") from None
    except OSError:  # a file system without hard links: rename, as the last resort
        if os.path.lexists(target):
            raise ConfigError(f"{target} exists; a backup never overwrites a file") from None
        os.replace(held.path, target)
        return
    held.path.unlink()


def _copy(source: Path, partial: Path) -> None:
    def copy(frozen: str | None) -> None:
        # Frozen: a backup on read-only media, copied back to writable storage.
        if frozen is not None:
            return _copy_from(connect_frozen(frozen), partial)
        return _copy_from(sqlite3.connect(source, timeout=BUSY_TIMEOUT_MS / 1000), partial)

    or_frozen(str(source), copy)


def _copy_from(src: sqlite3.Connection, partial: Path) -> None:
    dst = sqlite3.connect(partial)
    try:
        src.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        # pages=-1: the whole file in one step, i.e. one read transaction and one
        # consistent state. Stepping page by page would restart on every commit the
        # proxy makes meanwhile, and could never finish under load.
        src.backup(dst, pages=-1)
    finally:
        dst.close()
        src.close()


def _check(partial: Path, target: Path) -> BackupResult:
    conn = sqlite3.connect(partial, isolation_level=None)
    try:
        problems = [row[0] for row in conn.execute("PRAGMA integrity_check")]
        if problems != ["ok"]:
            raise LedgerUnavailable(f"the copy failed its integrity check: {problems[:5]}")
        # The copy keeps the ledger's WAL mode; fold any WAL into the file so that the
        # one file at PATH is the whole backup.
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        # A row may hold an operation's run of events (ledger/sqliterecords).
        events, head_seq = conn.execute(
            f"SELECT coalesce(sum({ROW_EVENTS}), 0), coalesce(max(seq), 0) FROM events e"
        ).fetchone()
        row = conn.execute("SELECT digest FROM events WHERE seq = ?", (head_seq,)).fetchone()
    finally:
        conn.close()
    return BackupResult(
        path=str(target),
        events=int(events),
        head_seq=int(head_seq),
        head_digest=hex_digest(row[0]) if row else "",
        bytes=partial.stat().st_size,
    )


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def cmd_backup(args: argparse.Namespace) -> int:
    """``effectguard backup PATH [--ledger L] [--json]``."""
    ledger: str = args.ledger
    if ledger.startswith(("postgresql://", "postgres://", "memory://")):
        raise ConfigError(
            "backup copies SQLite ledgers; back up PostgreSQL with pg_dump or "
            "point-in-time recovery (see the operations docs)"
        )
    result = backup_sqlite(ledger, args.path)
    if args.json:
        print(json.dumps(asdict(result), indent=2))
    else:
        say(
            f"backup {result.path}: {result.events} events up to event {result.head_seq} "
            f"(digest {result.head_digest}), {result.bytes} bytes"
        )
    return 0
