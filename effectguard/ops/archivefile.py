"""The archive file: a gzip'd JSON-lines copy of a range of the chain, provable on its own.

Line 1 is a header (``format``, the range, the predecessor digest of its first event,
the verifier state before it, and the idempotency keys of the archived calls); then one
line per event, exactly as stored; then (format 2) one line per chunk of each archived
call's request body stored by reference (``{"body": {"call", "seq", "chunk"}}``, the
chunk in base64); the last line is the ``ledger.archived`` checkpoint event the archive
wrote into the ledger. The checkpoint's digest covers the event lines; the body lines
are covered through their manifests, which name each body by its SHA-256.

:func:`verify_archive` reads the file and hands it to the independent verifier
(:func:`effectguard.ops.audit.archived.verify_range`), which proves, from the file alone,
that the events chain from the header's digest to the checkpoint's ``last_digest``, that
their lines hash to the checkpoint's ``archive_sha256``, that each archived call is whole
and final, that folding them from the header's state gives the checkpoint's state, and
that each body a manifest names by reference is there, whole, with that digest. The
checkpoint's own digest ties the file to the ledger. Reading streams the body lines
through their hashes: they are never held in memory.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, BinaryIO

from effectguard.errors import ConfigError
from effectguard.ledger import Ledger
from effectguard.ops.audit import BodyRow, VerifyReport
from effectguard.ops.audit.archived import verify_range
from effectguard.rules.events import StoredEvent, canonical_json

FORMAT = "effectguard-archive/2"
#: The formats read: format 1 has no body lines.
FORMATS = ("effectguard-archive/1", FORMAT)
#: How a body line, and the checkpoint line, begin (canonical JSON sorts keys; an event
#: line begins with ``{"at":``).
_BODY = '{"body":'
_CHECKPOINT = '{"checkpoint":'


#: Every field of a stored event, in declaration order (``record`` included: the lines
#: archives have always held).
_FIELDS = tuple(f.name for f in fields(StoredEvent))


def event_line(stored: StoredEvent) -> str:
    """One event as a line of the archive (canonical JSON of every stored field).

    The text of ``canonical_json(asdict(stored))``, without ``asdict``'s deep copy of
    every nested value, which took most of an archive's time (half of a 360,000-event
    run on a 2-core machine): the line only reads them.
    """
    return canonical_json({name: getattr(stored, name) for name in _FIELDS})


def lines_sha256(lines: Iterable[str]) -> str:
    """The digest the checkpoint holds of the archive's event lines."""
    h = hashlib.sha256()
    for line in lines:
        h.update(line.encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()


def write_events(
    out_file: BinaryIO,
    header: dict[str, Any],
    lines: Iterable[str],
    bodies: Iterable[tuple[str, int, bytes]] = (),
) -> str:
    """Write the header, the event lines and the ``(call_id, seq, chunk)`` body chunks, one
    line each, as ``lines`` and ``bodies`` yield them (the first gzip member of
    ``out_file``), and return :func:`lines_sha256` of the event lines: they are streamed,
    never held. ``out_file`` stays open (the archive holds its partial file by it)."""
    h = hashlib.sha256()
    with gzip.open(out_file, "wt", encoding="utf-8") as out:
        out.write(canonical_json({"format": FORMAT, **header}) + "\n")
        for line in lines:
            h.update(line.encode("utf-8"))
            h.update(b"\n")
            out.write(line + "\n")
        for call_id, seq, chunk in bodies:
            body = {"call": call_id, "seq": seq, "chunk": base64.b64encode(chunk).decode()}
            out.write(canonical_json({"body": body}) + "\n")
    return h.hexdigest()


def append_checkpoint(out_file: BinaryIO, tail: StoredEvent) -> None:
    """Append the checkpoint line (a second gzip member: readers see one stream) to the
    file :func:`write_events` wrote, through the same open file, and fsync it.

    Split from :func:`write_events` so that the bulk of the file is written before the
    archive takes the ledger's write lock, and only this line while holding it. Written
    through the open file, never reopened by name: a name reopened after the file was
    removed would make a new file holding the checkpoint and none of the events.
    """
    out_file.seek(0, os.SEEK_END)
    with gzip.open(out_file, "at", encoding="utf-8") as out:
        out.write(canonical_json({"checkpoint": asdict(tail)}) + "\n")
    out_file.flush()
    os.fsync(out_file.fileno())


def read_archive(path: Path) -> tuple[dict[str, Any], list[str], StoredEvent]:
    """The header, the event lines and the checkpoint event of an archive file."""
    header, lines, tail, _ = scan_archive(path)
    return header, lines, tail


def scan_archive(
    path: Path,
) -> tuple[dict[str, Any], list[str], StoredEvent, list[BodyRow]]:
    """:func:`read_archive` and the archived bodies as the verifier compares them (each
    body's chunk numbers, size and SHA-256), read in one pass, chunk by chunk.

    A file that is not an archive, or not one any more (not gzip, cut short, lines that
    are not the archive's JSON), is a ``ConfigError`` naming it.
    """
    try:
        return _scan(path)
    # OSError includes gzip.BadGzipFile; ValueError, json's and base64's errors.
    except (OSError, EOFError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{path}: not a readable effectguard archive ({exc})") from exc


def _scan(path: Path) -> tuple[dict[str, Any], list[str], StoredEvent, list[BodyRow]]:
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
                    raise ValueError(f"its format is {header.get('format')!r}")
            elif tail is not None:
                raise ValueError("a line after its end")
            elif row.startswith(_CHECKPOINT):
                tail = StoredEvent(**json.loads(row)["checkpoint"])
            elif row.startswith(_BODY):
                _add_chunk(bodies, json.loads(row)["body"])
            else:
                lines.append(row)
    if header is None or tail is None:
        raise ValueError("too short")
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
