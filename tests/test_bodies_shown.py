"""A body stored by reference is named, never printed: ``show`` (text and ``--json``), the
operator page and the simulator's invariants read its manifest without decoding the
digest as if it were the body."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from pathlib import Path

import pytest
from bodykit import upload_request

from effectguard.ingress.admin import callpage
from effectguard.ledger import Ledger, Writer, operations
from effectguard.ops.cli import main as cli_main
from effectguard.rules.bodyref import REF_ENCODING, SpooledBody
from effectguard.testing.sim.evidence import Evidence
from effectguard.testing.sim.invariants import receipts_have_attempts

UPLOAD = os.urandom(300 * 1024)
DIGEST = hashlib.sha256(UPLOAD).hexdigest()


async def _admit(ledger_path: str, tmp_path: Path) -> tuple[str, str]:
    """An admitted upload and a refused one; their call ids."""
    upload = tmp_path / "upload.bin"
    upload.write_bytes(UPLOAD)
    spool = SpooledBody(str(upload), len(UPLOAD), DIGEST)
    async with Ledger.open(ledger_path) as ledger:
        writer: Writer = await ledger.store.write(
            Writer("boot", 0),
            lambda tx: operations.register_worker(tx, worker="w", host="h", pid=1, lease_s=60),
        )
        await ledger.set_limit("poor", 0)
        admitted = await ledger.admit(writer, upload_request(spool, "team/run"))
        refused = await ledger.admit(writer, upload_request(spool, "poor/run"))
    return admitted.call_id, refused.call_id


@pytest.fixture
def uploads(tmp_path: Path) -> tuple[str, str, str]:
    path = str(tmp_path / "l.db")
    admitted, refused = asyncio.run(_admit(path, tmp_path))
    return path, admitted, refused


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    capsys.readouterr()
    assert cli_main(list(argv)) == 0
    return capsys.readouterr().out


def test_show_names_an_upload_by_size_and_digest(
    uploads: tuple[str, str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``show`` says the body is stored by reference, with its size and SHA-256; a refused
    call's manifest names a body whose bytes are not stored, and ``show`` says so."""
    ledger, admitted, refused = uploads
    text = _run(capsys, "show", admitted, "--ledger", ledger)
    assert f"body stored by reference: {len(UPLOAD)} bytes, sha256 {DIGEST}" in text
    text = _run(capsys, "show", refused, "--ledger", ledger)
    assert f"body stored by reference: sha256 {DIGEST} (its bytes are not stored)" in text


def test_show_json_gives_an_upload_as_digest_and_size(
    uploads: tuple[str, str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``show --json``'s request is ``{body_encoding, sha256, bytes}`` for an upload."""
    ledger, admitted, _ = uploads
    payload = json.loads(_run(capsys, "show", admitted, "--json", "--ledger", ledger))
    assert payload["request"] == {
        "body_encoding": REF_ENCODING,
        "sha256": DIGEST,
        "bytes": len(UPLOAD),
    }


def test_the_operator_page_names_an_upload(uploads: tuple[str, str, str]) -> None:
    """The call page shows the digest of a body stored by reference, not a decoding of it."""
    ledger_path, admitted, _ = uploads

    async def page() -> str:
        async with Ledger.open(ledger_path) as ledger:
            state = await ledger.call(admitted)
            events = await ledger.events(admitted)
        return callpage.call_page(state, events, now=state.created_at, csrf="x")

    html = asyncio.run(page())
    assert f"body stored by reference: sha256 {DIGEST}" in html
    assert "sha256-encoded" not in html


def test_the_simulators_receipts_match_an_upload_by_its_digest(
    uploads: tuple[str, str, str],
) -> None:
    """A receipt of the uploaded bytes is matched to the call whose manifest names them:
    the invariant reads the digest from the manifest rather than hashing the digest."""
    ledger_path, _, _ = uploads

    async def events() -> Evidence:
        async with Ledger.open(ledger_path) as ledger:
            return Evidence(events=await ledger.store.events_after(0, 1000))

    evidence = asyncio.run(events())
    started = next(e.at for e in evidence.events if e.kind == "attempt.started")
    evidence.receipts = [{"ts": started + 1, "seq": 1, "body_sha256": DIGEST}]
    assert receipts_have_attempts(evidence) == []
