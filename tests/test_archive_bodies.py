"""Archived calls' bodies stored by reference move with their events: into the archive
file (SQLite) or the ``archived_bodies`` table (PostgreSQL), out of the live body store;
``verify --archive FILE`` / ``verify --archived`` check them there; a backup copies them."""

from __future__ import annotations

import asyncio
import base64
import gzip
import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest
from admitkit import admit_request
from pgkit import ledger_url
from test_archive import archive, cli
from test_store_contract import completion

from effectguard.ledger import AdmitRequest, Ledger, Writer, operations
from effectguard.ledger.pgschema import Target
from effectguard.rules.bodyref import CHUNK_BYTES, REF_ENCODING, SpooledBody

_ = (ledger_url,)  # fixtures

UPLOAD = os.urandom(600 * 1024)


def _request(n: int, spool: SpooledBody | None, budget: str = "team/run") -> AdmitRequest:
    inline = spool is None
    return admit_request(
        budget,
        endpoint="/v1/files",
        model=None,
        request_hash=f"h{n}",
        key=f"k{n}",
        body="{}" if inline else spool.sha256,
        body_encoding="utf8" if inline else REF_ENCODING,
        spool=spool,
    )


async def _build(url: str, tmp_path: Path) -> str:
    """A completed upload, a completed inline call and a refused upload; the upload's id."""
    path = tmp_path / "upload.bin"
    path.write_bytes(UPLOAD)
    spool = SpooledBody(str(path), len(UPLOAD), hashlib.sha256(UPLOAD).hexdigest())
    async with Ledger.open(url) as ledger:
        writer: Writer = await ledger.store.write(
            Writer("boot", 0),
            lambda tx: operations.register_worker(tx, worker="w", host="h", pid=1, lease_s=60),
        )
        await ledger.set_limit("poor", 0)
        upload = await ledger.admit(writer, _request(1, spool))
        inline = await ledger.admit(writer, _request(2, None))
        for call in (upload, inline):
            await ledger.record(writer, call.call_id, 1, completion(call.call_id, "team/run", 10))
        refused = await ledger.admit(writer, _request(3, spool, budget="poor/run"))
        assert refused.action == "refuse"
        assert len(await ledger.store.body_chunks()) == 3
    return upload.call_id


async def _live_chunks(url: str) -> list[tuple[str, int, int]]:
    async with Ledger.open(url) as ledger:
        return await ledger.store.body_chunks()


def _verify(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str]]:
    code, report = cli(capsys, "verify", *args)
    return code, list(report.get("problems", [report]))


def test_archived_bodies_leave_the_live_store_and_verify_where_they_went(
    ledger_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """After an archive the live store keeps no chunk of the archived calls; the live
    ledger verifies, and so does the archive (file or table) with the bodies in it."""
    asyncio.run(_build(ledger_url, tmp_path))
    moved = archive(ledger_url, capsys)
    assert moved["calls"] == 3
    assert asyncio.run(_live_chunks(ledger_url)) == []
    assert _verify(capsys, "--ledger", ledger_url) == (0, [])
    if ledger_url.startswith("postgresql"):
        assert _verify(capsys, "--archived", "--ledger", ledger_url) == (0, [])
        assert _sql(ledger_url, "SELECT count(*) FROM archived_bodies") == [(3,)]
    else:
        assert _verify(capsys, "--archive", moved["path"], "--ledger", ledger_url) == (0, [])
        assert len(_body_lines(Path(moved["path"]))) == 3


def _body_lines(path: Path) -> list[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as src:
        return [json.loads(r)["body"] for r in src if r.startswith('{"body":')]


def _rewrite(path: Path, change: Any) -> None:
    """Rewrite the archive file with ``change`` applied to each body line's body."""
    with gzip.open(path, "rt", encoding="utf-8") as src:
        rows = src.read().splitlines()
    out = []
    for row in rows:
        if row.startswith('{"body":'):
            body = change(json.loads(row)["body"])
            if body is None:
                continue
            row = json.dumps({"body": body}, sort_keys=True, separators=(",", ":"))
        out.append(row)
    with gzip.open(path, "wt", encoding="utf-8") as dst:
        dst.write("\n".join(out) + "\n")


def _flip(body: dict[str, Any]) -> dict[str, Any]:
    if body["seq"] != 1:
        return body
    chunk = base64.b64decode(body["chunk"])
    changed = bytes([chunk[0] ^ 1]) + chunk[1:]
    return {**body, "chunk": base64.b64encode(changed).decode()}


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (_flip, "body digest mismatch"),
        (lambda b: None if b["seq"] == 1 else b, "body chunk missing: chunk 1"),
        (lambda b: None, "body missing"),
    ],
    ids=["changed byte", "missing chunk", "missing body"],
)
def test_a_tampered_body_in_an_archive_file_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: Any, named: str
) -> None:
    """A body line of an archive file changed or dropped: verify --archive names it."""
    ledger = str(tmp_path / "l.db")
    upload = asyncio.run(_build(ledger, tmp_path))
    path = Path(archive(ledger, capsys)["path"])
    assert {b["seq"] for b in _body_lines(path)} == {0, 1, 2}
    _rewrite(path, change)
    code, problems = _verify(capsys, "--archive", str(path))
    assert code == 1
    assert [p for p in problems if p.startswith(f"call {upload}: {named}")] == problems, problems


