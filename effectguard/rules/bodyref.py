"""A request body stored beside its manifest, by reference, rather than inside it. Pure.

A small body is stored inside its ``call.manifest`` event (``body_encoding`` ``utf8`` or
``base64``), so the chain's digest covers it directly. A body larger than the front
door's spool threshold (a file upload) is never held whole in memory: it is spooled to a
file, and its manifest carries ``body_encoding`` :data:`REF_ENCODING` with ``body`` set to
the hex SHA-256 of its bytes. The bytes themselves go into the ledger's body store, in
chunks of :data:`CHUNK_BYTES`, in the admission's own transaction, so the chain still
covers them (through the digest in the manifest) and recovery can still resend them.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

from effectguard.rules.bodytext import decode_body
from effectguard.rules.events import CallManifest

__all__ = [
    "CHUNK_BYTES",
    "REFUSED_BODY_KEPT",
    "REF_ENCODING",
    "SpooledBody",
    "describe_ref",
    "refused_manifest",
]

#: ``body_encoding`` of a manifest whose ``body`` is the SHA-256 of bytes stored apart.
REF_ENCODING = "sha256"
#: The size of one stored chunk: large enough that a 10 MiB body is 40 rows, small
#: enough that writing or reading one never holds more than this in memory.
CHUNK_BYTES = 256 * 1024
#: The longest body (as the manifest holds it) a refused call keeps; a longer one keeps
#: only its digest.
REFUSED_BODY_KEPT = 16 * 1024


@dataclass(frozen=True, slots=True)
class SpooledBody:
    """A request body in a file: where it is, how long it is and its SHA-256 (hex)."""

    path: str
    size: int
    sha256: str


def describe_ref(sha256: str, size: int | None) -> str:
    """How ``show`` and the operator page name a body stored by reference, instead of
    printing it: its size where it was read from the body store, and its digest."""
    if size is None:
        return f"body stored by reference: sha256 {sha256}"
    return f"body stored by reference: {size} bytes, sha256 {sha256}"


def refused_manifest(manifest: CallManifest) -> CallManifest:
    """The manifest a refused call keeps: as it came when its body is short, else with
    its body named by digest (:data:`REF_ENCODING`) and not stored.

    A refusal is recorded so it can be audited, but its body is never sent: kept whole,
    a client retrying a large request against a full budget or a rate limit (an agent's
    500 KB context, in a loop) would write the ledger's disk full for every tenant.
    """
    if manifest.body_encoding == REF_ENCODING or len(manifest.body) <= REFUSED_BODY_KEPT:
        return manifest
    digest = hashlib.sha256(decode_body(manifest.body, manifest.body_encoding)).hexdigest()
    return dataclasses.replace(manifest, body=digest, body_encoding=REF_ENCODING)
