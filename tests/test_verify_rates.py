"""``effectguard verify`` re-derives the rate windows from the events (docs/contract.md §5.6).

A SQLite ledger on a manual clock counts attempts and token estimates in two minutes,
with one settlement that corrects its estimate in the same minute and one that comes
after the window moved on. Verify agrees with the stored ``rate_windows`` rows; a row
edited or deleted behind the ledger's back makes ``effectguard verify`` exit 1 naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pgkit import ledger_url
from test_store_contract import completion
from test_verify import raw, request

from effectguard.ledger import Ledger, Writer, operations, rates
from effectguard.ledger.pgschema import Target
from effectguard.ops.audit import RateRow, Verifier, checkpoint
from effectguard.ops.cli import main as cli_main
from effectguard.rules.budget import BudgetPolicy
from effectguard.rules.events import BudgetSettled, Event
from effectguard.testing.clock import ManualClock
from effectguard.testing.pgclock import set_ledger_clock

_ = (ledger_url,)  # fixtures


def _settled_at(call_id: str, tokens: int) -> list[Event]:
    """A completion whose settlement reports ``tokens`` (the estimate's correction)."""
    events = completion(call_id, "team/run", 700)
    settled = events[1]
    assert isinstance(settled, BudgetSettled)
    events[1] = dataclasses.replace(settled, tokens=tokens)
    return events


async def _build(path: Path) -> None:
    """Windows on ``team`` (rpm) and ``team/run`` (tpm) over two minutes of the clock."""
    clock = ManualClock(start=600_000.0 + 1)  # one second into a minute
    async with Ledger.open(str(path), clock=clock) as ledger:
        writer: Writer = await ledger.store.write(
            Writer("boot", 0),
            lambda tx: operations.register_worker(tx, worker="w1", host="h", pid=1, lease_s=1e6),
        )
        await ledger.set_policy(BudgetPolicy("team", rpm=100))
        await ledger.set_policy(BudgetPolicy("team/run", tpm=100_000))
        first = await ledger.admit(writer, dataclasses.replace(request("a"), tokens=800))
        await ledger.record(writer, first.call_id, 1, _settled_at(first.call_id, 30))
        slow = await ledger.admit(writer, dataclasses.replace(request("b"), tokens=500))
        clock.advance(60)
        last = await ledger.admit(writer, dataclasses.replace(request("c"), tokens=200))
        # Settled after its window moved on to the next minute: nothing to correct there.
        await ledger.record(writer, slow.call_id, 1, _settled_at(slow.call_id, 10))
        await ledger.record(writer, last.call_id, 1, _settled_at(last.call_id, 50))


def verify_cli(path: Path) -> tuple[int, dict[str, Any]]:
    """``effectguard verify --ledger PATH --json`` in this process: exit code and report."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli_main(["verify", "--ledger", str(path), "--json"])
    return code, json.loads(out.getvalue())


@pytest.fixture
async def ledger_path(tmp_path: Path) -> Path:
    """The ledger, built and closed."""
    path = tmp_path / "ledger.db"
    await _build(path)
    return path


def test_verify_agrees_with_the_windows_the_store_kept(ledger_path: Path) -> None:
    """The store's windows (corrected in their minute, not after it) are the events' fold."""
    with raw(ledger_path) as conn:
        rows = sorted(conn.execute("SELECT path, minute, requests, tokens FROM rate_windows"))
    assert rows == [("team", 10_001, 1, 50), ("team/run", 10_001, 1, 50)]
    code, report = verify_cli(ledger_path)
    assert code == 0 and report["ok"], report


@pytest.mark.parametrize(
    ("path", "edit"),
    [
        ("team", "UPDATE rate_windows SET requests = requests + 1 WHERE path = ?"),
        ("team/run", "UPDATE rate_windows SET tokens = tokens + 150 WHERE path = ?"),
        ("team/run", "UPDATE rate_windows SET minute = minute - 1 WHERE path = ?"),
        ("team/run", "UPDATE rate_windows SET reached = reached + 1 WHERE path = ?"),
        ("team", "DELETE FROM rate_windows WHERE path = ?"),
        (
            "team/other",
            "INSERT INTO rate_windows(path, minute, requests, tokens) VALUES (?, 1, 1, 1)",
        ),
    ],
)
def test_an_edited_rate_window_is_named(ledger_path: Path, path: str, edit: str) -> None:
    """A rate window that is not the fold of the events makes verify exit 1 naming its node."""
    with raw(ledger_path) as conn:
        conn.execute(edit, (path,))
    code, report = verify_cli(ledger_path)
    assert code == 1 and not report["ok"]
    assert len(report["problems"]) == 1, report["problems"]
    assert report["problems"][0].startswith(f"rate window {path!r}: stored "), report["problems"]


def test_windows_are_verified_across_an_archive_cut(ledger_path: Path) -> None:
    """The archive's checkpoint carries the windows its events left, so after the cut verify
    still re-derives them: the live ledger and the file verify, and an edit is named."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli_main(
            ["archive", "--ledger", str(ledger_path), "--before", "2100-01-01", "--json"]
        )
    assert code == 0, out.getvalue()
    moved = json.loads(out.getvalue())
    assert moved["calls"] == 3
    code, report = verify_cli(ledger_path)
    assert code == 0, report["problems"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli_main(["verify", "--ledger", str(ledger_path), "--archive", moved["path"]]) == 0
    with raw(ledger_path) as conn:
        conn.execute("UPDATE rate_windows SET requests = requests + 1 WHERE path = 'team'")
    code, report = verify_cli(ledger_path)
    assert code == 1 and report["problems"][0].startswith("rate window 'team': stored ")


def test_a_checkpoint_without_windows_leaves_windows_it_cannot_know_unjudged() -> None:
    """A checkpoint written before windows were carried: a window counted before the cut is
    unknown, so it is not reported; one restarted by a reservation after the cut is judged."""
    state = checkpoint.export_state(Verifier())
    del state["rates"]
    verifier = Verifier()
    checkpoint.seed(verifier, state, next_seq=1, prev_digest="0" * 64)
    before_cut = RateRow("team", 5, 3, 30)
    report = verifier.finish([], [], rate_rows=[before_cut])
    assert report.ok, report.problems
    verifier.rates.restarted.add("team")  # as a reservation after the cut would
    report = verifier.finish([], [], rate_rows=[before_cut])
    assert report.problems == [
        "rate window 'team': stored minute=5 requests=3 tokens=30 but the events give no window"
    ]


@contextlib.contextmanager
def _raw_any(url: str) -> Iterator[Any]:
    """A raw connection to a SQLite file or to a PostgreSQL ledger's schema (autocommit)."""
    if not url.startswith("postgresql://"):
        with raw(Path(url)) as conn:
            yield conn
        return
    target = Target.parse(url)
    with target.connect() as conn:
        yield conn


def _as_format_1_counted(
    url: str, monkeypatch: pytest.MonkeyPatch, clock: ManualClock
) -> tuple[Writer, str]:
    """A ledger a release of writer format 1 wrote, then this release migrated: that
    release started no window at a declaration, so the settlement of a call admitted
    before ``tpm`` was declared corrected the window the next admission started. It is
    this release's store without the start, on the schema migration 18 (PostgreSQL: 11)
    found: no ``since`` (nor ``reached``, migration 23, PostgreSQL: 16), no migration.
    Returns the writer and the call left in flight."""

    async def write() -> tuple[Writer, str]:
        async with _open(url, clock) as ledger:
            writer: Writer = await ledger.store.write(
                Writer("boot", 0),
                lambda tx: operations.register_worker(
                    tx, worker="w1", host="h", pid=1, lease_s=1e6
                ),
            )
            before = await ledger.admit(writer, dataclasses.replace(request("a"), tokens=800))
            await ledger.set_policy(BudgetPolicy("team", tpm=1000))
            flying = await ledger.admit(writer, dataclasses.replace(request("b"), tokens=800))
            await ledger.record(writer, before.call_id, 1, _settled_at(before.call_id, 30))
            return writer, flying.call_id

    monkeypatch.setattr(rates, "fold_declared", lambda *args: None)
    writer, flying = asyncio.run(write())
    monkeypatch.undo()
    versions = (11, 16) if url.startswith("postgresql://") else (18, 23)
    with _raw_any(url) as conn:
        conn.execute("ALTER TABLE rate_windows DROP COLUMN since")
        conn.execute("ALTER TABLE rate_windows DROP COLUMN reached")
        conn.execute(f"DELETE FROM migrations WHERE version IN {versions}")
    assert cli_main(["migrate", "--ledger", url]) == 0
    return writer, flying


def _open(url: str, clock: ManualClock) -> Any:
    """The ledger at ``url`` on ``clock`` (PostgreSQL's is the database's, moved to it)."""
    if url.startswith("postgresql://"):
        set_ledger_clock(url, clock())
        return Ledger.open(url)
    return Ledger.open(url, clock=clock)


def _windows(url: str) -> list[tuple[Any, ...]]:
    with _raw_any(url) as conn:
        return [tuple(r) for r in conn.execute("SELECT requests, tokens, since FROM rate_windows")]


def test_a_window_a_format_1_release_counted_verifies_after_migration(
    ledger_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Migration 18 (PostgreSQL: 11) leaves ``since`` NULL in the windows it finds: verify
    judges them as the release that counted them did, so the ledger verifies; the same
    window marked as this release's (``since`` 0) is named. This release then counts on
    in that minute as that release did, and a new minute starts a window of its own."""
    minute = (int(time.time()) // 60 + 1) * 60
    clock = ManualClock(start=minute + 1.0)
    _as_format_1_counted(ledger_url, monkeypatch, clock)
    assert _windows(ledger_url) == [(1, 30, None)]
    with _raw_any(ledger_url) as conn:
        conn.execute("UPDATE rate_windows SET since = 0")
    code, report = verify_cli(ledger_url)
    assert code == 1 and report["problems"][0].startswith("rate window 'team': stored "), report
    with _raw_any(ledger_url) as conn:
        conn.execute("UPDATE rate_windows SET since = NULL")
    assert verify_cli(ledger_url)[0] == 0

    async def count_on(key: str) -> None:
        async with _open(ledger_url, clock) as ledger:
            writer: Writer = await ledger.store.write(
                Writer("boot", 0),
                lambda tx: operations.register_worker(
                    tx, worker=f"w-{key}", host="h", pid=1, lease_s=1e6
                ),
            )
            await ledger.admit(writer, dataclasses.replace(request(key), tokens=100))

    asyncio.run(count_on("c"))
    assert _windows(ledger_url) == [(1 + 1, 130, None)]
    clock.advance(60)
    asyncio.run(count_on("d"))
    assert _windows(ledger_url) == [(1, 100, 0)]
    assert verify_cli(ledger_url)[0] == 0


def test_a_window_a_format_1_release_counted_verifies_across_an_archive_cut(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An archive cut after migration 18 carries a window whose ``since`` is NULL without
    it, as an older release's checkpoint did: the live ledger and the archive verify."""
    path = tmp_path / "ledger.db"
    writer, flying = _as_format_1_counted(str(path), monkeypatch, ManualClock(600_000.0 + 1))

    async def settle() -> None:
        async with Ledger.open(str(path), clock=ManualClock(start=600_000.0 + 3)) as ledger:
            await ledger.record(writer, flying, 1, _settled_at(flying, 50))

    asyncio.run(settle())
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli_main(["archive", "--ledger", str(path), "--before", "2100-01-01", "--json"])
    assert code == 0, out.getvalue()
    moved = json.loads(out.getvalue())
    code, report = verify_cli(path)
    assert code == 0, report["problems"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli_main(["verify", "--ledger", str(path), "--archive", moved["path"]]) == 0
