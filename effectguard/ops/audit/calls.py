"""One call, folded by the verifier's own rules: its phase, its money, its projection.

:class:`CallFold` walks a call's events through :mod:`.table` and checks what each
event says against what came before: attempt numbers, who wrote an attempt's outcome,
and every amount (a settlement settles the reservation its attempt made, a hold
holds what is still reserved, a reconcile releases what is held). From the same walk
it derives the projection the store should keep (:meth:`CallFold.projection`).
"""

from __future__ import annotations

import base64
import binascii
import sys
from typing import Any, Final

from effectguard.ops.audit import table
from effectguard.rules.events import StoredEvent

#: Kinds that record what became of an attempt: each needs a started attempt before it.
OUTCOME_KINDS: Final = frozenset(
    {"attempt.observed", "attempt.not_sent", "attempt.interrupted", "budget.settled"}
)
#: The calls table's columns a store gives for each call, in its order: the indexed
#: ones, then what the spend chart reads (SQLite keeps all of them in the row, also for
#: a call whose row keeps no state).
COLUMN_NAMES: Final = (
    "call_id",
    "stage",
    "budget",
    "budget_root",
    "idempotency_key",
    "request_hash",
    "provider",
    "created_at",
    "worker",
    "model",
    "cost",
    "held",
)
#: The manifest fields a fold reads (its projection and the budget its money moves on).
#: Only these are kept: a verify holds every call's fold at once, and keeping the whole
#: manifest kept every request body of the ledger in memory until the end.
MANIFEST_KEPT: Final = (
    "idempotency_key",
    "request_hash",
    "provider",
    "model",
    "budget",
    "budget_root",
    "at",
    "provider_idempotency_window_s",
)
#: Kept manifest fields whose values repeat across calls: kept once, not once per call.
_SHARED: Final = frozenset({"provider", "model", "budget", "budget_root"})
#: A manifest field the call's manifest does not have (None is a value it may have).
_ABSENT: Final = object()
_KEPT_AT: Final = {name: i for i, name in enumerate(MANIFEST_KEPT)}
#: Outcomes only the worker that started the attempt may write.
OWN_OUTCOMES: Final = frozenset({"attempt.observed", "attempt.not_sent", "budget.settled"})
_HEX: Final = "0123456789abcdef"


