"""After a crash with nothing restarted, the CLI knows a call in flight will not finish.

A call stays ``in_flight`` until a sweep marks it ``attempt.interrupted`` (contract §7),
and only a process that writes sweeps. Before, after ``serve`` was killed and not
restarted, ``show`` said "wait (it is in flight)" for good, ``reconcile`` refused the
call (exit 3), and ``reconcile --auto`` found nothing to ask. Now ``show`` says the
owner is gone and why, and ``reconcile`` (every form) takes the dead worker over first,
as the next start of ``serve`` would. A live owner's call is still refused, and nothing
is written for it. Effects are counted from the fake provider's receipts.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from mountkit import small_tmpfs
from pgkit import ledger_url  # noqa: F401  (fixture)
from test_reconcile_auto import SEND, crash, email, upstreams
from toolkit import cli_json as cli
from toolkit import cli_run as run
from toolkit import held_in_flight

from effectguard.callpath.recovery import lock_dir_for
from effectguard.testing import FakeProvider, Proxy, fake_provider, start_proxy

pytestmark = pytest.mark.slow


@dataclass
class UnderWay:
    """A call a ``serve`` has sent and the provider holds, its client waiting in a thread."""

    proxy: Proxy
    call_id: str
    answers: list[httpx.Response]
    client: threading.Thread
    #: What the client got instead of an answer (the server killed under it).
    broken: list[httpx.TransportError]


@contextlib.contextmanager
def call_under_way(
    ledger: Path, fake: FakeProvider, to: str, headers: dict[str, str], args: tuple[str, ...] = ()
) -> Iterator[UnderWay]:
    """A ``serve`` on ``ledger`` (stopped on exit) and one email sent through it from a
    thread, yielded once the provider holds the request (``headers``' ``x-fake-delay``
    says how long it then waits): in flight is recorded before the send, and a worker
    paused before it, resumed past its lease, rightly sends nothing at all."""
    proxy = start_proxy(ledger, upstreams=upstreams(fake), args=args)
    answers: list[httpx.Response] = []
    broken: list[httpx.TransportError] = []

    def send() -> None:
        try:
            answers.append(
                httpx.post(proxy.url + SEND, json=email(to), headers=headers, timeout=60)
            )
        except httpx.TransportError as exc:
            broken.append(exc)

    client = threading.Thread(target=send)
    try:
        client.start()
        yield UnderWay(proxy, held_in_flight(str(ledger), fake), answers, client, broken)
    finally:
        proxy.stop()


def short_lease(tmp_path: Path) -> tuple[str, ...]:
    """``serve`` arguments for a 2 s lease (a paused worker loses it within a test)."""
    config = tmp_path / "effectguard.toml"
    config.write_text("[server]\nlease_s = 2\nheartbeat_s = 0.5\n")
    return ("--config", str(config))


@contextlib.contextmanager
def paused(proxy: Proxy, seconds: float = 3.0) -> Iterator[None]:
    """``proxy`` stopped (SIGSTOP) for ``seconds``, then for the body, then resumed."""
    proxy.process.send_signal(signal.SIGSTOP)
    try:
        time.sleep(seconds)
        yield
    finally:
        proxy.process.send_signal(signal.SIGCONT)


def kinds(ledger: Path, call_id: str) -> list[str]:
    """The kinds of a call's events, in order."""
    return [e["kind"] for e in cli("show", call_id, "--ledger", str(ledger))["events"]]


def test_a_dead_servers_call_is_shown_gone_and_reconciled_without_a_restart(
    tmp_path: Path,
) -> None:
    """``show`` names the gone owner and offers ``reconcile``; ``reconcile --applied`` takes
    the worker over (the call becomes effect_unknown, held) and decides it; nothing is
    sent again, and ``verify`` accepts the takeover the command wrote."""
    ledger = tmp_path / "ledger.db"
    where = ("--ledger", str(ledger))
    with fake_provider(tmp_path / "receipts.jsonl", idempotent=True) as fake:
        crash(ledger, fake, "after:dispatch", SEND, email("a@x"), {"Idempotency-Key": "a"})
        (call,) = cli("calls", *where)
        call_id = call["call_id"]
        assert call["stage"] == "in_flight"

        shown = cli("show", call_id, *where)
        assert shown["owner_gone"] == "process gone", shown
        assert shown["next_command"].startswith(f"effectguard reconcile {call_id} --ledger")
        text = run("show", call_id, *where).stdout
        assert f"worker {shown['events'][-1]['worker']} is gone (process gone)" in text, text
        assert "wait (it is in flight)" not in text

        decided = run("reconcile", call_id, "--applied", "--note", "receipt seen", *where)
        assert decided.returncode == 0, decided.stderr
        assert f"call {call_id} was in flight on a worker that is gone" in decided.stderr
        # Said once, as the CLI says things: the sweep's own log line is not repeated raw.
        assert decided.stderr.splitlines() == [
            f"effectguard: call {call_id} was in flight on a worker that is gone (process "
            "gone); taken over, it is effect_unknown now"
        ], decided.stderr
        assert "reconciled_applied" in decided.stdout
        events = kinds(ledger, call_id)
        assert events[3:] == [
            "attempt.interrupted",
            "budget.held",
            "call.reconciled",
            "budget.unheld",
        ], events
        assert cli("show", call_id, *where)["owner_gone"] is None
        assert len(fake.effects()) == 1
        assert cli("verify", *where)["ok"] is True


