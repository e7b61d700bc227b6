"""The body store's contract, on every store: a by-reference body is stored with its
manifest, in chunks, streamed back out whole, and never stored when it is not the bytes
its manifest names (rules/bodyref)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import io
import os
from pathlib import Path

import pytest
from test_store_contract import (  # noqa: F401  (fixtures)
    R,
    admit_ok,
    clock,
    ledger,
    ledger_url,
    ns,
    req,
    store_kind,
    w1,
)

from effectguard.errors import BodyMismatch
from effectguard.ledger import AdmitRequest, Ledger, Writer
from effectguard.ledger.base import Tx
from effectguard.rules.bodyref import CHUNK_BYTES, REF_ENCODING, SpooledBody


def spool(tmp_path: Path, data: bytes, name: str = "body.bin") -> SpooledBody:
    """``data`` in a file, as the front door spools an upload."""
    path = tmp_path / name
    path.write_bytes(data)
    return SpooledBody(str(path), len(data), hashlib.sha256(data).hexdigest())


def ref_req(ns: str, spooled: SpooledBody | None, **fields: object) -> AdmitRequest:
    """An admission request whose body is stored by reference (``fields`` replace any)."""
    fields.setdefault("body", None if spooled is None else spooled.sha256)
    fields.setdefault("body_encoding", REF_ENCODING)
    return dataclasses.replace(req(ns), spool=spooled, **fields)  # type: ignore[arg-type]


async def read_back(ledger: Ledger, call_id: str) -> tuple[int, bytes]:
    out = io.BytesIO()
    written = await ledger.store.copy_body(call_id, out)
    return written, out.getvalue()


async def test_a_multi_chunk_body_round_trips(
    ledger: Ledger, w1: Writer, ns: str, tmp_path: Path
) -> None:
    """A 600 KiB body is stored in chunks with its manifest and read back byte for byte."""
    data = os.urandom(600 * 1024)
    admitted = await admit_ok(ledger, w1, ref_req(ns, spool(tmp_path, data)))
    assert await read_back(ledger, admitted.call_id) == (len(data), data)
    chunks = [c for c in await ledger.store.body_chunks() if c[0] == admitted.call_id]
    assert [(seq, size) for _, seq, size in chunks] == [
        (0, CHUNK_BYTES),
        (1, CHUNK_BYTES),
        (2, len(data) - 2 * CHUNK_BYTES),
    ]
    manifest = (await ledger.events(admitted.call_id))[0]
    assert manifest.data["body"] == hashlib.sha256(data).hexdigest()
    assert manifest.data["body_encoding"] == REF_ENCODING


async def test_a_body_of_whole_chunks_has_no_empty_tail(
    ledger: Ledger, w1: Writer, ns: str, tmp_path: Path
) -> None:
    """A body of exactly two chunks is two rows, not two and an empty one."""
    data = os.urandom(2 * CHUNK_BYTES)
    admitted = await admit_ok(ledger, w1, ref_req(ns, spool(tmp_path, data)))
    assert await read_back(ledger, admitted.call_id) == (len(data), data)
    assert len([c for c in await ledger.store.body_chunks() if c[0] == admitted.call_id]) == 2


async def test_the_empty_body_is_stored_as_one_empty_chunk(
    ledger: Ledger, w1: Writer, ns: str, tmp_path: Path
) -> None:
    """An empty body round trips, and is found stored (one empty chunk), unlike no body."""
    admitted = await admit_ok(ledger, w1, ref_req(ns, spool(tmp_path, b"")))
    assert await read_back(ledger, admitted.call_id) == (0, b"")
    assert [c for c in await ledger.store.body_chunks() if c[0] == admitted.call_id] == [
        (admitted.call_id, 0, 0)
    ]


async def test_a_call_without_a_stored_body_copies_nothing(
    ledger: Ledger, w1: Writer, ns: str
) -> None:
    """An inline body (and an unknown call) has no stored body: copy_body writes 0 bytes."""
    admitted = await admit_ok(ledger, w1, req(ns))
    assert await read_back(ledger, admitted.call_id) == (0, b"")
    assert await read_back(ledger, "call_" + "0" * 32) == (0, b"")


@pytest.mark.parametrize("lie", ["sha256", "size"])
async def test_a_file_that_is_not_the_declared_body_is_refused_and_nothing_is_written(
    ledger: Ledger, w1: Writer, ns: str, tmp_path: Path, lie: str
) -> None:
    """The file's bytes must hash to the manifest's digest and have its size: otherwise the
    admission fails with BodyMismatch and leaves no call, no event and no chunk."""
    data = os.urandom(CHUNK_BYTES + 10)
    good = spool(tmp_path, data)
    other = hashlib.sha256(b"other").hexdigest()
    bad = (
        SpooledBody(good.path, good.size, other)
        if lie == "sha256"
        else SpooledBody(good.path, good.size + 1, good.sha256)
    )
    before = await ledger.store.events_after(0, 1 << 30)
    with pytest.raises(BodyMismatch, match="nothing is stored"):
        await ledger.admit(w1, ref_req(ns, bad))
    assert await ledger.store.body_chunks() == []
    assert await ledger.store.events_after(0, 1 << 30) == before
    assert await ledger.calls() == []


async def test_a_failed_transaction_leaves_no_chunks(
    ledger: Ledger, w1: Writer, ns: str, tmp_path: Path
) -> None:
    """An operation that stores a body and then fails keeps none of its chunks, in a batch
    of one and beside operations that commit."""
    body = spool(tmp_path, os.urandom(CHUNK_BYTES * 2 + 1))

    def store_then_fail(tx: Tx) -> None:
        tx.put_body("call_" + "1" * 32, body)
        raise RuntimeError("the operation fails after storing its body")

    with pytest.raises(RuntimeError):
        await ledger.store.write(w1, store_then_fail)
    assert await ledger.store.body_chunks() == []
    others = [admit_ok(ledger, w1, req(ns, request_hash=f"h{i}")) for i in range(3)]
    results = await asyncio.gather(
        ledger.store.write(w1, store_then_fail), *others, return_exceptions=True
    )
    assert isinstance(results[0], RuntimeError)
    assert await ledger.store.body_chunks() == []


async def test_a_refused_admission_stores_no_body(
    ledger: Ledger, w1: Writer, ns: str, tmp_path: Path
) -> None:
    """A call refused at admission keeps its manifest (with the digest) but not the bytes:
    a refused call is never sent, so nothing will ever read them back."""
    await ledger.set_limit(ns, R - 1)
    refused = await ledger.admit(w1, ref_req(ns, spool(tmp_path, os.urandom(1000))))
    assert refused.action == "refuse"
    assert await ledger.store.body_chunks() == []
    assert (await ledger.events(refused.call_id))[0].data["body_encoding"] == REF_ENCODING


async def test_a_manifest_and_file_that_disagree_are_a_programming_error(
    ledger: Ledger, w1: Writer, ns: str, tmp_path: Path
) -> None:
    """A ref manifest must carry its file, named by its digest; an inline one none."""
    body = spool(tmp_path, b"x" * 100)
    with pytest.raises(ValueError, match="sha256"):
        await ledger.admit(w1, ref_req(ns, body, body="0" * 64))
    with pytest.raises(ValueError, match="spooled file"):
        await ledger.admit(w1, ref_req(ns, None, body=body.sha256))
    with pytest.raises(ValueError, match="spooled file"):
        await ledger.admit(w1, ref_req(ns, body, body="{}", body_encoding="utf8"))
    assert await ledger.store.body_chunks() == []
