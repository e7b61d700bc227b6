"""The invariants of an operator's key and rate-limit changes (``--operator``): pure
functions of the :class:`Evidence`, as the rest of :mod:`~effectguard.testing.sim.invariants`.

What the contract promises (``key revoke``, ``key new``, §5.6):

- a revoked key is refused by every replica within ``key_refresh_s`` of the command's
  return while the ledger's reads work, and never accepted for longer than
  ``key_refresh_s`` + 5 s whatever they do (a replica's copy of the keys older than that
  answers 503 ``ledger_unavailable``). The checks hold the replicas to the second bound,
  which a paused replica (SIGSTOP past the lease) must keep too, and flag (as settlement
  overshoots are) what got past the first;
- a key made with ``key new`` is accepted within the same delays;
- ``rpm``, ``tpm`` and ``concurrency`` hold exactly, across replicas, from the
  declaration that set them: read from the event log, as the admission transaction reads
  them (a window's tokens are the estimates of the attempts it counted, each replaced by
  its call's reported tokens once it settles). The window is the ledger clock's minute:
  after a step back into the minute before, it keeps counting; further back, it starts
  over (``--clock-steps`` steps that clock).

Times: a client's ``sent_at`` and the commands' ``began``/``returned`` are one host's
wall clock (``time.time()``), as the ledger's event times are.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Final

from effectguard.config.defaults import KEY_READ_WAIT_S
from effectguard.rules.budget import ancestors
from effectguard.rules.events import StoredEvent, event_from_data
from effectguard.rules.ratelimit import KEPT_BACK, minute_of
from effectguard.rules.workstate import WorkState, apply
from effectguard.testing.sim.clients import Answer
from effectguard.testing.sim.evidence import Evidence
from effectguard.testing.sim.schedule import KEY_REFRESH_S
from effectguard.testing.sim.violation import Violation

__all__ = [
    "KEY_INVARIANTS",
    "key_summary",
    "late_keys",
    "new_keys_accepted",
    "rate_limits_held",
    "revoked_keys_refused",
]

KEY_INVARIANTS: Final = {
    "revoked_key_admitted": "a request sent with a key more than key_refresh_s + 5 s after "
    "its revocation returned is refused (401, or 503 ledger_unavailable) and reaches "
    "neither the ledger nor the provider",
    "new_key_refused": "a request sent with a new key more than key_refresh_s + 5 s after "
    "`key new` returned (and answered before its revocation began) is not refused 401",
    "rate_limit_exceeded": "no admission takes a node past the rpm, tpm or concurrency in "
    "force (rpm and tpm counted from the declaration that gave the node rate limits)",
}
#: The documented bound on a key change reaching every replica, whatever the ledger's
#: reads do (contract, ``key revoke``): past it a stale copy is refused 503.
HARD_BOUND_S: Final = KEY_REFRESH_S + KEY_READ_WAIT_S
_SIM_CALL: Final = re.compile(r"sim \d+ ([cpq]\d{4})")


def _done(evidence: Evidence, action: str, moment: str = "returned") -> dict[str, float]:
    return {a["name"]: float(a[moment]) for a in evidence.key_actions if a["action"] == action}


def _refused(answer: Answer) -> bool:
    """Refused before admission: 401, or 503 ``ledger_unavailable`` (a stale key copy)."""
    return answer.status == 401 or (
        answer.status == 503 and answer.error_type == "ledger_unavailable"
    )


def _past(answer: Answer, since: dict[str, float], bound: float) -> bool:
    at = since.get(answer.proxy_key or "")
    return at is not None and answer.sent_at > at + bound


def revoked_keys_refused(evidence: Evidence) -> list[Violation]:
    """Past the hard bound, a revoked key's request is refused, leaves no receipt (by its
    tag), and a scheduled call every request of which was such leaves no manifest."""
    revoked = _done(evidence, "key_revoke")
    tags = {r.get("tag") for r in evidence.receipts}
    out: list[Violation] = []
    dead: dict[str, bool] = {}  # sim call -> every request of it past a revocation
    for answer in evidence.answers:
        late = _past(answer, revoked, HARD_BOUND_S)
        dead[answer.call] = dead.get(answer.call, True) and late
        if not late:
            continue
        how = []
        if answer.status is not None and not _refused(answer):
            how.append(f"answered {answer.status} {answer.error_type or ''}".rstrip())
        if answer.tag in tags:
            how.append("reached the provider")
        if how:
            gap = answer.sent_at - revoked[answer.proxy_key or ""]
            out.append(
                Violation(
                    "revoked_key_admitted",
                    f"request {answer.tag} with key {answer.proxy_key}, sent {gap:.2f} s "
                    f"after its revocation returned, to replica {answer.replica}: "
                    + " and ".join(how),
                )
            )
    for call_id, sim_call in _manifests(evidence.events):
        if dead.get(sim_call):
            out.append(
                Violation(
                    "revoked_key_admitted",
                    f"call {call_id} (scheduled call {sim_call}) is in the ledger, though "
                    "every request of it carried a key revoked long before",
                )
            )
    return out


def _manifests(events: list[StoredEvent]) -> list[tuple[str, str]]:
    """(ledger call id, scheduled call id) of every manifest whose body names the latter."""
    out = []
    for e in events:
        if e.kind == "call.manifest" and e.call_id is not None:
            found = _SIM_CALL.search(str(e.data.get("body", "")))
            if found:
                out.append((e.call_id, found.group(1)))
    return out


def _answered(answer: Answer) -> float:
    """When the answer came back (its send time where none is known): a request sent to a
    paused replica before a revocation is judged after it."""
    return max(answer.sent_at, answer.answered_at)


def new_keys_accepted(evidence: Evidence) -> list[Violation]:
    """Past the hard bound after ``key new`` returned, and answered before its revocation
    began, the key is not refused 401."""
    made = _done(evidence, "key_new")
    revoking = _done(evidence, "key_revoke", "began")
    return [
        Violation(
            "new_key_refused",
            f"request {a.tag} with key {a.proxy_key}, sent "
            f"{a.sent_at - made[a.proxy_key or '']:.2f} s after `key new` returned, to "
            f"replica {a.replica}: refused 401",
        )
        for a in evidence.answers
        if a.status == 401
        and _past(a, made, HARD_BOUND_S)
        and _answered(a) < revoking.get(a.proxy_key or "", float("inf"))
    ]


def key_summary(evidence: Evidence) -> str:
    """How many requests carried a revoked key past each bound, and how many were refused
    (so a run shows whether the key invariants had anything to check)."""
    revoked = _done(evidence, "key_revoke")
    past = [a for a in evidence.answers if _past(a, revoked, KEY_REFRESH_S)]
    hard = [a for a in past if _past(a, revoked, HARD_BOUND_S)]
    return (
        f"revocations {len(revoked)}; requests with a revoked key past key_refresh_s "
        f"{len(past)} ({sum(map(_refused, past))} refused), past the hard bound {len(hard)} "
        f"({sum(map(_refused, hard))} refused)"
    )


def late_keys(evidence: Evidence) -> list[str]:
    """Key changes honoured later than ``key_refresh_s`` but within the hard bound: allowed
    when a replica could not read the keys (or was paused), and flagged."""
    revoked = _done(evidence, "key_revoke")
    made = _done(evidence, "key_new")
    revoking = _done(evidence, "key_revoke", "began")
    flags = []
    for a in evidence.answers:
        if a.status is None or _past(a, revoked, HARD_BOUND_S) or _past(a, made, HARD_BOUND_S):
            continue
        key = a.proxy_key or ""
        if _past(a, revoked, KEY_REFRESH_S) and not _refused(a):
            gap = a.sent_at - revoked[key]
            flags.append(f"{a.tag}: revoked key {key} answered {a.status}, {gap:.2f} s after")
        elif (
            _past(a, made, KEY_REFRESH_S)
            and a.status == 401
            and _answered(a) < revoking.get(key, float("inf"))
        ):
            gap = a.sent_at - made[key]
            flags.append(f"{a.tag}: new key {key} refused 401, {gap:.2f} s after `key new`")
    return flags


@dataclass
class _Window:
    """A node's minute: the attempts counted in it, and their tokens (each call's last
    estimate counted here, until its settlement replaces it with the reported tokens)."""

    minute: int
    attempts: int = 0
    tokens: int = 0
    counted: dict[str, int] = field(default_factory=dict)


def rate_limits_held(evidence: Evidence) -> list[Violation]:
    """Fold the log: at each reservation (an attempt admitted), every ancestor's ``rpm``
    and ``tpm`` window (its minute's attempts and their tokens since the node gained rate
    limits) and its calls in flight (other than this one) leave room for it."""
    policies: dict[str, tuple[Any, Any, Any]] = {}  # path -> rpm, tpm, concurrency
    windows: dict[str, _Window] = {}
    states: dict[str, WorkState] = defaultdict(WorkState)
    budget_of: dict[str, str] = {}
    out: list[Violation] = []
    for e in evidence.events:
        if e.kind == "budget.limit_set":
            _declared(policies, windows, e)
        elif e.kind == "call.manifest" and e.call_id is not None:
            budget_of[e.call_id] = str(e.data["budget"])
        elif e.kind == "budget.reserved" and e.call_id is not None:
            in_flight = [c for c, s in states.items() if s.stage == "in_flight" and c != e.call_id]
            for path in ancestors(str(e.data["budget"])):
                under = sum(1 for c in in_flight if path in ancestors(budget_of.get(c, "")))
                out += _admitted(policies, windows, path, e, under)
        elif e.kind == "budget.settled" and e.data.get("tokens") is not None:
            for path in ancestors(str(e.data["budget"])):
                _settled(windows.get(path), str(e.call_id), int(e.data["tokens"]))
        if e.call_id is not None:
            states[e.call_id] = apply(states[e.call_id], event_from_data(e.kind, e.data))
    return out


def _declared(
    policies: dict[str, tuple[Any, Any, Any]],
    windows: dict[str, _Window],
    e: StoredEvent,
) -> None:
    """A node's rates declared: gaining ``rpm`` or ``tpm`` starts its window afresh;
    losing the last of them ends it; a changed limit keeps what it counted."""
    path = str(e.data["path"])
    rates = (e.data.get("rpm"), e.data.get("tpm"), e.data.get("concurrency"))
    before = policies.get(path, (None, None, None))
    had, has = before[:2] != (None, None), rates[:2] != (None, None)
    if has and not had:
        windows[path] = _Window(minute_of(e.at))
    elif not has:
        windows.pop(path, None)
    policies[path] = rates


def _settled(window: _Window | None, call_id: str, tokens: int) -> None:
    """A call settled at ``tokens``: its estimate replaced, where its window counted it."""
    if window is not None and call_id in window.counted:
        window.tokens = max(0, window.tokens + tokens - window.counted.pop(call_id))


def _admitted(
    policies: dict[str, tuple[Any, Any, Any]],
    windows: dict[str, _Window],
    path: str,
    e: StoredEvent,
    in_flight: int,
) -> list[Violation]:
    """One attempt admitted under ``path`` at event ``e``: counted in its window, and
    checked against its ``rpm``, ``tpm`` and ``concurrency``."""
    rpm, tpm, concurrency = policies.get(path, (None, None, None))
    out = []
    window = windows.get(path)
    if window is not None:
        minute = minute_of(e.at)
        # A later minute starts empty; so does one further back than the minute before
        # (a clock corrected after running ahead, §5.6), which the window stops counting.
        if not window.minute - KEPT_BACK <= minute <= window.minute:
            window = windows[path] = _Window(minute)
        tokens = int(e.data.get("tokens", 0))
        if rpm is not None and window.attempts + 1 > rpm:
            out.append(
                Violation(
                    "rate_limit_exceeded",
                    f"call {e.call_id} admitted at event {e.seq} as attempt "
                    f"{window.attempts + 1} of its minute under {path!r}, whose rpm is {rpm}",
                )
            )
        if tpm is not None and window.tokens + tokens > tpm:
            out.append(
                Violation(
                    "rate_limit_exceeded",
                    f"call {e.call_id} admitted at event {e.seq} with {tokens} tokens, after "
                    f"{window.tokens} in its minute under {path!r}, whose tpm is {tpm}",
                )
            )
        window.attempts += 1
        window.tokens += tokens
        window.counted[str(e.call_id)] = tokens
    if concurrency is not None and in_flight + 1 > concurrency:
        out.append(
            Violation(
                "rate_limit_exceeded",
                f"call {e.call_id} admitted at event {e.seq} with {in_flight} other calls "
                f"in flight under {path!r}, whose concurrency is {concurrency}",
            )
        )
    return out