class CallFold:
    """The verifier's view of one call, built event by event.

    A verify holds every call's fold until the ledger's last event, so a fold keeps
    little: slots, the manifest's kept fields as a tuple, and the strings that repeat
    across calls (worker, provider, model, budgets) interned rather than once per call.
    """

    __slots__ = (
        "attempt_reserve",
        "attempts",
        "call_id",
        "cost",
        "decided_cost",
        "flagged",
        "held",
        "last_attempt_at",
        "last_kind",
        "last_seq",
        "manifest",
        "phase",
        "resend_authorized",
        "resent_unknown",
        "reserved",
        "reserved_at_admission",
        "stage",
        "starters",
        "status",
    )

    def __init__(self, call_id: str) -> None:
        self.call_id = call_id
        self.phase = table.NEW
        self.stage = "new"
        self.last_seq = 0
        self.last_kind = ""
        #: MANIFEST_KEPT's values, in its order (``_ABSENT`` where the manifest has none).
        self.manifest: tuple[Any, ...] = ()
        self.attempts = 0
        #: Who started each attempt, in order (attempt n at n - 1): a late answer must
        #: name the one that dispatched it.
        self.starters: tuple[tuple[str, int], ...] = ()
        self.last_attempt_at = 0.0
        self.attempt_reserve = 0
        self.reserved_at_admission = 0
        self.reserved = 0
        self.held = 0
        self.cost: int | None = None
        self.status: int | None = None
        self.flagged: str | None = None
        self.decided_cost = 0
        self.resend_authorized = False
        #: The current attempt resent an effect-unknown call (its hold released for it).
        self.resent_unknown = False

    def feed(self, stored: StoredEvent) -> list[str]:
        """Fold one event of this call; returns what is wrong with it."""
        kind, data = stored.kind, stored.data
        where = f"event {stored.seq}: call {self.call_id}"
        problems = self._attempt_problems(stored, where)
        if not problems:
            moved = table.step(self.phase, kind, data)
            if moved is None:
                problems.append(
                    f"{where}: illegal transition: {kind} cannot follow "
                    f"{self.last_kind or 'nothing'} (phase {self.phase})"
                )
            else:
                nxt, refined = moved
                problems += self._money(refined, data, where)
                self._move(nxt, stored)
        if self.phase == "holding" and self.reserved == 0:
            self._move("effect_unknown", stored)  # nothing reserved, so nothing to hold
        if self.phase in ("not_sent", "not_processed") and self.resend_authorized:
            # An operator's resend that did nothing leaves the earlier unknown effect
            # unknown; the authorization stands (contract.md §8).
            self._move("effect_unknown", stored)
        self.last_seq, self.last_kind = stored.seq, kind
        return problems

    def _move(self, phase: str, stored: StoredEvent) -> None:
        self.phase = phase
        stage = table.STAGE_OF[phase]
        if stage is not None:
            self.stage = stage
        data = stored.data
        if stored.kind == "call.manifest":
            self.manifest = tuple(_kept(name, data) for name in MANIFEST_KEPT)
        elif stored.kind == "call.resend_authorized":
            self.resend_authorized = True
        elif stored.kind in ("attempt.interrupted", "call.reconciled") or (
            stored.kind == "call.completed" and data.get("outcome") in ("completed", "failed")
        ):
            self.resend_authorized = False  # spent by an attempt that may have had its effect
            self.resent_unknown = False
        elif stored.kind == "attempt.started":
            self.attempts = int(data["attempt"])  # one more than before: _attempt_problems
            self.starters += ((sys.intern(stored.worker), stored.generation),)
            self.last_attempt_at = float(data.get("at", 0.0))
        elif stored.kind == "attempt.observed":
            self.status = int(data["status"])

    def _attempt_problems(self, stored: StoredEvent, where: str) -> list[str]:
        """Attempt numbering and who may write an attempt's outcome."""
        kind, data = stored.kind, stored.data
        if kind in OUTCOME_KINDS and self.attempts == 0:
            return [f"{where}: settlement without an attempt: {kind} but no attempt.started"]
        if kind == "attempt.started":
            if data.get("attempt") != self.attempts + 1:
                return [
                    f"{where}: attempt numbering: attempt {data.get('attempt')} started "
                    f"after attempt {self.attempts} (an attempt is missing)"
                ]
            if (data.get("worker"), data.get("generation")) != (stored.worker, stored.generation):
                return [f"{where}: attempt.started names a worker other than its writer"]
            return _how_sent_problems(data, where)
        elif kind in OUTCOME_KINDS and "attempt" in data and data["attempt"] != self.attempts:
            return [
                f"{where}: {kind} for attempt {data['attempt']}, but attempt "
                f"{self.attempts} is the last one started"
            ]
        if kind in OWN_OUTCOMES and (stored.worker, stored.generation) != self.starter:
            return [
                f"{where}: {kind} written by {stored.worker} (generation {stored.generation}), "
                f"not by the worker that started attempt {self.attempts}"
            ]
        if kind == "attempt.interrupted" and data.get("by") != stored.worker:
            return [f"{where}: attempt.interrupted names a marker other than its writer"]
        if kind == "attempt.late_answer":
            return self._late_answer_problems(data, where)
        return []

    @property
    def starter(self) -> tuple[str, int]:
        """The worker and generation that started the last attempt (none: empty)."""
        return self.starters[-1] if self.starters else ("", 0)

    def kept(self, name: str, default: Any = None) -> Any:
        """The manifest's ``name`` (one of MANIFEST_KEPT), or ``default`` if it has none."""
        value = self.manifest[_KEPT_AT[name]] if self.manifest else _ABSENT
        return default if value is _ABSENT else value

    def _late_answer_problems(self, data: dict[str, Any], where: str) -> list[str]:
        """A late answer belongs to an attempt started, and names who dispatched it."""
        attempt = data.get("attempt")
        if not isinstance(attempt, int) or not 0 < attempt <= len(self.starters):
            return [f"{where}: attempt.late_answer for attempt {attempt}, which never started"]
        named = (data.get("observed_by"), data.get("generation"))
        if named != self.starters[attempt - 1]:
            worker, generation = self.starters[attempt - 1]
            return [
                f"{where}: attempt.late_answer names {named[0]} (generation {named[1]}) as its "
                f"observer, but attempt {attempt} was started by {worker} (generation {generation})"
            ]
        return []

    def _money(self, refined: str, data: dict[str, Any], where: str) -> list[str]:
        """Check an event's amounts against the call's money so far, then apply them."""
        kind = refined.split(":")[0]
        problems: list[str] = []
        if kind.startswith("budget.") and data.get("budget") != self.kept("budget"):
            problems.append(
                f"{where}: {kind} charges {data.get('budget')!r}, not the call's budget"
            )

        def expect(field: str, value: int) -> None:
            if data.get(field) != value:
                problems.append(f"{where}: {kind} {field} is {data.get(field)}, expected {value}")

        if kind == "budget.reserved":
            self.attempt_reserve = int(data["amount"])
            self.reserved += self.attempt_reserve
            self.reserved_at_admission = self.reserved_at_admission or self.attempt_reserve
        elif kind == "budget.settled":
            expect("reserved", self.attempt_reserve)
            self.reserved -= int(data["reserved"])
            self.cost = (self.cost or 0) + int(data["actual"])
            self.flagged = data.get("flagged") or self.flagged
        elif kind == "budget.released":
            expect("amount", self.attempt_reserve)
            self.resent_unknown = False
            self.reserved -= int(data["amount"])
        elif kind == "budget.held":
            expect("amount", self.reserved)
            if self.phase in ("observed_not_processed", "sent_nothing") and not self.resent_unknown:
                problems.append(f"{where}: holds an attempt that proved nothing, of a call "
                                "whose effect was not unknown before it")  # fmt: skip
            self.resent_unknown = False
            self.reserved -= int(data["amount"])
            self.held += int(data["amount"])
        elif kind == "call.reconciled":
            self.decided_cost = int(data["cost"])
            if data.get("applied") is not True and self.decided_cost != 0:
                problems.append(f"{where}: not applied, yet costs {self.decided_cost}")
            problems += _result_problems(data, where)
        elif kind == "budget.unheld":
            expect("amount", self.held)
            if refined.endswith(":resend"):
                expect("spent", 0)
                self.resent_unknown = True
            elif self.phase in ("settled_ok", "settled_error"):
                # An operator-authorized resend settled: the earlier hold is spent whole.
                expect("spent", self.held)
            else:
                expect("spent", self.decided_cost)
            self.held -= int(data["amount"])
            self.cost = (self.cost or 0) + int(data["spent"])
        elif kind == "budget.corrected":
            expect("settled", self.cost or 0)
            expect("actual", self.decided_cost)
            self.cost = (self.cost or 0) - int(data["settled"]) + int(data["actual"])
        return problems

    @property
    def unfinished(self) -> str | None:
        """What the call still needs when the ledger ends (None: it rests in a stage)."""
        return table.NEEDS.get(self.phase)

    def projection(self) -> dict[str, Any]:
        """The call's state as the store should keep it (docs/contract.md §6 plus its money)."""
        m = self.kept
        return {
            "call_id": self.call_id,
            "stage": self.stage,
            "attempts": self.attempts,
            "idempotency_key": m("idempotency_key"),
            "request_hash": m("request_hash", ""),
            "provider": m("provider", ""),
            "model": m("model"),
            "budget": m("budget", ""),
            "budget_root": m("budget_root", ""),
            "created_at": m("at", 0.0),
            "last_attempt_at": self.last_attempt_at,
            "reserved_at_admission": self.reserved_at_admission,
            "reserved": self.reserved,
            "cost": self.cost,
            "held": self.held,
            "status": self.status,
            "worker": self.starter[0],
            "flagged": self.flagged,
            "idempotency_window_s": m("provider_idempotency_window_s"),
            "resend_authorized": self.resend_authorized,
        }

    def columns(self) -> dict[str, Any]:
        """The columns the store queries (a refused call frees its key)."""
        p = self.projection()
        out = {name: p[name] for name in COLUMN_NAMES}
        if self.stage == "refused":
            out["idempotency_key"] = None
        return out


