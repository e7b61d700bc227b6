"""A ledger with a call in every stage, and how to see what a command line changed in it
(for tests/test_hostile_cli.py).

:func:`staged_ledger` writes real guarded traffic (``AsyncGuardTransport`` over a
respx-mocked OpenAI) and returns the call id of each stage; :func:`run` runs the
``effectguard`` entry point in this process; :func:`snapshot` is everything an operator
can see of a ledger (``calls``, ``budgets``, ``key list``, ``verify``) and the files beside
it, so a test compares it before and after a command.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import respx

from effectguard import AsyncGuardTransport, GuardSettings
from effectguard.config.settings import hash_key
from effectguard.ledger import Ledger, Writer, operations
from effectguard.ops.cli import main
from effectguard.rules.budget import BudgetPolicy
from effectguard.rules.events import AttemptLateAnswer, KeyCreated

CHAT_URL = "https://api.openai.com/v1/chat/completions"
MODEL = "gpt-4o-mini"
#: name -> (prompt, budget): the prompt tells the mocked upstream how to answer.
PLAN = {
    "completed": ("done", "team"),
    "failed": ("conflict", "team"),  # 409: an error OpenAI does not declare unprocessed
    "unknown": ("timeout 1", "team"),
    "unknown_late": ("timeout 2", "team"),  # a late 500 (effect unknown) is kept for it
    "unknown_evidence": ("timeout 3", "team"),  # a late 200 is kept for it
    "not_sent": ("connect", "team"),
    "not_processed": ("busy", "team"),  # 429, retried once, still 429
    "refused": ("done", "poor"),  # poor's limit is 0
    "in_flight": ("crash", "team"),  # the process "dies" with the call on the wire
}
#: Nodes whose periods reset, each in a zone of its own.
PERIODS = [
    BudgetPolicy("daily", 10**9, "day", "Pacific/Kiritimati"),
    BudgetPolicy("weekly", 10**9, "week", "Etc/GMT+12"),
    BudgetPolicy("monthly", 10**9, "month", "America/Los_Angeles"),
]


class Crash(BaseException):
    """Raised from the upstream: the guard never learns how the call ended (in_flight)."""


def _answer(request: httpx.Request) -> httpx.Response:
    body = request.content
    if b"timeout" in body:
        raise httpx.ReadTimeout("upstream read timed out", request=request)
    if b"connect" in body:
        raise httpx.ConnectError("connection refused", request=request)
    if b"crash" in body:
        raise Crash
    if b"conflict" in body or b"busy" in body:
        status = 409 if b"conflict" in body else 429
        return httpx.Response(status, json={"error": {"message": "no", "type": "x"}})
    usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    choice = {"index": 0, "message": {"role": "assistant", "content": "hi"}}
    return httpx.Response(
        200,
        json={"id": "c1", "object": "chat.completion", "model": MODEL, "choices": [choice]}
        | {"usage": usage, "created": 1},
    )


async def _traffic(ledger: str) -> dict[str, str]:
    ids: dict[str, str] = {}
    transport = AsyncGuardTransport(
        ledger=ledger, settings=GuardSettings(retry_wait_s=0, retry_wait_max_s=0)
    )
    with respx.mock() as mock:
        mock.post(CHAT_URL).mock(side_effect=_answer)
        async with httpx.AsyncClient(transport=transport, timeout=10) as client:
            for name, (prompt, budget) in PLAN.items():
                body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}]}
                headers = {"Effectguard-Budget": budget}
                with contextlib.suppress(Crash):
                    response = await client.post(
                        CHAT_URL, json=body | {"max_tokens": 10}, headers=headers
                    )
                    ids[name] = response.headers["effectguard-call-id"]
    await transport.aclose()
    return ids


def _late(call_id: str, started: Any, status: int, effect: str) -> AttemptLateAnswer:
    return AttemptLateAnswer(
        call=call_id,
        attempt=1,
        status=status,
        effect=effect,
        body_digest="sha256:" + "0" * 64,
        body_bytes=2,
        usage=None,
        usage_problem=None,
        cost=None if effect == "unknown" else 1000,
        observed_by=started.worker,
        generation=started.generation,
        reason="fenced",
    )


async def _operator_state(ledger: str, ids: dict[str, str]) -> None:
    """Late answers, period nodes and keys: what the traffic alone does not write."""
    async with Ledger.open(ledger) as book:
        for policy in PERIODS:
            await book.set_policy(policy)
        await book.create_key(KeyCreated(name="ci", sha256=hash_key("eg-ci"), budget_root="team"))
        await book.create_key(KeyCreated(name="old", sha256=hash_key("eg-old"), budget_root="team"))
        await book.revoke_key("old")
        writer = await book.store.write(
            Writer("late-worker", 0),
            lambda tx: operations.register_worker(
                tx, worker="late-worker", host="h", pid=1, lease_s=30.0
            ),
        )
        for name, status, effect in (
            ("unknown_late", 500, "unknown"),
            ("unknown_evidence", 200, "applied"),
        ):
            started = next(e for e in await book.events(ids[name]) if e.kind == "attempt.started")
            await book.record_late_answer(writer, _late(ids[name], started, status, effect))
        (held,) = await book.calls(stage="in_flight")
        ids["in_flight"] = held.call_id
        await _owner_lives_on(book, ledger, held.worker)


async def _owner_lives_on(book: Ledger, ledger: str, worker: str) -> None:
    """Make the in-flight call's worker look alive to every command: a worker of another
    host (this one cannot see its lock) whose lease runs for years. ``reconcile`` would
    otherwise take its call over (contract §7), and the refusal rows want it refused."""
    (row,) = [r for r in await book.store.live_workers() if r.worker == worker]
    owner = Writer(worker, row.generation)
    await book.store.write(owner, lambda tx: operations.heartbeat(tx, owner, 10.0**9))
    (Path(f"{ledger}.workers") / f"{worker}.lock").unlink()


async def _staged(ledger: str) -> dict[str, str]:
    async with Ledger.open(ledger) as book:
        await book.set_limit("poor", 0)
    ids = await _traffic(ledger)
    await _operator_state(ledger, ids)
    return ids


def staged_ledger(ledger: Path) -> dict[str, str]:
    """Write a ledger with a call in every stage of §6; return each :data:`PLAN` name's id."""
    return asyncio.run(asyncio.wait_for(_staged(str(ledger)), timeout=60))


