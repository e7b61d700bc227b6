"""One archived range of the chain, proved from its own lines (``verify --archive``).

An archive (a file on SQLite, a range of the ``archived_events`` table on PostgreSQL)
holds events ``first_seq..last_seq`` exactly as stored, a header (the predecessor digest
of its first event and the verifier state before it) and the ``ledger.archived``
checkpoint event the archive wrote into the ledger. :func:`verify_range` proves, from
these alone, that the events chain from the header's digest to the checkpoint's
``last_digest``, that their lines hash to its ``archive_sha256``, that each archived call
is whole and final, and that folding them from the header's state gives the checkpoint's.

What "final" means is written here, apart from the archiver's own rule
(``rules.retention``): an archive that took a call the contract keeps live is named by
this module's reading of the contract, not confirmed by the constant that let it go.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any, Final

from effectguard.ops.audit import checkpoint
from effectguard.ops.audit.bodies import BodyRow
from effectguard.ops.audit.chain import content_digest
from effectguard.ops.audit.report import VerifyReport
from effectguard.ops.audit.verifier import Verifier
from effectguard.ops.audit.writers import OPERATOR_WORKER
from effectguard.rules.events import StoredEvent

#: The stages a call may be archived in (docs/operations.md, "Retention and archives"):
#: resolved, so its effect is settled: ``refused``, ``completed``, ``failed`` and
#: ``reconciled_applied``, and the stages that had no effect, ``not_sent``,
#: ``not_processed`` and ``reconciled_not_applied`` (a resend under the key of one
#: resumes it while it is live; archived, its key answers 409 ``archived``). Never
#: ``in_flight`` or ``effect_unknown``: unresolved, an effect may be unaccounted for.
SETTLED_STAGES: Final = frozenset(
    {
        "refused",
        "completed",
        "failed",
        "reconciled_applied",
        "not_sent",
        "not_processed",
        "reconciled_not_applied",
    }
)


def lines_sha256(lines: Iterable[str]) -> str:
    """The digest a checkpoint holds of its archive's event lines: SHA-256 over each line
    and a newline (the verifier's own reading of the format)."""
    h = hashlib.sha256()
    for line in lines:
        h.update(line.encode("utf-8") + b"\n")
    return h.hexdigest()


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
        projection = fold.projection()
        stage = projection["stage"]
        if fold.unfinished is not None or stage not in SETTLED_STAGES:
            report.broken(fold.last_seq, f"call {call_id}: archived while {stage}")
    if not checkpoint.same_state(verifier, mark.get("state")):
        report.broken(tail.seq, "folding the archive does not give its checkpoint's state")
    if bodies is not None:
        verifier.check_bodies(bodies)
    report.calls = len(verifier.calls)
    return report


def _check_start(report: VerifyReport, header: dict[str, Any], stored: StoredEvent) -> None:
    # The previous cut's checkpoint, once it is archived too, vouches for this range's start.
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
    if tail.kind != checkpoint.KIND or content_digest(tail) != tail.digest:
        report.broken(tail.seq, f"event {tail.seq}: the archive's checkpoint is not sealed")
    if (tail.worker, tail.generation) != (OPERATOR_WORKER, 0):
        report.broken(
            tail.seq,
            f"event {tail.seq}: the archive's checkpoint is written by {tail.worker!r} "
            f"(generation {tail.generation}), not the operator",
        )
    for problem in checkpoint.check(tail.seq, tail.data):
        report.broken(tail.seq, problem)
