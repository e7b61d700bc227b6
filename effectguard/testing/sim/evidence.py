"""What a finished run leaves behind, gathered into one value the invariants read.

Three sources, two of which effectguard did not write: the fake provider's
fsync'd receipts, the clients' answers, and the ledger itself (read through
:mod:`effectguard.ledger`), plus the exit code of ``effectguard verify`` run
as its own process.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from effectguard.ledger import Ledger
from effectguard.rules.events import StoredEvent
from effectguard.rules.workstate import WorkState
from effectguard.testing.receiptfile import read_receipts
from effectguard.testing.sim.clients import Answer

__all__ = ["Evidence", "collect", "run_verify"]

_PAGE = 5000


@dataclass
class Evidence:
    """Everything the invariants look at."""

    events: list[StoredEvent] = field(default_factory=list)
    calls: list[WorkState] = field(default_factory=list)
    receipts: list[dict[str, Any]] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)
    verify_code: int = 0
    verify_output: str = ""
    #: Replicas still running after the schedule that never answered ``/healthz`` 200
    #: by themselves (:func:`effectguard.testing.sim.runner.quiesce`).
    unrecovered: list[int] = field(default_factory=list)
    #: The operator's commands (``--operator``) that exited other than 0 or 4 (the ledger
    #: unavailable): what was run, its exit code and its last words.
    operator_failures: list[str] = field(default_factory=list)
    #: The operator's key commands that exited 0 (``--operator``): ``action``
    #: (``key_new``, ``key_revoke``), ``name``, and ``began``/``returned`` (wall clock).
    key_actions: list[dict[str, Any]] = field(default_factory=list)
    #: ``--maintenance``: the calls whose events an archive moved out of the live ledger
    #: (their events are in :attr:`events`, read back from the archive files).
    archived_calls: frozenset[str] = frozenset()
    #: ``effectguard verify`` of each backup that exited 0: (copy, exit code, output).
    backup_checks: list[tuple[str, int, str]] = field(default_factory=list)
    #: ``effectguard verify --archive FILE --ledger L`` of each archive file: (file, exit
    #: code, output); a file an archive that exited 0 named and is not there has code -1.
    archive_checks: list[tuple[str, int, str]] = field(default_factory=list)
    #: The maintenance commands that exited with a code their command does not document
    #: for it, or printed a traceback: what was run, its exit code and its last words.
    maintenance_failures: list[str] = field(default_factory=list)
    #: Provider name -> the statuses that prove a request did nothing (declared not
    #: processed, or transient "none"): an authorized resend answered so is spent on nothing.
    no_effect: dict[str, frozenset[int]] = field(default_factory=dict)
    #: ``--clock-steps``: each clock step, in order: ``target`` (``host``, ``db`` or
    #: ``replica`` with ``replica``), ``step``, ``offset`` (the clock's offset after it),
    #: ``began``/``returned`` (real time before the step, and by which every process reads
    #: it: libfaketime caches an offset for a second), and ``ledger``: whether the ledger's
    #: clock moved (SQLite: the host's; PostgreSQL: the database's, not a replica host's).
    clock_steps: list[dict[str, Any]] = field(default_factory=list)


def run_verify(ledger: str, *more: str) -> tuple[int, str]:
    """``python -m effectguard verify --ledger L [MORE]`` as its own process: exit code,
    output."""
    done = subprocess.run(
        [sys.executable, "-m", "effectguard", "verify", "--ledger", ledger, *more],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    return done.returncode, done.stdout + done.stderr


async def read_ledger(ledger: str) -> tuple[list[StoredEvent], list[WorkState]]:
    """Every event in order and every call's state."""
    events: list[StoredEvent] = []
    async with Ledger.open(ledger) as opened:
        while page := await opened.store.events_after(events[-1].seq if events else 0, _PAGE):
            events += page
        calls = await opened.store.list_calls(None, None, 10**9)
    return events, calls


async def collect(
    ledger: str,
    receipts: Path,
    answers: list[Answer],
    unrecovered: list[int],
    operator_failures: list[str] | None = None,
    key_actions: list[dict[str, Any]] | None = None,
) -> Evidence:
    """Gather the evidence of a run whose processes have all stopped."""
    events, calls = await read_ledger(ledger)
    code, output = run_verify(ledger)
    receipts_read = read_receipts(receipts)
    failures = operator_failures or []
    return Evidence(
        events,
        calls,
        receipts_read,
        answers,
        code,
        output,
        unrecovered,
        failures,
        key_actions or [],
    )
