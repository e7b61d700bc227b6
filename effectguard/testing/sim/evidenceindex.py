"""Indexes of the evidence that several invariants read: bodies, effects, authorizations."""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from effectguard.rules.bodyref import REF_ENCODING
from effectguard.rules.bodytext import decode_body
from effectguard.testing.sim.evidence import Evidence

__all__ = ["applied_ops", "authorizations", "sha_by_call"]


def sha_by_call(evidence: Evidence) -> dict[str, str]:
    """Each call's request body as sent upstream (the manifest's) -> its SHA-256."""
    out = {}
    for e in evidence.events:
        if e.kind == "call.manifest" and e.call_id is not None:
            encoding = e.data.get("body_encoding", "utf8")
            if encoding == REF_ENCODING:  # stored apart: the manifest holds its digest
                out[e.call_id] = str(e.data["body"]).lower()
                continue
            body = decode_body(e.data["body"], encoding)
            out[e.call_id] = hashlib.sha256(body).hexdigest()
    return out


def applied_ops(evidence: Evidence) -> dict[str, list[dict[str, Any]]]:
    """The receipts the provider applied, by the operation id they carried: answered
    below 400 (a refusal applies nothing) and not replayed from its dedup store."""
    applied: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for receipt in evidence.receipts:
        status = receipt.get("status")
        op = receipt.get("op")
        if op and not receipt.get("deduped") and isinstance(status, int) and status < 400:
            applied[op].append(receipt)
    return applied


def authorizations(
    evidence: Evidence, real: Mapping[int, tuple[float, float]] | None = None
) -> dict[str, list[float]]:
    """When an operator authorized a resend of each call (``call.resend_authorized``).

    ``real``: the events' real times (:func:`~effectguard.testing.sim.clockmap.real_times`);
    a call with an authorization a clock step left without one real time is left out."""
    out: dict[str, list[float]] = defaultdict(list)
    unsure: set[str] = set()
    for e in evidence.events:
        if e.kind == "call.resend_authorized" and e.call_id is not None:
            earliest, latest = real[e.seq] if real is not None else (e.at, e.at)
            out[e.call_id].append(earliest)
            if latest != earliest:
                unsure.add(e.call_id)
    return {call_id: ats for call_id, ats in out.items() if call_id not in unsure}
