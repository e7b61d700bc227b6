"""``verify`` checks the bodies stored by reference: each manifest's body is stored, whole,
and hashes to the digest the manifest names; a body no manifest names is an orphan.
Seeded corruptions of a SQLite ledger, each caught and named."""

from __future__ import annotations

import io
import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from bodykit import RESERVE, spooled, upload_request

from effectguard.errors import BodyMismatch
from effectguard.ledger import Ledger, Writer, operations, sqliteevents
from effectguard.ops.verify import VerifyReport, verify_ledger
from effectguard.rules.bodyref import CHUNK_BYTES

R = RESERVE


@dataclass(frozen=True)
class Built:
    """A SQLite ledger with two bodies stored by reference, an inline one and a refused one."""

    path: Path
    uploaded: str  # a 600 KiB body: three chunks
    small: str  # a 10-byte body: one chunk
    refused: str


@pytest.fixture
async def built(tmp_path: Path) -> Built:
    path = tmp_path / "l.db"
    async with Ledger.open(str(path)) as ledger:
        writer: Writer = await ledger.store.write(
            Writer("boot", 0),
            lambda tx: operations.register_worker(tx, worker="w", host="h", pid=1, lease_s=60),
        )
        await ledger.set_limit("poor", 0)
        big = spooled(tmp_path / "big", os.urandom(600 * 1024))
        uploaded = await ledger.admit(writer, upload_request(big, request_hash="h-big"))
        tiny = spooled(tmp_path / "s", b"0123456789")
        small = await ledger.admit(writer, upload_request(tiny, request_hash="h-small"))
        await ledger.admit(writer, upload_request(None, request_hash="h-inline"))
        poor = upload_request(big, request_hash="h-ref", budget="poor/run")
        refused = await ledger.admit(writer, poor)
        assert (uploaded.action, small.action, refused.action) == ("admit", "admit", "refuse")
    return Built(path, uploaded.call_id, small.call_id, refused.call_id)


@contextmanager
def raw(path: Path) -> Iterator[sqlite3.Connection]:
    """The ledger file opened behind the store's back."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        yield conn
    finally:
        conn.close()


async def verify(path: Path) -> VerifyReport:
    async with Ledger.open(str(path)) as ledger:
        return await verify_ledger(ledger)


async def test_a_ledger_with_bodies_stored_by_reference_verifies(built: Built) -> None:
    """Stored bodies, an inline one and a refused call without its body: no problem."""
    report = await verify(built.path)
    assert report.ok, report.problems


async def test_a_changed_chunk_byte_is_named(built: Built) -> None:
    """One byte of one chunk changed: the body no longer hashes to its manifest's digest."""
    key = sqliteevents.call_key(built.uploaded)
    with raw(built.path) as conn:
        (chunk,) = conn.execute(
            "SELECT chunk FROM call_bodies WHERE call_id = ? AND seq = 1", (key,)
        ).fetchone()
        changed = bytes([chunk[0] ^ 1]) + chunk[1:]
        conn.execute("DROP TRIGGER call_bodies_no_update")
        conn.execute(
            "UPDATE call_bodies SET chunk = ? WHERE call_id = ? AND seq = 1", (changed, key)
        )
    report = await verify(built.path)
    assert len(report.problems) == 1, report.problems
    assert report.problems[0].startswith(f"call {built.uploaded}: body digest mismatch: its ")


async def test_a_missing_chunk_is_named(built: Built) -> None:
    """A middle chunk deleted: verify names the missing chunk by its number."""
    with raw(built.path) as conn:
        conn.execute(
            "DELETE FROM call_bodies WHERE call_id = ? AND seq = 1",
            (sqliteevents.call_key(built.uploaded),),
        )
    report = await verify(built.path)
    assert report.problems == [
        f"call {built.uploaded}: body chunk missing: chunk 1 of its body is not stored "
        "(chunks stored: 2)"
    ]


async def test_a_missing_body_is_named(built: Built) -> None:
    """Every chunk of a body deleted: the manifest names a body that is not stored."""
    with raw(built.path) as conn:
        conn.execute(
            "DELETE FROM call_bodies WHERE call_id = ?", (sqliteevents.call_key(built.small),)
        )
    report = await verify(built.path)
    assert len(report.problems) == 1
    assert report.problems[0].startswith(f"call {built.small}: body missing: its manifest")


@pytest.mark.parametrize("owner", ["unknown", "refused"])
async def test_an_orphan_body_is_named(built: Built, owner: str) -> None:
    """Chunks stored for a call no manifest names by reference (or for a refused call,
    which keeps none) are an orphan body."""
    call_id = "call_" + "ab" * 16 if owner == "unknown" else built.refused
    with raw(built.path) as conn:
        conn.execute(
            "INSERT INTO call_bodies(call_id, seq, chunk) VALUES (?, 0, ?)",
            (sqliteevents.call_key(call_id), b"x" * 5),
        )
    report = await verify(built.path)
    why = "no manifest names it" if owner == "unknown" else "a refused call keeps none"
    assert report.problems == [f"call {call_id}: orphan body: 5 bytes stored, but {why}"]


async def test_copy_body_refuses_a_body_with_a_missing_chunk(built: Built) -> None:
    """A body with a gap is never streamed out (a resend would send other bytes)."""
    with raw(built.path) as conn:
        conn.execute(
            "DELETE FROM call_bodies WHERE call_id = ? AND seq = 0",
            (sqliteevents.call_key(built.uploaded),),
        )
    async with Ledger.open(str(built.path)) as ledger:
        with pytest.raises(BodyMismatch, match="lacks chunk 0"):
            await ledger.store.copy_body(built.uploaded, io.BytesIO())


def test_chunk_size_is_what_the_fixture_assumes() -> None:
    """The 600 KiB body is three chunks (two whole and a tail)."""
    assert 2 * CHUNK_BYTES < 600 * 1024 < 3 * CHUNK_BYTES
