"""Archive checkpoints: what the verifier carries across a cut of the chain.

A ``ledger.archived`` event says events ``first_seq..last_seq`` left the live ledger. For
``verify`` to start at the cut it needs what those events leave behind: the chain's last
digest, the registered and fenced workers, the budget counters per (path, period), the
policies and which limits an operator set, the keys and the rate windows.
:func:`export_state` writes that down from a verifier that folded the archived events
itself; :func:`seed` starts a verifier from it.
The state is plain JSON, so the archive file and the checkpoint event carry it as they are.
"""

from __future__ import annotations

from typing import Any, Protocol

from effectguard.ops.audit.budgets import Budgets, Node, Policy
from effectguard.ops.audit.chain import Chain
from effectguard.ops.audit.keys import KeyRow, Keys
from effectguard.ops.audit.rates import RateRow, Rates, export
from effectguard.ops.audit.report import VerifyReport
from effectguard.ops.audit.writers import Writers

KIND = "ledger.archived"


class Folded(Protocol):
    """The parts of a verifier a checkpoint carries (and the report it tells)."""

    report: VerifyReport
    chain: Chain
    writers: Writers
    budgets: Budgets
    keys: Keys
    rates: Rates


def export_state(v: Folded) -> dict[str, Any]:
    """What the events folded so far leave behind, as JSON-ready values."""
    w = v.writers
    return {
        "workers": sorted([name, gen] for name, gen in w.current.items()),
        "registered": sorted([n, g, s] for (n, g), s in w.registered_at.items()),
        "fenced": sorted([n, g, s] for (n, g), s in w.fenced_at.items()),
        "top_generation": w.top_generation,
        "budgets": sorted([p, per, *node.row()] for (p, per), node in v.budgets.nodes.items()),
        "policies": sorted([path, *policy] for path, policy in v.budgets.policies.items()),
        "keys": sorted(_key_row(row) for row in v.keys.rows.values()),
        "rates": export(v.rates.windows),
        "operator_limits": sorted([path, seq] for path, seq in v.budgets.operator_set.items()),
    }


def seed(v: Folded, state: dict[str, Any], *, next_seq: int, prev_digest: str) -> None:
    """Start ``v`` at event ``next_seq`` with what a checkpoint says came before it."""
    v.chain.expected_seq = next_seq
    v.chain.prev = prev_digest
    w = v.writers
    w.current = {str(n): int(g) for n, g in state["workers"]}
    w.registered_at = {(str(n), int(g)): int(s) for n, g, s in state["registered"]}
    w.fenced_at = {(str(n), int(g)): int(s) for n, g, s in state["fenced"]}
    w.top_generation = int(state["top_generation"])
    v.budgets.nodes = {(str(p), str(per)): Node(r, s, h) for p, per, r, s, h in state["budgets"]}
    v.budgets.policies = {str(row[0]): _policy(row[1:]) for row in state["policies"]}
    v.keys.rows = {str(row[0]): _key(row) for row in state["keys"]}
    if "operator_limits" in state:
        v.budgets.operator_set = {str(p): int(seq) for p, seq in state["operator_limits"]}
    else:  # written before 2026-12-04, not saying who set a limit: each as an operator's (0)
        v.budgets.operator_set = dict.fromkeys(v.budgets.policies, 0)
    if "rates" in state:
        v.rates.seed({str(row[0]): _window(row) for row in state["rates"]})
    else:  # a checkpoint written before windows were carried: they are unknown at the cut
        v.rates.partial = True


def resume(v: Folded, found: dict[str, Any] | None, *, first: int) -> None:
    """Start ``v`` at a live chain whose first event is ``first`` (above 1: a cut), from
    ``found``, the data of the checkpoint that archived events ``..first-1``; without one,
    name it missing (the chain check then names the gap it leaves)."""
    if found is None:
        v.report.broken(
            first,
            f"event {first}: the live chain starts at event {first}, but no {KIND} "
            f"checkpoint says the events through {first - 1} were archived: the last "
            "archive's checkpoint is missing (deleted, or edited to name another range)",
        )
        return
    seed(v, found["state"], next_seq=first, prev_digest=found["last_digest"])


def same_state(v: Folded, recorded: Any) -> bool:
    """Whether a checkpoint's ``recorded`` state is what folding its events gave.

    A checkpoint written before rate windows were carried has no ``rates``, nor, before
    2026-12-04, ``operator_limits``: it is judged on the rest. One written by an older
    release may carry the windows as that release counted them (:meth:`Rates.exports`).
    """
    folded = export_state(v)
    if isinstance(recorded, dict) and "operator_limits" not in recorded:
        folded.pop("operator_limits")
    if isinstance(recorded, dict) and "rates" not in recorded:
        folded = {k: value for k, value in folded.items() if k != "rates"}
    elif isinstance(recorded, dict) and folded == {**recorded, "rates": folded["rates"]}:
        return recorded["rates"] in v.rates.exports()
    return bool(folded == recorded)


def check(seq: int, data: dict[str, Any]) -> list[str]:
    """What is wrong with a checkpoint event on its own (its range and counts)."""
    first, last = int(data["first_seq"]), int(data["last_seq"])
    problems = []
    if not 1 <= first <= last < seq:
        problems.append(f"event {seq}: archives events {first}..{last}, not before it")
    if int(data["events"]) != last - first + 1:
        problems.append(f"event {seq}: archives {data['events']} events of {first}..{last}")
    return problems


def _window(row: list[Any]) -> RateRow:
    """A window a checkpoint carried: one without ``since`` was written by a release
    before writer format 2, which did not record it; one without ``reached`` before
    format 6."""
    path, minute, requests, tokens, *rest = row
    since, reached = (*(None if v is None else int(v) for v in rest), None, None)[:2]
    return RateRow(str(path), int(minute), int(requests), int(tokens), since, reached)


def _policy(values: list[Any]) -> Policy:
    limit, period, tz, rpm, tpm, concurrency = values
    return (limit, str(period), str(tz), rpm, tpm, concurrency)


def _key_row(row: KeyRow) -> list[Any]:
    """A key's row as JSON reads it back: its models and providers as lists (a tuple never
    equals the list a checkpoint holds, and every restricted key's file read as broken)."""
    return [list(value) if isinstance(value, tuple) else value for value in row]


def _key(row: list[Any]) -> KeyRow:
    name, sha, root, created, expires, models, providers, revoked = row
    return KeyRow(
        str(name),
        str(sha),
        str(root),
        float(created),
        expires,
        None if models is None else tuple(models),
        None if providers is None else tuple(providers),
        revoked,
    )