def _sql(url: str, *statements: str) -> list[tuple[Any, ...]]:
    """Run ``statements`` in the ledger's schema with triggers off; the last one's rows."""
    conn = Target.parse(url).connect()
    try:
        conn.execute("BEGIN")
        conn.execute("SET LOCAL session_replication_role = replica")
        rows: list[tuple[Any, ...]] = []
        for statement in statements:
            cursor = conn.execute(statement)
            rows = cursor.fetchall() if cursor.description else []
        conn.execute("COMMIT")
        return rows
    finally:
        conn.close()


def test_a_tampered_body_in_the_archive_table_is_named(
    ledger_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """PostgreSQL: a changed archived chunk, and an archived body of no archived call,
    are named by verify --archived."""
    if not ledger_url.startswith("postgresql"):
        pytest.skip("the archive table is PostgreSQL's")
    upload = asyncio.run(_build(ledger_url, tmp_path))
    archive(ledger_url, capsys)
    _sql(
        ledger_url,
        "UPDATE archived_bodies SET chunk = overlay(chunk placing "
        "decode(CASE WHEN get_byte(chunk, 0) = 0 THEN '01' ELSE '00' END, 'hex') "
        f"from 1 for 1) WHERE call_id = '{upload}' AND seq = 1",
        "INSERT INTO archived_bodies VALUES ('call_" + "ab" * 16 + "', 0, '\\x00')",
    )
    code, problems = _verify(capsys, "--archived", "--ledger", ledger_url)
    assert code == 1
    assert len(problems) == 2, problems
    assert problems[0].startswith(f"call {upload}: body digest mismatch")
    assert problems[1] == f"call call_{'ab' * 16}: orphan body: in no archived range"


def test_chunk_size_is_what_the_tests_assume() -> None:
    """The upload is three chunks."""
    assert 2 * CHUNK_BYTES < len(UPLOAD) < 3 * CHUNK_BYTES


async def _copy(url: str, call_id: str) -> bytes:
    out = io.BytesIO()
    async with Ledger.open(url) as ledger:
        await ledger.copy_body(call_id, out)
    return out.getvalue()


def test_a_backup_holds_the_bodies_stored_by_reference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``effectguard backup`` copies the body store with the rest of the file: the copy
    verifies and gives the upload back byte for byte."""
    ledger = str(tmp_path / "l.db")
    upload = asyncio.run(_build(ledger, tmp_path))
    copy = tmp_path / "copy.db"
    code, _ = cli(capsys, "backup", str(copy), "--ledger", ledger)
    assert code == 0
    assert _verify(capsys, "--ledger", str(copy)) == (0, [])
    assert asyncio.run(_copy(str(copy), upload)) == UPLOAD