def test_a_dead_servers_call_is_shown_gone_on_a_read_only_ledger(tmp_path: Path) -> None:
    """On a filesystem remounted read-only after ``serve`` died mid-call, ``show`` still
    names the gone owner: its lock file, which nobody holds, can be locked through a
    read-only descriptor. It was opened for appending, which the read-only filesystem
    refused, and the dead worker looked alive ("wait (it is in flight)")."""
    with (
        fake_provider(tmp_path / "receipts.jsonl", idempotent=True) as fake,
        small_tmpfs(tmp_path / "tmpfs", "16m") as disk,
    ):
        ledger = disk / "ledger.db"
        where = ("--ledger", str(ledger))
        crash(ledger, fake, "after:dispatch", SEND, email("ro@x"), {"Idempotency-Key": "ro"})
        remount = ["mount", "-o", "remount,ro", str(disk)]
        if subprocess.run(remount, capture_output=True).returncode != 0:
            pytest.skip("cannot remount the tmpfs read-only here")
        try:
            (call,) = cli("calls", *where)
            shown = cli("show", call["call_id"], *where)
            assert shown["owner_gone"] == "process gone", shown
            text = run("show", call["call_id"], *where).stdout
            assert "next: reconcile (owner gone: process gone)" in text, text
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(disk)], capture_output=True)
        assert len(fake.effects()) == 1


def _row(listing: str, call_id: str) -> str:
    """The line of a ``calls`` table that lists ``call_id``."""
    (line,) = [line for line in listing.splitlines() if call_id in line]
    return line


def test_calls_says_a_killed_servers_call_needs_reconcile_not_wait(tmp_path: Path) -> None:
    """``serve`` killed (-9) while the provider holds its call: ``calls`` said next ``wait``
    for a process that is gone, while ``show`` knew. Now ``calls --json`` names the gone
    owner as ``show --json`` does (``next_operation`` stays the §6 projection's ``wait``),
    and the table and ``show``'s stage line say ``reconcile``."""
    ledger = tmp_path / "ledger.db"
    where = ("--ledger", str(ledger))
    with (
        fake_provider(tmp_path / "receipts.jsonl", idempotent=True) as fake,
        call_under_way(ledger, fake, "k@x", {"x-fake-delay": "3"}) as call,
    ):
        call.proxy.kill()
        assert call.proxy.process.wait(15) == -signal.SIGKILL
        call.client.join(30)
        assert call.broken and not call.answers, call.answers
        (listed,) = cli("calls", *where)
        assert listed["stage"] == "in_flight" and listed["next_operation"] == "wait"
        assert listed["owner_gone"] == "process gone", listed
        assert cli("show", call.call_id, *where)["owner_gone"] == listed["owner_gone"]
        row = _row(run("calls", *where).stdout, call.call_id)
        assert "reconcile (owner gone: process gone)" in row and "wait" not in row, row
        shown = run("show", call.call_id, *where).stdout
        assert "next: reconcile (owner gone: process gone)" in shown, shown
        assert "next: wait" not in shown


