"""Shared pieces of the body-store tests: an upload spooled to a file, and an admission
request that stores it by reference (rules/bodyref), as ``prepare`` builds one."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from admitkit import admit_request

from effectguard.ledger import AdmitRequest
from effectguard.rules.bodyref import REF_ENCODING, SpooledBody

#: What an upload reserves in these tests (nano-dollars).
RESERVE = 1_000


def spooled(path: Path, data: bytes) -> SpooledBody:
    """``data`` spooled to ``path``, as the front door does with an upload."""
    path.write_bytes(data)
    return SpooledBody(str(path), len(data), hashlib.sha256(data).hexdigest())


def upload_request(
    body: SpooledBody | None, budget: str = "team/run", request_hash: str = "h"
) -> AdmitRequest:
    """An admission of a ``/v1/files`` upload to ``budget``: its body by reference when
    ``body`` is given, else a small inline one."""
    inline = admit_request(
        budget, endpoint="/v1/files", model=None, request_hash=request_hash, reserve=RESERVE
    )
    if body is None:
        return inline
    return dataclasses.replace(inline, body=body.sha256, body_encoding=REF_ENCODING, spool=body)
