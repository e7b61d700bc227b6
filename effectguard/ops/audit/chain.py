"""The hash chain: gap-free numbers, each event linked to its predecessor's digest."""

from __future__ import annotations

from effectguard.ops.audit.report import VerifyReport
from effectguard.rules.events import StoredEvent, canonical_json, event_digest

#: The predecessor digest of event 1 (written down here, not imported: it is part of the format).
GENESIS = "0" * 64


def content_digest(stored: StoredEvent) -> str:
    """The digest ``stored``'s content and predecessor link call for: what its ``digest``
    must be. (Computed here from the shared digest, not taken from the store's sealing.)"""
    return event_digest(
        seq=stored.seq,
        kind=stored.kind,
        call_id=stored.call_id,
        data_json=canonical_json(stored.data),
        worker=stored.worker,
        generation=stored.generation,
        at=stored.at,
        prev_digest=stored.prev_digest,
    )


class Chain:
    """Checks each event's number, predecessor link and digest, in order."""

    def __init__(self, report: VerifyReport) -> None:
        self.report = report
        self.expected_seq = 1
        self.prev = GENESIS

    def feed(self, stored: StoredEvent) -> None:
        """Check one event's place in the chain."""
        seq = stored.seq
        if seq != self.expected_seq:
            self.report.broken(
                seq,
                f"event {seq}: expected sequence number {self.expected_seq} (an event is missing)",
            )
        if stored.prev_digest != self.prev:
            self.report.broken(seq, f"event {seq}: predecessor digest does not match")
        if content_digest(stored) != stored.digest:
            self.report.broken(seq, _mismatch(stored))
        self.expected_seq = seq + 1
        self.prev = stored.digest


def _mismatch(stored: StoredEvent) -> str:
    """What a digest that does not match its event's content says."""
    seq, record = stored.seq, stored.record
    if record is None or record[0] == record[1]:
        return f"event {seq}: digest does not match its content"
    # Only the record's last digest is stored: the others were derived from the events
    # read, so an edit anywhere in the record shows here, at its end.
    first, last = record
    return (
        f"events {first}..{last} (one stored record, sealed by event {last}'s digest): "
        "their content does not match that digest; one of these events, or the digest, "
        "was changed (the record cannot tell which event)"
    )