def test_auto_reconcile_after_a_crash_asks_about_the_dead_servers_call(tmp_path: Path) -> None:
    """``reconcile --auto`` with nothing restarted: the crashed call is taken over and its
    lookup decides it (the provider took it: applied)."""
    ledger = tmp_path / "ledger.db"
    with fake_provider(tmp_path / "receipts.jsonl", idempotent=True) as fake:
        crash(ledger, fake, "after:dispatch", SEND, email("b@x"), {"Idempotency-Key": "b"})
        (call,) = cli("calls", "--ledger", str(ledger))
        assert call["stage"] == "in_flight"
        results = cli(
            "reconcile", "--auto", "--ledger", str(ledger), "--upstream", f"send_email={fake.url}"
        )
        assert results == [
            {"call_id": call["call_id"], "result": "applied", "note": results[0]["note"]}
        ], results
        shown = cli("show", call["call_id"], "--ledger", str(ledger))
        assert shown["stage"] == "reconciled_applied"
        assert len(fake.effects()) == 1
        assert cli("verify", "--ledger", str(ledger))["ok"] is True


def test_a_lapsed_lease_is_gone_where_the_lock_cannot_be_seen(
    tmp_path: Path,
    ledger_url: str,  # noqa: F811
) -> None:
    """An owner whose lock this host cannot see (another host's, another OS user's: here
    its lock file is removed) is gone once its lease runs out by the ledger's clock, not
    before."""
    config = tmp_path / "effectguard.toml"
    config.write_text("[server]\nlease_s = 2\nheartbeat_s = 0.5\n")
    args = ("--config", str(config))
    where = ("--ledger", ledger_url)
    with fake_provider(tmp_path / "receipts.jsonl", idempotent=True) as fake:
        proxy = start_proxy(
            ledger_url,
            upstreams=upstreams(fake),
            args=args,
            env={"EFFECTGUARD_CRASH_AT": "after:dispatch"},
            log_path=tmp_path / "proxy.log",
        )
        try:
            with pytest.raises(httpx.TransportError):
                httpx.post(proxy.url + SEND, json=email("c@x"), timeout=30)
            assert proxy.process.wait(15) == -signal.SIGKILL
        finally:
            proxy.kill()
        (call,) = cli("calls", *where)
        owners = {e["worker"] for e in cli("show", call["call_id"], *where)["events"]}
        locks = lock_dir_for(ledger_url)
        assert locks is not None
        for owner in owners:  # only the killed one's: on PostgreSQL others share the folder
            (locks / f"{owner}.lock").unlink()
        shown = cli("show", call["call_id"], *where)
        if shown["owner_gone"] is None:  # the lease may still run: then it must run out
            assert shown["next_command"].startswith("wait (it is in flight)")
            time.sleep(2.5)
            shown = cli("show", call["call_id"], *where)
        assert shown["owner_gone"] == "lease expired", shown
        # Taken over, not decided: an owner only known by its lease may still answer.
        first = run("reconcile", call["call_id"], "--not-applied", "--note", "n", *where)
        assert first.returncode == 3, first.stdout + first.stderr
        assert "(lease expired)" in first.stderr
        assert cli("show", call["call_id"], *where)["stage"] == "effect_unknown"
        decided = run("reconcile", call["call_id"], "--not-applied", "--note", "n", *where)
        assert decided.returncode == 0, decided.stderr
        assert cli("show", call["call_id"], *where)["stage"] == "reconciled_not_applied"
        assert cli("verify", *where)["ok"] is True


def test_a_live_owners_call_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    """While ``serve`` is working on the call, ``show`` says wait, ``reconcile`` refuses
    (exit 3) and the command writes no worker of its own."""
    ledger = tmp_path / "ledger.db"
    where = ("--ledger", str(ledger))
    with (
        fake_provider(tmp_path / "receipts.jsonl", idempotent=True) as fake,
        call_under_way(ledger, fake, "d@x", {"x-fake-delay": "8"}) as call,
    ):
        before = cli("show", call.call_id, *where)
        assert before["owner_gone"] is None
        (listed,) = cli("calls", *where)
        assert listed["owner_gone"] is None and listed["next_operation"] == "wait"
        assert "wait" in _row(run("calls", *where).stdout, call.call_id)
        assert before["next_command"].startswith("wait (it is in flight)")
        refused = run("reconcile", call.call_id, "--not-applied", "--note", "n", *where)
        assert refused.returncode == 3, refused.stdout + refused.stderr
        assert "taken over" not in refused.stderr
        after = cli("show", call.call_id, *where)
        # Only the owner writes: on a loaded machine its answer may land meanwhile.
        assert after["events"][: len(before["events"])] == before["events"]
        owner = {e["worker"] for e in before["events"]}
        assert {e["worker"] for e in after["events"]} == owner, after["events"]
        assert not {e["kind"] for e in after["events"]} & {"attempt.interrupted", "call.reconciled"}
        call.client.join(30)
        assert call.answers and call.answers[0].status_code == 200, call.answers
        assert cli("show", call.call_id, *where)["stage"] == "completed"
        assert len(fake.effects()) == 1


