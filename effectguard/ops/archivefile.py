"""The archive file: a gzip'd JSON-lines copy of a range of the chain, provable on its own.

Line 1 is a header (``format``, the range, the predecessor digest of its first event,
the verifier state before it, and the idempotency keys of the archived calls); then one
line per event, exactly as stored; the last line is the ``ledger.archived`` checkpoint
event the archive wrote into the ledger. :func:`verify_archive` proves, from the file
alone, that the events chain from the header's digest to the checkpoint's
``last_digest``, that their lines hash to the checkpoint's ``archive_sha256``, that each
archived call is whole and final, and that folding them from the header's state gives
the checkpoint's state. The checkpoint's own digest ties the file to the ledger.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from effectguard.ledger import Ledger
from effectguard.ops.audit import Verifier, VerifyReport, checkpoint
from effectguard.rules.events import StoredEvent, canonical_json, event_digest
from effectguard.rules.retention import ARCHIVABLE_STAGES

FORMAT = "effectguard-archive/1"


def event_line(stored: StoredEvent) -> str:
    """One event as a line of the archive (canonical JSON of every stored field)."""
    return canonical_json(asdict(stored))


def lines_sha256(lines: Iterable[str]) -> str:
    """The digest the checkpoint holds of the archive's event lines."""
    h = hashlib.sha256()
    for line in lines:
        h.update(line.encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()


def write_events(path: Path, header: dict[str, Any], lines: list[str]) -> None:
    """Write the header and the event lines (the first gzip member of the file)."""
    with gzip.open(path, "wt", encoding="utf-8") as out:
        out.write(canonical_json({"format": FORMAT, **header}) + "\n")
        for line in lines:
            out.write(line + "\n")


def append_checkpoint(path: Path, tail: StoredEvent) -> None:
    """Append the checkpoint line (a second gzip member: readers see one stream), fsync'd.

    Split from :func:`write_events` so that the bulk of the file is written before the
    archive takes the ledger's write lock, and only this line while holding it.
    """
    with gzip.open(path, "at", encoding="utf-8") as out:
        out.write(canonical_json({"checkpoint": asdict(tail)}) + "\n")
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_archive(path: Path) -> tuple[dict[str, Any], list[str], StoredEvent]:
    """The header, the event lines and the checkpoint event of an archive file."""
    with gzip.open(path, "rt", encoding="utf-8") as src:
        rows = src.read().splitlines()
    if len(rows) < 2:
        raise ValueError(f"{path}: not an effectguard archive (too short)")
    header = json.loads(rows[0])
    if header.get("format") != FORMAT:
        raise ValueError(f"{path}: not an effectguard archive ({header.get('format')!r})")
    tail = StoredEvent(**json.loads(rows[-1])["checkpoint"])
    return header, rows[1:-1], tail


def verify_archive(path: Path) -> VerifyReport:
    """Prove an archive file on its own (see the module docstring)."""
    return verify_range(*read_archive(path))


def verify_range(header: dict[str, Any], lines: list[str], tail: StoredEvent) -> VerifyReport:
    """Prove one archived range from its header, event lines and checkpoint alone."""
    verifier = Verifier()
    report = verifier.report
    first = int(header["first_seq"])
    if header.get("start_state") is not None:
        checkpoint.seed(
            verifier, header["start_state"], next_seq=first, prev_digest=header["prev_digest"]
        )
    elif first != 1:
        report.broken(first, f"archive starts at event {first} without a starting state")
    for line in lines:
        stored = StoredEvent(**json.loads(line))
        verifier.feed(stored)
        _check_start(report, header, stored)
    mark = tail.data
    _check_tail(report, tail)
    if lines_sha256(lines) != mark.get("archive_sha256"):
        report.broken(tail.seq, "the archive's events do not hash to its checkpoint's digest")
    if verifier.chain.prev != mark.get("last_digest") or verifier.chain.expected_seq - 1 != int(
        mark.get("last_seq", -1)
    ):
        report.broken(tail.seq, "the archive does not end where its checkpoint says")
    if (int(mark.get("first_seq", -1)), mark.get("prev_digest")) != (first, header["prev_digest"]):
        report.broken(tail.seq, "the archive does not start where its checkpoint says")
    for call_id, fold in sorted(verifier.calls.items()):
        stage = fold.projection()["stage"]
        if fold.unfinished is not None or stage not in ARCHIVABLE_STAGES:
            report.broken(fold.last_seq, f"call {call_id}: archived while {stage}")
    if not checkpoint.same_state(checkpoint.export_state(verifier), mark.get("state")):
        report.broken(tail.seq, "folding the archive does not give its checkpoint's state")
    report.calls = len(verifier.calls)
    return report


async def check_archive_against(ledger: Ledger, path: Path, report: VerifyReport) -> None:
    """Where the ledger still holds the archive's checkpoint, it must be the file's own.

    A file rewritten and resealed end to end passes :func:`verify_archive`; the
    checkpoint in the ledger (chained into everything written after it) does not move.
    """
    _, _, tail = read_archive(path)
    found = await ledger.store.events_after(tail.seq - 1, 1)
    if found and found[0].seq == tail.seq and found[0].digest != tail.digest:
        report.broken(tail.seq, f"event {tail.seq}: the ledger's checkpoint is not this archive's")
    elif not found or found[0].seq != tail.seq:
        first = await ledger.store.events_after(0, 1)
        if not first or first[0].seq <= tail.seq:
            report.broken(tail.seq, f"event {tail.seq}: the ledger holds no such checkpoint")


def _check_start(report: VerifyReport, header: dict[str, Any], stored: StoredEvent) -> None:
    # The previous cut's checkpoint, once it is archived too, vouches for this file's start.
    data = stored.data
    if stored.kind != checkpoint.KIND or data.get("last_seq") != int(header["first_seq"]) - 1:
        return
    if (data.get("state"), data.get("last_digest")) != (
        header.get("start_state"),
        header["prev_digest"],
    ):
        report.broken(
            stored.seq, f"event {stored.seq}: the archive's start is not its checkpoint's"
        )


def _check_tail(report: VerifyReport, tail: StoredEvent) -> None:
    digest = event_digest(
        seq=tail.seq,
        kind=tail.kind,
        call_id=tail.call_id,
        data_json=canonical_json(tail.data),
        worker=tail.worker,
        generation=tail.generation,
        at=tail.at,
        prev_digest=tail.prev_digest,
    )
    if tail.kind != checkpoint.KIND or digest != tail.digest:
        report.broken(tail.seq, f"event {tail.seq}: the archive's checkpoint is not sealed")
    report.problems.extend(checkpoint.check(tail.seq, tail.data))
