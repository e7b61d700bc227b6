"""The body store: request bodies kept beside their manifests, by reference (rules/bodyref).

Every store keeps a by-reference body as rows ``(call_id, seq, chunk)``, ``seq`` counting
from 0, each chunk :data:`~effectguard.rules.bodyref.CHUNK_BYTES` long but the last. This
module holds what the stores share:

* :func:`chunks` reads a spooled file one chunk at a time and, once the file is read,
  checks that its bytes are exactly the size and SHA-256 the manifest commits to. A store
  inserts each chunk as it comes; when the check fails the operation fails, so its
  savepoint rollback takes the chunks it inserted with it (nothing is stored).
* :func:`contiguous` is the check a reader makes before streaming a body back out: a
  gap would resend a body that is not the one the manifest names.

An empty body is stored as one empty chunk, so that every stored body has a row to
find (and ``verify`` can tell a missing body from an empty one).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

from effectguard.errors import BodyMismatch
from effectguard.rules.bodyref import CHUNK_BYTES, REF_ENCODING, SpooledBody

__all__ = ["check_spool", "chunks", "contiguous"]


def check_spool(body: str, encoding: str, spool: SpooledBody | None) -> None:
    """Refuse an admission request whose manifest and spooled file disagree.

    A programming error of the caller (``prepare``), not a request's fault: a manifest
    that names a body by reference comes with its file, and names it by its SHA-256.
    """
    if (spool is not None) != (encoding == REF_ENCODING):
        raise ValueError(
            f"a body encoded {encoding!r} comes "
            f"{'with' if spool is not None else 'without'} a spooled file; "
            f"exactly the {REF_ENCODING!r} encoding has one"
        )
    if spool is not None and body != spool.sha256:
        raise ValueError(f"manifest body {body!r} is not the spooled file's sha256 {spool.sha256}")


def chunks(call_id: str, body: SpooledBody) -> Iterator[tuple[int, bytes]]:
    """``(seq, chunk)`` of the file ``body`` names, read one chunk at a time.

    After the last chunk, raises :class:`BodyMismatch` if the bytes read are not
    ``body.size`` long or do not hash to ``body.sha256``: the caller's transaction
    must then not keep what it inserted.
    """
    digest = hashlib.sha256()
    size = 0
    seq = 0
    try:
        with open(body.path, "rb") as src:
            while True:
                chunk = src.read(CHUNK_BYTES)
                if not chunk and seq > 0:
                    break
                digest.update(chunk)
                size += len(chunk)
                yield seq, chunk
                seq += 1
                if len(chunk) < CHUNK_BYTES:
                    break
    except OSError as exc:
        raise BodyMismatch(
            f"call {call_id}: cannot read its spooled body {body.path}: {exc}", call_id=call_id
        ) from exc
    if size != body.size or digest.hexdigest() != body.sha256.lower():
        raise BodyMismatch(
            f"call {call_id}: its spooled body is {size} bytes with sha256 "
            f"{digest.hexdigest()}, not the {body.size} bytes with sha256 {body.sha256} "
            "its manifest names; nothing is stored",
            call_id=call_id,
        )


def contiguous(call_id: str, seqs: Sequence[int]) -> None:
    """Refuse to stream a body whose chunk numbers are not 0, 1, 2, … (a chunk is missing)."""
    for expected, seq in enumerate(seqs):
        if seq != expected:
            raise BodyMismatch(
                f"call {call_id}: its stored body lacks chunk {expected} "
                "(run `effectguard verify`)",
                call_id=call_id,
            )
