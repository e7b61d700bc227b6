"""Bodies stored by reference: each is there, whole, and the bytes its manifest names.

A ``call.manifest`` whose ``body_encoding`` is ``sha256`` names its request body by the
SHA-256 of its bytes, which the ledger keeps apart, in numbered chunks (the chain covers
the bytes through that digest). The reader hands over what it found stored, one
:class:`BodyRow` per call (the chunk numbers, and the size and SHA-256 of the chunks
read in order); this module compares them with the manifests. A call refused at
admission keeps no body: it is never sent.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

#: The ``body_encoding`` of a manifest whose body is stored apart (its own copy of the
#: format's name: the verifier shares no code with the store).
REF_ENCODING = "sha256"
_MANIFEST = "call.manifest"


class BodyRow(NamedTuple):
    """What the ledger stores of one call's body: its chunk numbers in order, and the
    size and hex SHA-256 of those chunks read in order (None when not read: a gap)."""

    call_id: str
    seqs: tuple[int, ...]
    size: int
    sha256: str | None


class Bodies:
    """The bodies manifests name by reference, fed in ledger order."""

    def __init__(self) -> None:
        #: call id -> (the manifest's event number, the digest it names)
        self.named: dict[str, tuple[int, str]] = {}

    def feed(self, seq: int, kind: str, call_id: str, data: Mapping[str, Any]) -> None:
        """Note a manifest that names its body by reference."""
        if kind == _MANIFEST and data.get("body_encoding") == REF_ENCODING:
            self.named[call_id] = (seq, str(data.get("body")))

    def check(self, rows: Iterable[BodyRow], refused: set[str], last: int) -> list[tuple[int, str]]:
        """``(seq, problem)`` for each named body missing, incomplete or not its digest's
        bytes, and each stored body no manifest names (``last``: the chain's last event)."""
        stored = {row.call_id: row for row in rows}
        problems: list[tuple[int, str]] = []
        for call_id in sorted(set(stored) | set(self.named)):
            row, named = stored.get(call_id), self.named.get(call_id)
            if row is None:
                if named is not None and call_id not in refused:
                    problems.append(
                        (
                            named[0],
                            f"call {call_id}: body missing: its manifest (event {named[0]}) "
                            "names one by reference, but none is stored",
                        )
                    )
            elif named is None or call_id in refused:
                why = "a refused call keeps none" if named else "no manifest names it"
                problems.append(
                    (last, f"call {call_id}: orphan body: {row.size} bytes stored, but {why}")
                )
            else:
                problems += _compare(call_id, named, row)
        return problems


def _compare(call_id: str, named: tuple[int, str], row: BodyRow) -> list[tuple[int, str]]:
    seq, digest = named
    gaps = [n for n in range(max(row.seqs, default=-1) + 1) if n not in set(row.seqs)]
    if gaps:
        return [
            (
                seq,
                f"call {call_id}: body chunk missing: chunk {gaps[0]} of its body "
                f"is not stored (chunks stored: {len(row.seqs)})",
            )
        ]
    if row.sha256 != digest:
        return [
            (
                seq,
                f"call {call_id}: body digest mismatch: its {row.size} stored bytes "
                f"hash to {row.sha256}, not the {digest} its manifest (event {seq}) names",
            )
        ]
    return []
