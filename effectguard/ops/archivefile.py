"""The archive file: a gzip'd JSON-lines copy of a range of the chain, provable on its own.

Line 1 is a header (``format``, the range, the predecessor digest of its first event,
the verifier state before it, and the idempotency keys of the archived calls); then one
line per event, exactly as stored; then (format 2) one line per chunk of each archived
call's request body stored by reference (``{"body": {"call", "seq", "chunk"}}``, the
chunk in base64); the last line is the ``ledger.archived`` checkpoint event the archive
wrote into the ledger. The checkpoint's digest covers the event lines; the body lines
are covered through their manifests, which name each body by its SHA-256.

:func:`verify_archive` proves, from the file alone, that the events chain from the
header's digest to the checkpoint's ``last_digest``, that their lines hash to the
checkpoint's ``archive_sha256``, that each archived call is whole and final, that
folding them from the header's state gives the checkpoint's state, and that each body a
manifest names by reference is there, whole, with that digest. The checkpoint's own
digest ties the file to the ledger. Reading streams the body lines through their
hashes: they are never held in memory.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from effectguard.ledger import Ledger
from effectguard.ops.audit import BodyRow, Verifier, VerifyReport, checkpoint
from effectguard.rules.events import StoredEvent, canonical_json, stored_digest
from effectguard.rules.retention import ARCHIVABLE_STAGES

FORMAT = "effectguard-archive/2"
#: The formats read: format 1 has no body lines.
FORMATS = ("effectguard-archive/1", FORMAT)
#: How a body line, and the checkpoint line, begin (canonical JSON sorts keys; an event
#: line begins with ``{"at":``).
_BODY = '{"body":'
_CHECKPOINT = '{"checkpoint":'


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


def write_events(
    path: Path,
    header: dict[str, Any],
    lines: list[str],
    bodies: Iterable[tuple[str, int, bytes]] = (),
) -> None:
    """Write the header, the event lines and the ``(call_id, seq, chunk)`` body chunks, one
    line each, as ``bodies`` yields them (the first gzip member of the file)."""
    with gzip.open(path, "wt", encoding="utf-8") as out:
        out.write(canonical_json({"format": FORMAT, **header}) + "\n")
        for line in lines:
            out.write(line + "\n")
        for call_id, seq, chunk in bodies:
            body = {"call": call_id, "seq": seq, "chunk": base64.b64encode(chunk).decode()}
            out.write(canonical_json({"body": body}) + "\n")


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
    header, lines, tail, _ = scan_archive(path)
    return header, lines, tail


def scan_archive(
    path: Path,
) -> tuple[dict[str, Any], list[str], StoredEvent, list[BodyRow]]:
    """:func:`read_archive` and the archived bodies as the verifier compares them (each
    body's chunk numbers, size and SHA-256), read in one pass, chunk by chunk."""
    header: dict[str, Any] | None = None
    lines: list[str] = []
    tail: StoredEvent | None = None
    bodies: dict[str, tuple[list[int], list[int], Any]] = {}
    with gzip.open(path, "rt", encoding="utf-8") as src:
        for row in src:
            row = row.rstrip("\n")
            if header is None:
                header = json.loads(row)
                if header.get("format") not in FORMATS:
                    raise ValueError(
                        f"{path}: not an effectguard archive ({header.get('format')!r})"
                    )
            elif tail is not None:
                raise ValueError(f"{path}: not an effectguard archive (a line after its end)")
            elif row.startswith(_CHECKPOINT):
                tail = StoredEvent(**json.loads(row)["checkpoint"])
            elif row.startswith(_BODY):
                _add_chunk(bodies, json.loads(row)["body"])
            else:
                lines.append(row)
    if header is None or tail is None:
        raise ValueError(f"{path}: not an effectguard archive (too short)")
    rows = [
        BodyRow(
            c, tuple(seqs), sum(sizes), h.hexdigest() if seqs == list(range(len(seqs))) else None
        )
        for c, (seqs, sizes, h) in bodies.items()
    ]
    return header, lines, tail, rows


def _add_chunk(bodies: dict[str, tuple[list[int], list[int], Any]], line: dict[str, Any]) -> None:
    chunk = base64.b64decode(line["chunk"], validate=True)
    seqs, sizes, digest = bodies.setdefault(str(line["call"]), ([], [], hashlib.sha256()))
    seqs.append(int(line["seq"]))
    sizes.append(len(chunk))
    digest.update(chunk)


def verify_archive(path: Path) -> VerifyReport:
    """Prove an archive file on its own (see the module docstring)."""
    header, lines, tail, bodies = scan_archive(path)
    return verify_range(header, lines, tail, bodies)


def verify_range(
    header: dict[str, Any],
    lines: list[str],
    tail: StoredEvent,
    bodies: list[BodyRow] | None = None,
) -> VerifyReport:
    """Prove one archived range from its header, event lines and checkpoint alone (and,
    given ``bodies``, its archived calls' bodies stored by reference)."""
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
    if bodies is not None:
        verifier.check_bodies(bodies)
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
    digest = stored_digest(tail)
    if tail.kind != checkpoint.KIND or digest != tail.digest:
        report.broken(tail.seq, f"event {tail.seq}: the archive's checkpoint is not sealed")
    report.problems.extend(checkpoint.check(tail.seq, tail.data))
