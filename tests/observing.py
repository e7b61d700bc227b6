"""Observing a running effectguard from a test: poll until something holds, read the
CLI's JSON in this process (its own entry point, so no subprocess start-up), and read a
SQLite ledger's events and call stages beside the processes that write it."""

from __future__ import annotations

import contextlib
import io
import json
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from effectguard.ledger import sqliteevents
from effectguard.ledger.sqliterecords import events_from_row
from effectguard.ops.cli import main as cli_main


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``predicate`` until it is truthy; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def cli_json(*args: str) -> Any:
    """Run an ``effectguard`` command with ``--json`` in this process; assert exit 0."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli_main([*args, "--json"])
    assert code == 0, out.getvalue()
    return json.loads(out.getvalue())


def ledger_events(ledger: Path) -> list[dict[str, Any]]:
    """Every event of the SQLite ledger at ``ledger``, as plain dicts, read through a
    read-only connection (so a test never takes a write lock the proxies need)."""
    conn = sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)
    try:
        rows = [e for r in conn.execute(sqliteevents.ALL_EVENTS) for e in events_from_row(r)]
        return [
            {
                "seq": e.seq,
                "kind": e.kind,
                "call": e.call_id,
                "data": e.data,
                "worker": e.worker,
                "at": e.at,
            }
            for e in rows
        ]
    finally:
        conn.close()


def call_stages(ledger: Path) -> dict[str, str]:
    """Every live call's stage in the SQLite ledger at ``ledger``, read-only."""
    conn = sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT call_id, stage FROM calls").fetchall()
        return {str(sqliteevents.call_from_key(key)): stage for key, stage in rows}
    finally:
        conn.close()
