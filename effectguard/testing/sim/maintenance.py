"""``--maintenance``: an operator's maintenance commands against the live ledger.

While the replicas serve and go through their faults, an operator runs, as separate
processes: ``effectguard backup`` (SQLite: each copy to a new file outside the ledger's
directory; a PostgreSQL ledger is backed up with PostgreSQL's own tools, outside
effectguard, so a schedule on one draws none), ``effectguard archive`` (SQLite: into
files beside the ledger, the default names; PostgreSQL: into the ledger's
``archived_events`` table) and
``effectguard reconcile CALL --resend`` of an ``effect_unknown`` keyed call, after which
its client sends 1-3 copies of the call at once through any replicas. Before an archive
the operator decides the oldest unknown calls by the provider's records (``reconcile
--applied`` or ``--not-applied``): an unknown call holds an archive's cut, and so does
every call whose life overlaps one. Every command is
noted in :attr:`Cluster.actions` with its exit code; a backup or an archive with its
output (the copy, the files), which the evidence verifies after the run.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import httpx

from effectguard.providers.declaration import load_providers
from effectguard.testing.receiptfile import read_receipts
from effectguard.testing.sim.clients import Answer, send
from effectguard.testing.sim.cluster import Cluster
from effectguard.testing.sim.schedule import MAINTENANCE_ACTIONS, Fault

__all__ = [
    "ALLOWED_EXITS",
    "archive_files",
    "backups_dir",
    "maintain",
    "no_effect_statuses",
]

#: The exit codes each command may end with (docs/contract.md §8): 2 a file it may not
#: write (or a ``.partial`` left), 3 the ledger refused (an archive that lost a race, a
#: resend the call's stage no longer allows), 4 the ledger unavailable (full, read-only).
ALLOWED_EXITS: Final = {
    "backup": frozenset({0, 2, 4}),
    "archive": frozenset({0, 2, 3, 4}),
    "resend": frozenset({0, 3, 4}),
    "calls_listed": frozenset({0, 4}),
    "decide": frozenset({0, 3, 4}),
    "shown": frozenset({0, 3, 4}),
}
#: A maintenance command still running after this long is ended, and noted failed.
_TIMEOUT_S = 120
#: Who the operator's reconciles name (``--by``).
_BY = "sim-operator"
#: Before an archive, the operator decides at most this many of the oldest unknown calls,
#: this many at once.
_DECISIONS = 8
_AT_ONCE = 2


def backups_dir(workdir: Path) -> Path:
    """Where the backups go: outside the ledger's directory (a tmpfs the run may fill)."""
    return workdir / "backups"


def archive_files(ledger: str) -> list[Path]:
    """The archive files beside a SQLite ledger (the default names), oldest range first."""
    path = Path(ledger)
    found = path.parent.glob(f"{path.stem}-archive-*.jsonl.gz")
    return sorted(found, key=lambda p: int(p.name.split("-archive-")[1].split("-")[0]))


async def maintain(cluster: Cluster, client: httpx.AsyncClient, start: float) -> list[Answer]:
    """Apply the maintenance actions in order; the answers to the authorized resends."""
    answers: list[Answer] = []
    mine = [f for f in cluster.schedule.faults if f.kind in MAINTENANCE_ACTIONS]
    for n, fault in enumerate(mine):
        await asyncio.sleep(max(0.0, start + fault.at - time.monotonic()))
        if fault.kind == "backup" and cluster.schedule.ledger != "sqlite":
            cluster.note("backup_skipped", reason="PostgreSQL is backed up with its own tools")
        elif fault.kind == "backup":
            await asyncio.to_thread(_backup, cluster, n)
        elif fault.kind == "archive":
            await _archive(cluster, fault.point or "50000")
        else:
            answers += await _resend(cluster, client, fault, n)
    return answers


