"""The invariants of ``--maintenance``: backups, archives and authorized resends.

Pure functions of the :class:`Evidence`, as the other invariants are. The copies and
the archive files were verified by ``effectguard verify`` run as its own process (the
evidence holds its exit codes); the resends are counted with the provider's receipts.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Final

from effectguard.testing.sim.clockmap import real_times
from effectguard.testing.sim.evidence import Evidence
from effectguard.testing.sim.evidenceindex import authorizations, sha_by_call
from effectguard.testing.sim.violation import Violation

__all__ = ["MAINTENANCE_CHECKS", "MAINTENANCE_INVARIANTS"]

MAINTENANCE_INVARIANTS: Final = {
    "backup_unverified": "each backup that exited 0 passes `effectguard verify --ledger COPY`",
    "archive_unverified": "each archive file an archive left passes `effectguard verify "
    "--archive FILE --ledger L` (and an archive that exited 0 left every file it named); "
    "on PostgreSQL `verify --archived --ledger L` accepts the archive tables",
    "event_lost": "the archives and the live ledger hold every event once, from event 1 on, "
    "and every call a client got a 200 for",
    "resend_beyond_authorized": "after an operator authorized a resend, the provider applied "
    "the call at most once per authorization (or decision not applied)",
    "maintenance_command_failed": "a maintenance command (backup, archive, reconcile --resend) "
    "exits 0 or a code the contract gives it, never a traceback",
}


def backups_verify(evidence: Evidence) -> list[Violation]:
    """Each backup that exited 0 is a ledger ``verify`` accepts."""
    return [
        Violation("backup_unverified", f"{path}: verify exit {code}: {output.strip()[-500:]}")
        for path, code, output in evidence.backup_checks
        if code != 0
    ]


def archives_verify(evidence: Evidence) -> list[Violation]:
    """Each archive file verifies against the ledger; none an archive named is missing."""
    return [
        Violation("archive_unverified", f"{path}: verify exit {code}: {output.strip()[-500:]}")
        for path, code, output in evidence.archive_checks
        if code != 0
    ]


def no_event_lost(evidence: Evidence) -> list[Violation]:
    """The events (archived ones read back from their files, then the live ones) are
    numbered 1..N, each once; every call a client got a clean 200 for is among them."""
    counts = Counter(e.seq for e in evidence.events)
    out = []
    head = max(counts, default=0)
    missing = [seq for seq in range(1, head + 1) if seq not in counts]
    if missing:
        shown = f"{missing[:10]}{' ...' if len(missing) > 10 else ''}"
        out.append(
            Violation("event_lost", f"{len(missing)} events of 1..{head} are nowhere: {shown}")
        )
    twice = sorted(seq for seq, n in counts.items() if n > 1)
    if twice:
        out.append(Violation("event_lost", f"events held twice (archive and ledger): {twice[:10]}"))
    known = {e.call_id for e in evidence.events if e.kind == "call.manifest"}
    for call_id in sorted({a.call_id for a in evidence.answers if a.clean_ok and a.call_id}):
        if call_id not in known:
            out.append(Violation("event_lost", f"call {call_id} got a 200 and is nowhere"))
    return out


def resends_within_authorizations(evidence: Evidence) -> list[Violation]:
    """From an operator's first authorization of a call on, each stretch up to the next
    authorization (or decision "not applied", after which a resend is new work) holds at
    most one provider effect of the call: a receipt of its body not answered from the
    provider's dedup store and not with a status its provider declares did nothing. A
    call whose authorization a step of the ledger's clock left without one real time is
    left out (:func:`~effectguard.testing.sim.evidenceindex.authorizations`)."""
    sha_of = sha_by_call(evidence)
    provider = {
        e.call_id: str(e.data.get("provider")) for e in evidence.events if e.kind == "call.manifest"
    }
    real = real_times(evidence.events, evidence.clock_steps)
    not_applied: dict[str, list[float]] = defaultdict(list)
    for e in evidence.events:
        if e.kind == "call.reconciled" and e.call_id and not e.data.get("applied"):
            not_applied[e.call_id].append(real[e.seq][0])
    out = []
    for call_id, ats in sorted(authorizations(evidence, real).items()):
        first = min(ats)
        bounds = sorted(ats + [t for t in not_applied.get(call_id, ()) if t > first])
        nothing = evidence.no_effect.get(provider.get(call_id, ""), frozenset())
        stretch: Counter[int] = Counter()
        for r in evidence.receipts:
            if r["body_sha256"] != sha_of.get(call_id) or r.get("deduped") or r["ts"] < first:
                continue
            if r.get("status") in nothing:
                continue
            stretch[bisect_right(bounds, r["ts"])] += 1
        for index, count in sorted(stretch.items()):
            if count > 1:
                out.append(
                    Violation(
                        "resend_beyond_authorized",
                        f"call {call_id}: {count} provider effects after the authorization "
                        f"at {bounds[index - 1]:.3f} (authorized at {sorted(ats)})",
                    )
                )
    return out


def maintenance_commands_exit_cleanly(evidence: Evidence) -> list[Violation]:
    """Each maintenance command exited 0 or with a code documented for it, no traceback."""
    return [Violation("maintenance_command_failed", f) for f in evidence.maintenance_failures]


MAINTENANCE_CHECKS: Final[tuple[Callable[[Evidence], list[Violation]], ...]] = (
    backups_verify,
    archives_verify,
    no_event_lost,
    resends_within_authorizations,
    maintenance_commands_exit_cleanly,
)
