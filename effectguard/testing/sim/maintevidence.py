"""The evidence ``--maintenance`` adds: archived events, verified copies and files.

Read once every process has stopped. The events an archive moved out of the live
ledger are read back from its files (SQLite) or its ``archived_events`` table
(PostgreSQL) and put before the live ones, so every other invariant judges the whole
history, archived calls included; each backup that exited 0 and each archive file is
handed to ``effectguard verify`` (``verify --archived`` for PostgreSQL's table), run as
its own process.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from effectguard.ledger.pgtarget import Target
from effectguard.ledger.rows import EVENT_COLUMNS, event_from_row
from effectguard.rules.events import StoredEvent
from effectguard.rules.workstate import work_state
from effectguard.testing.sim.cluster import Cluster
from effectguard.testing.sim.evidence import Evidence, run_verify
from effectguard.testing.sim.maintenance import ALLOWED_EXITS, archive_files, no_effect_statuses

__all__ = [
    "ARCHIVE_TABLE",
    "add_maintenance",
    "maintenance_failures",
    "read_archived_events",
    "read_archived_table",
]

#: What a PostgreSQL ledger's archive checks are named by: the table its archives fill.
ARCHIVE_TABLE = "archived_events"


def read_archived_events(path: Path) -> list[StoredEvent]:
    """The event lines of an archive file (not its header, body lines or checkpoint line;
    the checkpoint is a live event until a later archive moves it)."""
    events = []
    with gzip.open(path, "rt", encoding="utf-8") as src:
        next(src, None)  # the header
        for row in src:
            line: dict[str, Any] = json.loads(row)
            if "body" not in line and "checkpoint" not in line:
                events.append(StoredEvent(**line))
    return events


def read_archived_table(url: str) -> list[StoredEvent]:
    """The events a PostgreSQL ledger's archives moved into ``archived_events``, in
    order (read with the ledger's own row reader, as the live events are)."""
    conn = Target.parse(url).connect()
    try:
        rows = conn.execute(f"SELECT {EVENT_COLUMNS} FROM {ARCHIVE_TABLE} ORDER BY seq")
        return [event_from_row(row) for row in rows.fetchall()]
    finally:
        conn.close()


def add_maintenance(evidence: Evidence, cluster: Cluster) -> Evidence:
    """``evidence`` with the archived history, the copies' and files' verification, the
    maintenance commands that failed, and the providers' no-effect statuses."""
    sqlite = cluster.schedule.ledger == "sqlite"
    files = archive_files(cluster.ledger) if sqlite else []
    if sqlite:
        archived = sorted((e for f in files for e in read_archived_events(f)), key=lambda e: e.seq)
    else:  # nothing to read unless an archive ran
        archived = read_archived_table(cluster.ledger) if cluster.maintenance else []
    by_call: dict[str, list[StoredEvent]] = defaultdict(list)
    for e in archived:
        if e.call_id is not None:
            by_call[e.call_id].append(e)
    live = {c.call_id for c in evidence.calls}
    calls = [work_state(e.event for e in evs) for c, evs in by_call.items() if c not in live]
    return dataclasses.replace(
        evidence,
        events=archived + evidence.events,
        calls=calls + evidence.calls,
        archived_calls=frozenset(by_call),
        backup_checks=_backups(cluster),
        archive_checks=_archives(cluster, files) if sqlite else _archive_table(cluster, archived),
        maintenance_failures=maintenance_failures(cluster.actions),
        no_effect=no_effect_statuses(cluster.workdir),
    )


def _backups(cluster: Cluster) -> list[tuple[str, int, str]]:
    done = [str(a["path"]) for a in cluster.actions if a["action"] == "backup"]
    return [(path, *run_verify(path)) for path in done]


def _archives(cluster: Cluster, files: list[Path]) -> list[tuple[str, int, str]]:
    found = {str(f) for f in files}
    named = {str(f) for a in cluster.actions if a["action"] == "archive" for f in a["files"]}
    out = [(f, *run_verify(cluster.ledger, "--archive", f)) for f in sorted(found)]
    return out + [(f, -1, "named by an archive that exited 0; not there") for f in named - found]


def _archive_table(cluster: Cluster, archived: list[StoredEvent]) -> list[tuple[str, int, str]]:
    """``verify --archived`` of a PostgreSQL ledger's archive tables (each range checked
    as a file would be, tied to the live chain), once they hold events or an archive
    exited 0 (one that failed keeps the steps it committed before)."""
    if not archived and not any(a["action"] == "archive" for a in cluster.actions):
        return []
    return [(ARCHIVE_TABLE, *run_verify(cluster.ledger, "--archived"))]


def maintenance_failures(actions: list[dict[str, Any]]) -> list[str]:
    """The maintenance commands that exited with a code not documented for them, or
    printed a traceback."""
    out = []
    for a in actions:
        kind = str(a["action"]).removesuffix("_failed")
        allowed = ALLOWED_EXITS.get(kind)
        if allowed is None or not str(a["action"]).endswith("_failed"):
            continue
        if a.get("crashed") or a.get("code") not in allowed:
            out.append(f"{kind} at {a['at']} s exit {a.get('code')}: {a.get('error')}")
    return out