def _kept(name: str, data: dict[str, Any]) -> Any:
    value = data.get(name, _ABSENT)
    return sys.intern(value) if name in _SHARED and type(value) is str else value


def _result_problems(data: dict[str, Any], where: str) -> list[str]:
    """A decision's kept result (docs/contract.md §4.1): only on an applied decision, as
    text in a body encoding, and never an encoding without a result."""
    if "result" not in data:
        return [f"{where}: result_encoding without a result"] if "result_encoding" in data else []
    result, encoding = data["result"], data.get("result_encoding")
    if data.get("applied") is not True:
        return [f"{where}: a not-applied decision keeps a result"]
    if not isinstance(result, str) or encoding not in ("utf8", "base64"):
        return [f"{where}: its result is not text in utf8 or base64 (got {encoding!r})"]
    if encoding == "base64":
        try:
            base64.b64decode(result, validate=True)
        except (binascii.Error, ValueError):
            return [f"{where}: its result is not valid base64"]
    return []


def _how_sent_problems(data: dict[str, Any], where: str) -> list[str]:
    """An attempt's record of how it went out (contract §6.1): each field absent where
    nothing is recorded, never written empty or null; a credential's digest only beside
    the base URL it went to, and 16 lowercase hex digits."""
    for name in ("op_id_in", "sent_to", "key_digest"):
        if name in data and not (isinstance(data[name], str) and data[name]):
            return [f"{where}: attempt.started records {name} {data[name]!r}"]
    digest = data.get("key_digest")
    if digest is not None and "sent_to" not in data:
        return [f"{where}: attempt.started records key_digest without sent_to"]
    if digest is not None and not (len(digest) == 16 and set(digest) <= set(_HEX)):
        return [f"{where}: attempt.started records key_digest {digest!r}, not 16 hex digits"]
    return []
