"""SQLite-only behaviour of the ledger: WAL housekeeping and caches shared across batches.

The contract suite (test_store_contract.py) covers what every store must do;
these tests cover how the SQLite store does it, through the ledger API and the
files it leaves on disk.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
from pathlib import Path

import pytest
from admitkit import admit_request

from effectguard.errors import FencedError
from effectguard.ledger import AdmitRequest, Ledger, Writer, inlinecommit, operations, sqlitesession

R = 1_000


def _req(n: int, root: str = "wal") -> AdmitRequest:
    body = '{"messages": [{"role": "user", "content": "' + "x" * 400 + '"}]}'
    return admit_request(f"{root}/run", request_hash=f"hash-{n}", body=body, reserve=R)


async def _writer(ledger: Ledger, name: str) -> Writer:
    return await ledger.store.write(
        Writer("boot", 0),
        lambda tx: operations.register_worker(tx, worker=name, host="h", pid=1, lease_s=30.0),
    )


async def _wal_after_admissions(path: Path, count: int) -> int:
    async with Ledger.open(str(path)) as ledger:
        writer = await _writer(ledger, "w")
        for n in range(count):
            admitted = await ledger.admit(writer, _req(n))
            assert admitted.action == "admit"
        return os.path.getsize(f"{path}-wal")


async def test_the_writers_checkpoint_lets_the_wal_start_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Checkpointing after every batch: each transaction reuses the WAL from its start.
    monkeypatch.setattr(sqlitesession, "CHECKPOINT_EVERY_S", 0.0)
    bounded = await _wal_after_admissions(tmp_path / "on.db", 150)
    # The control: with no checkpoint, the same writes pile up in the WAL.
    monkeypatch.setattr(sqlitesession, "CHECKPOINT_EVERY_S", 1e9)
    growing = await _wal_after_admissions(tmp_path / "off.db", 150)
    assert growing > 150 * 4096  # at least a page per admission
    assert bounded < growing / 10


async def test_the_wal_shrinks_back_once_a_long_reader_lets_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A WAL grown while a long reader (verify, a backup) held checkpoints back shrinks
    to the journal size limit once the reader ends and the writer starts it over, rather
    than staying at its largest until the process stops."""
    monkeypatch.setattr(sqlitesession, "CHECKPOINT_EVERY_S", 0.0)
    monkeypatch.setattr(sqlitesession, "JOURNAL_SIZE_LIMIT", 64 << 10)
    path = tmp_path / "reader.db"
    async with Ledger.open(str(path)) as ledger:
        writer = await _writer(ledger, "w")
        await ledger.admit(writer, _req(0))
        reader = sqlite3.connect(path)
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM events").fetchone()  # a snapshot, held
        for n in range(1, 300):
            await ledger.admit(writer, _req(n))
        grown = os.path.getsize(f"{path}-wal")
        reader.close()
        for n in range(300, 303):  # checkpoint past the reader, then a write starts over
            await ledger.admit(writer, _req(n))
        assert grown > 1 << 20
        assert os.path.getsize(f"{path}-wal") <= 64 << 10


async def test_another_connections_commit_reaches_this_writers_cached_budget(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "shared.db")
    async with Ledger.open(path) as ours, Ledger.open(path) as theirs:
        writer = await _writer(ours, "ours")
        assert (await ours.admit(writer, _req(1))).action == "admit"  # budget rows now cached
        await theirs.set_limit("wal", 2 * R)  # room for one more call
        assert (await ours.admit(writer, _req(2))).action == "admit"
        third = await ours.admit(writer, _req(3))
        assert third.action == "refuse"
        assert third.refusal is not None and third.refusal.status == 402


async def test_another_connections_fencing_reaches_this_writers_cached_worker_row(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "fenced.db")
    async with Ledger.open(path) as ours, Ledger.open(path) as theirs:
        writer = await _writer(ours, "ours")
        assert (await ours.admit(writer, _req(1))).action == "admit"  # worker row now cached
        await theirs.store.write(
            Writer("operator", 0),
            lambda tx: operations.register_worker(tx, worker="ours", host="h", pid=2, lease_s=30.0),
        )  # re-registered elsewhere: a new generation fences the old writer
        with pytest.raises(FencedError):
            await ours.admit(writer, _req(2))


async def _quiet_spell(ledger: Ledger, writer: Writer) -> None:
    """Admissions one at a time, enough for the committer to see a quiet spell."""
    for n in range(inlinecommit.QUIET + 1):
        assert (await ledger.admit(writer, _req(n))).action == "admit"


async def test_a_lone_caller_commits_in_its_own_step(tmp_path: Path) -> None:
    """Once callers come one at a time, an admission commits before the loop runs anything else."""
    async with Ledger.open(str(tmp_path / "lone.db")) as ledger:
        writer = await _writer(ledger, "w")
        await _quiet_spell(ledger, writer)
        ran: list[str] = []
        asyncio.get_running_loop().call_soon(ran.append, "another task's step")
        admitted = await ledger.admit(writer, _req(100))
        assert admitted.action == "admit"
        assert ran == []  # no loop iteration between the submit and the durable answer
        assert (await ledger.store.get_call(admitted.call_id)) is not None


async def test_concurrent_callers_share_commits_again_after_a_quiet_spell(tmp_path: Path) -> None:
    """After a quiet spell, 100 concurrent admissions commit in at most RESAMPLE + 1 commits."""
    async with Ledger.open(str(tmp_path / "burst.db")) as ledger:
        writer = await _writer(ledger, "w")
        await _quiet_spell(ledger, writer)
        stats = ledger.store.committer.stats  # type: ignore[attr-defined]
        before = stats.commits
        results = await asyncio.gather(*(ledger.admit(writer, _req(1000 + n)) for n in range(100)))
        assert all(r.action == "admit" for r in results)
        assert stats.commits - before <= inlinecommit.RESAMPLE + 1