def _cli(
    cluster: Cluster,
    action: str,
    argv: list[str],
    noted: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    **detail: Any,
) -> dict[str, Any] | None:
    """Run ``effectguard ARGV --ledger L``; note ``action`` (exit 0, with what ``noted``
    picks from its JSON) or ``action_failed`` with its exit code and last words (a command
    still running after two minutes is ended: exit None); the JSON it printed on exit 0."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "effectguard", *argv, "--ledger", cluster.ledger],
            env=cluster.env,
            capture_output=True,
            text=True,
            timeout=_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        cluster.note(f"{action}_failed", **detail, code=None, error=f"ran past {_TIMEOUT_S} s")
        return None
    traceback = "Traceback (most recent call last)" in done.stderr
    if done.returncode == 0 and not traceback:
        try:
            out = json.loads(done.stdout)
        except ValueError:
            out = {"output": done.stdout.strip()[-300:]}
        out = out if isinstance(out, dict) else {"items": out}
        cluster.note(action, **detail, **(noted(out) if noted else {}), code=0)
        return out
    error = (done.stderr or done.stdout).strip()[-300:]
    cluster.note(f"{action}_failed", **detail, code=done.returncode, error=error, crashed=traceback)
    return None


def _backup(cluster: Cluster, n: int) -> None:
    target = backups_dir(cluster.workdir) / f"backup-{n:03d}.db"
    target.parent.mkdir(exist_ok=True)
    _cli(cluster, "backup", ["backup", str(target), "--json"], path=str(target))


async def _archive(cluster: Cluster, step_events: str) -> None:
    """Decide the oldest unknown calls by the provider's records (an unknown call holds
    an archive's cut, and so does a decided one whose life overlaps an unknown one), a few
    at once, then ``archive`` everything settled."""
    unknown = await _unknown_calls(cluster)
    room = asyncio.Semaphore(_AT_ONCE)

    async def decide(item: dict[str, Any]) -> None:
        async with room:
            await asyncio.to_thread(_decide, cluster, item)

    await asyncio.gather(*(decide(item) for item in unknown[:_DECISIONS]))
    argv = ["archive", "--before", "2999-01-01", "--step-events", step_events, "--json"]
    await asyncio.to_thread(_cli, cluster, "archive", argv, _archived)


def _archived(out: dict[str, Any]) -> dict[str, Any]:
    """What an archive's note keeps: the files it says it wrote (which must verify), how
    many events it moved, and what held its cut."""
    files = [str(f) for f in out.get("files", [])]
    return {"files": files, "events": out.get("events"), "held_by": out.get("held_by")}


def _decide(cluster: Cluster, item: dict[str, Any]) -> None:
    """``reconcile CALL --applied|--not-applied --attempt N`` as the provider's records say:
    applied when a receipt of the call's requests was answered below 400 (the fake provider
    applies those; a dropped answer's receipt says 200). Its requests are the receipts of
    its operation id or, for a call without one, those tagged with its scheduled call's id
    (its client learnt the call id from ``Effectguard-Call-Id``; a client whose connection
    failed did not, and the call's prompt, which ``show`` prints, names it)."""
    call_id = str(item["call_id"])
    scheduled = cluster.seen.get(call_id)
    if scheduled is None:
        shown = _cli(cluster, "shown", ["show", call_id, "--json", "--full"])
        prompt = json.dumps((shown or {}).get("request"), ensure_ascii=False)
        found = re.search(rf"sim {cluster.schedule.seed} ([a-z]\d{{4}})", prompt)
        if found is None:
            return
        scheduled = found[1]
    receipts = read_receipts(cluster.workdir / "receipts.jsonl")
    tag = f"{scheduled}."
    mine = [r for r in receipts if r.get("op") == call_id] or [
        r for r in receipts if str(r.get("tag", "")).startswith(tag)
    ]
    applied = any(isinstance(r.get("status"), int) and r["status"] < 400 for r in mine)
    argv = ["reconcile", call_id, "--applied" if applied else "--not-applied"]
    argv += ["--note", "by the provider's records", "--by", _BY]
    argv += ["--attempt", str(item["attempts"]), "--json"]
    _cli(cluster, "decide", argv, call=call_id, applied=applied)


async def _unknown_calls(cluster: Cluster) -> list[dict[str, Any]]:
    """``calls --state effect_unknown --json``, oldest first."""
    argv = ["calls", "--state", "effect_unknown", "--json"]
    listed = await asyncio.to_thread(_cli, cluster, "calls_listed", argv)
    items = list((listed or {}).get("items", []))
    return sorted(items, key=lambda c: float(c["created_at"]))


async def _resend(
    cluster: Cluster, client: httpx.AsyncClient, fault: Fault, n: int
) -> list[Answer]:
    """Authorize a resend of one unknown keyed call of this run, then send its copies."""
    copies, _, pick = (fault.point or "1:0").partition(":")
    prefix = f"k-{cluster.schedule.seed}-"
    by_id = {call.id: call for call in cluster.schedule.calls}
    unknown = sorted(
        (str(c["call_id"]), by_id[str(c["idempotency_key"])[len(prefix) :]])
        for c in await _unknown_calls(cluster)
        if str(c.get("idempotency_key") or "").startswith(prefix)
        and str(c["idempotency_key"])[len(prefix) :] in by_id
    )
    if not unknown:
        cluster.note("resend_none_unknown")
        return []
    call_id, call = unknown[int(pick) % len(unknown)]
    argv = ["reconcile", call_id, "--resend", "--note", "sim: authorized resend", "--by", _BY]
    if await asyncio.to_thread(_cli, cluster, "resend", [*argv, "--json"], call=call_id) is None:
        return []
    replicas = [call.replicas[(n + k) % len(call.replicas)] for k in range(int(copies))]
    return list(
        await asyncio.gather(
            *(
                send(
                    client,
                    cluster.replicas[replica].url,
                    call,
                    kind="resend",
                    tag=f"{call.id}.a{n}.{k}",
                    replica=replica,
                    retry_count=0,
                    keys=cluster.keys,
                )
                for k, replica in enumerate(replicas)
            )
        )
    )


def no_effect_statuses(workdir: Path) -> dict[str, frozenset[int]]:
    """Each provider's statuses that prove a request did nothing (declared not processed,
    or transient "none"), as the replicas read the declarations (the bundled ones and the
    run's own)."""
    extra = workdir / "providers"
    providers = load_providers([extra] if extra.is_dir() else [])
    return {name: p.no_effect_statuses for name, p in providers.items()}