@dataclass(frozen=True, slots=True)
class Ran:
    """What one command line did: its exit code and what it printed."""

    code: int
    out: str
    err: str


def run(*argv: str) -> Ran:
    """``effectguard ARGV`` through the entry point's own code, in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code if isinstance(exc.code, int) else 2
    return Ran(code, out.getvalue(), err.getvalue())


def serve_refusing(*args: str, cwd: Path | None = None) -> Ran:
    """``effectguard serve ARGS`` in a process of its own, which must exit within 30 s: a
    serve that took what it should refuse would otherwise listen forever, in this process."""
    command = [sys.executable, "-m", "effectguard", "serve", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30, cwd=cwd)
    return Ran(done.returncode, done.stdout, done.stderr)


def _json(*argv: str) -> Any:
    done = run(*argv, "--json")
    assert done.code in (0, 1), done.err
    return json.loads(done.out)


def snapshot(ledger: Path) -> dict[str, Any]:
    """All an operator sees of ``ledger``: its calls, budgets, keys, verify's report, and the
    files beside it."""
    at = ("--ledger", str(ledger))
    report = _json("verify", *at)
    return {
        "calls": _json("calls", *at),
        "budgets": _json("budgets", *at),
        "keys": _json("key", "list", *at),
        "verify": (report["ok"], report["events"], report["problems"]),
        "files": _files(ledger),
    }


def _files(ledger: Path) -> dict[str, str]:
    """The files beside ``ledger``, each with the digest of its bytes (the ledger's own
    files are left out: the views above are what it holds)."""
    found = {}
    for path in sorted(ledger.parent.iterdir()):
        if path.name.startswith(ledger.name):
            found[path.name] = "the ledger's" if path.name == ledger.name else ""
        elif path.is_file():
            found[path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            found[path.name] = "directory"
    # SQLite's -wal and -shm come and go with its connections.
    return {k: v for k, v in found.items() if not k.endswith(("-wal", "-shm"))}