def test_a_paused_servers_call_is_taken_over_but_not_decided_before_its_late_answer(
    tmp_path: Path,
) -> None:
    """A ``serve`` paused (SIGSTOP) past its lease is taken over by ``reconcile``, but the
    call is not decided in the same command (exit 3): once the server resumes, the
    provider's answer it receives is kept as evidence and decides the call applied. Before,
    ``--not-applied`` was recorded at once, the late 200 arrived after it, and ``show``
    offered a keyed resend: a second effect."""
    ledger = tmp_path / "ledger.db"
    where = ("--ledger", str(ledger))
    headers = {"x-fake-delay": "2", "Idempotency-Key": "p"}
    with (
        fake_provider(tmp_path / "receipts.jsonl", idempotent=True) as fake,
        call_under_way(ledger, fake, "p@x", headers, short_lease(tmp_path)) as call,
    ):
        call_id = call.call_id
        with paused(call.proxy):  # past the 2 s lease; the provider answers meanwhile
            assert cli("show", call_id, *where)["owner_gone"] == "lease expired"
            refused = run("reconcile", call_id, "--not-applied", "--note", "n", *where)
            assert refused.returncode == 3, refused.stdout + refused.stderr
            assert "nothing was decided" in refused.stderr, refused.stderr
            assert cli("show", call_id, *where)["stage"] == "effect_unknown"
        call.client.join(30)
        assert call.answers and call.answers[0].status_code == 502, call.answers
        shown = cli("show", call_id, *where)
        assert shown["evidence"], shown
        assert shown["next_command"].startswith(f"effectguard reconcile {call_id}")
        assert "--accept-evidence" in shown["next_command"].split(" | ")[0]
        accepted = run("reconcile", call_id, "--accept-evidence", *where)
        assert accepted.returncode == 0, accepted.stderr
        assert cli("show", call_id, *where)["stage"] == "reconciled_applied"
        assert len(fake.effects()) == 1
        assert cli("verify", *where)["ok"] is True


# Loaded by the ``reconcile`` process below (as ``sitecustomize``): its look at the owners
# sees the named call's owner live (its lease ran out just after) and another call's
# owner gone, so it sweeps, and the sweep marks the named call too.
_OWNER_LAPSES_BETWEEN_LOOK_AND_SWEEP = """
import os
import effectguard.callpath.takeover as takeover

_look = takeover.gone_owners_here


async def gone_owners_here(ledger, lock_dir, calls):
    gone = await _look(ledger, lock_dir, calls)
    gone.pop(os.environ["RACED_CALL"], None)
    return {**gone, "call_of_another_dead_worker": "process gone"}


takeover.gone_owners_here = gone_owners_here
"""


def test_a_call_whose_lease_lapses_between_the_look_and_the_sweep_is_not_decided_at_once(
    tmp_path: Path,
) -> None:
    """``reconcile`` looks at the owners, then sweeps. A call its sweep marks though its
    owner looked live a moment before (a paused worker whose lease ran out in between) was
    labelled "its worker is gone" and decided at once, though that worker may still
    receive the provider's answer. It is treated as its lease's lapse now: not decided."""
    ledger = tmp_path / "ledger.db"
    where = ("--ledger", str(ledger))
    (tmp_path / "sitecustomize.py").write_text(_OWNER_LAPSES_BETWEEN_LOOK_AND_SWEEP)
    headers = {"x-fake-delay": "2", "Idempotency-Key": "r"}
    with (
        fake_provider(tmp_path / "receipts.jsonl", idempotent=True) as fake,
        call_under_way(ledger, fake, "r@x", headers, short_lease(tmp_path)) as call,
        paused(call.proxy),
    ):
        env = {"PYTHONPATH": str(tmp_path), "RACED_CALL": call.call_id}
        command = ["reconcile", call.call_id, "--not-applied", "--note", "n", *where]
        refused = subprocess.run(
            [sys.executable, "-m", "effectguard", *command],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, **env},
        )
        assert refused.returncode == 3, refused.stdout + refused.stderr
        assert "nothing was decided" in refused.stderr, refused.stderr
        assert cli("show", call.call_id, *where)["stage"] == "effect_unknown"
