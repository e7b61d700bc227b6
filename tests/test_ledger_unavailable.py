"""When the ledger cannot commit (docs/contract.md §3.2, §3.3, §9).

* Admission that cannot commit — the database locked past the busy timeout,
  the disk full, the files read-only — is refused with 503
  (``x-should-retry: true``) and nothing reaches the provider.
* An observation that cannot commit never shows the call as completed: the
  client gets an error, and after a restart the call is ``effect_unknown``.

Effects are counted only from the fake provider's receipt log.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from mountkit import small_tmpfs
from observing import cli_json, wait_for

from effectguard.ops.cli import main as cli_main
from effectguard.testing import FakeProvider, Proxy, fake_provider, start_proxy

pytestmark = pytest.mark.slow

CHAT = "/openai/v1/chat/completions"
MODEL = "gpt-4o-mini"


def chat(content: str) -> dict[str, Any]:
    """A small chat completion request."""
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8}


def assert_refused_unsent(response: httpx.Response, fake: FakeProvider, receipts: int) -> None:
    """A 503 that tells the SDK to retry, and the provider received nothing new."""
    assert response.status_code == 503, response.text
    assert response.headers["x-should-retry"] == "true"
    assert response.json()["error"]["type"] == "ledger_unavailable"
    assert len(fake.receipts()) == receipts


def assert_settled(ledger: Path) -> None:
    """Nothing in flight, and ``effectguard verify`` passes."""
    assert cli_json("calls", "--ledger", str(ledger), "--state", "in_flight") == []
    assert cli_json("verify", "--ledger", str(ledger))["ok"] is True


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeProvider]:
    """The fake provider, its receipt log outside any filesystem the test breaks."""
    with fake_provider(tmp_path / "receipts.jsonl") as provider:
        yield provider


@contextlib.contextmanager
def proxy_on(ledger: Path, fake: FakeProvider) -> Iterator[Proxy]:
    """A proxy on ``ledger``, stopped (or killed) at the end."""
    proxy = start_proxy(
        ledger,
        upstreams={"openai": fake.url},
        log_path=ledger.parent.parent / f"proxy-{time.monotonic_ns()}.log",
    )
    try:
        yield proxy
    finally:
        proxy.stop()


def test_locked_ledger_refuses_with_503_and_sends_nothing(
    tmp_path: Path, fake: FakeProvider
) -> None:
    """A write lock held past the busy timeout: 503, retryable, nothing sent; then it recovers."""
    ledger = tmp_path / "db" / "ledger.db"
    ledger.parent.mkdir()
    with proxy_on(ledger, fake) as proxy:
        assert httpx.post(proxy.url + CHAT, json=chat("warm"), timeout=30).status_code == 200
        blocker = sqlite3.connect(ledger, timeout=0, isolation_level=None)
        try:
            blocker.execute("BEGIN EXCLUSIVE")
            started = time.monotonic()
            refused = httpx.post(
                proxy.url + CHAT,
                json=chat("locked"),
                timeout=30,
                headers={"Idempotency-Key": "locked"},
            )
            assert time.monotonic() - started >= 4.0  # it waited for the busy timeout
            assert_refused_unsent(refused, fake, 1)
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        # Nothing was recorded, so the same key is simply admitted now.
        again = httpx.post(
            proxy.url + CHAT, json=chat("locked"), timeout=30, headers={"Idempotency-Key": "locked"}
        )
        assert again.status_code == 200, again.text
        assert len(fake.effects()) == 2
    assert [c["stage"] for c in cli_json("calls", "--ledger", str(ledger))] == ["completed"] * 2
    assert_settled(ledger)


def fill(path: Path) -> None:
    """Write ``path`` until the filesystem is full."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for size in (1 << 20, 1 << 12, 1):
            block = b"\0" * size
            while True:
                try:
                    os.write(fd, block)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)


def test_disk_full_refuses_admission_and_never_completes_an_unrecorded_call(
    tmp_path: Path, fake: FakeProvider
) -> None:
    """Disk full: admission is refused 503 and sends nothing; an observation that
    cannot commit leaves the call uncompleted, effect_unknown after a restart."""
    with small_tmpfs(tmp_path / "tmpfs", "8m") as disk:
        ledger = disk / "db" / "ledger.db"
        ledger.parent.mkdir()
        filler = disk / "filler"
        proxy = start_proxy(ledger, upstreams={"openai": fake.url}, log_path=tmp_path / "a.log")
        try:
            assert httpx.post(proxy.url + CHAT, json=chat("warm"), timeout=30).status_code == 200

            # The observation fails: the disk fills while the provider works on the call.
            with ThreadPoolExecutor(1) as pool:
                pending = pool.submit(
                    httpx.post,
                    proxy.url + CHAT,
                    json=chat("observe"),
                    timeout=30,
                    headers={"Idempotency-Key": "observe", "x-fake-delay": "1"},
                )
                wait_for(lambda: len(fake.receipts()) == 2, 10, "the provider to receive the call")
                fill(filler)
                answer = pending.result(timeout=30)
            assert answer.status_code == 502, answer.text
            assert answer.json()["error"]["type"] == "observe_failed"
            call_id = answer.headers["effectguard-call-id"]
            # Its access line names no stage (the ledger could not record one), not "refused".
            (access,) = wait_for(
                lambda: [
                    line.split()
                    for line in (tmp_path / "a.log").read_text().splitlines()
                    if "event=access" in line and f"call_id={call_id}" in line
                ],
                10,
                "the access line of the unrecorded call",
            )
            assert "outcome=observe_failed" in access, access
            assert not [word for word in access if word.startswith("stage=")], access

            # Admission fails while the disk is full.
            refused = httpx.post(
                proxy.url + CHAT,
                json=chat("admit"),
                timeout=30,
                headers={"Idempotency-Key": "admit"},
            )
            assert_refused_unsent(refused, fake, 2)
        finally:
            proxy.kill(signal.SIGKILL)  # a crash, not a drain: the restart must recover
            proxy.process.wait()
            filler.unlink(missing_ok=True)

        with proxy_on(ledger, fake) as fresh:
            resend = httpx.post(
                fresh.url + CHAT,
                json=chat("observe"),
                timeout=30,
                headers={"Idempotency-Key": "observe"},
            )
            assert resend.status_code == 409, resend.text
            assert resend.json()["error"]["type"] == "effect_unknown"
            assert resend.json()["error"]["call_id"] == call_id
            # The refused admission recorded nothing: its key is new work now.
            admitted = httpx.post(
                fresh.url + CHAT,
                json=chat("admit"),
                timeout=30,
                headers={"Idempotency-Key": "admit"},
            )
            assert admitted.status_code == 200, admitted.text
        assert len(fake.effects()) == 3
        shown = cli_json("show", call_id, "--ledger", str(ledger))
        kinds = [e["kind"] for e in shown["events"]]
        assert shown["stage"] == "effect_unknown"
        assert "call.completed" not in kinds and "attempt.observed" not in kinds
        assert shown["held_usd"] == shown["reserved_usd"]
        assert_settled(ledger)
        shutil.copy(ledger, tmp_path / "kept.db")  # the tmpfs goes away with the test


def _chattr(flag: str, *paths: Path) -> subprocess.CompletedProcess[str]:
    existing = [str(p) for p in paths if p.exists()]
    return subprocess.run(["chattr", flag, *existing], capture_output=True, text=True)


def test_read_only_ledger_refuses_with_503_and_sends_nothing(
    tmp_path: Path, fake: FakeProvider
) -> None:
    """Ledger files made immutable under a running proxy (root ignores chmod): 503,
    retryable, nothing sent, ``/healthz`` says unavailable; writable again, it recovers.

    The ``-shm`` index stays writable: SQLite maps it into memory, and a write to a
    mapped immutable file is a SIGBUS, which no program can turn into a 503.
    """
    if shutil.which("chattr") is None:
        pytest.skip("chattr is not available")
    ledger = tmp_path / "db" / "ledger.db"
    ledger.parent.mkdir()
    files = [ledger, Path(f"{ledger}-wal")]
    with proxy_on(ledger, fake) as proxy:
        assert httpx.post(proxy.url + CHAT, json=chat("warm"), timeout=30).status_code == 200
        done = _chattr("+i", *files)
        if done.returncode != 0:
            pytest.skip(f"chattr +i failed: {done.stderr.strip()}")
        try:
            refused = httpx.post(
                proxy.url + CHAT,
                json=chat("read-only"),
                timeout=30,
                headers={"Idempotency-Key": "ro"},
            )
            assert_refused_unsent(refused, fake, 1)
            assert httpx.get(proxy.url + "/healthz", timeout=30).status_code == 503
        finally:
            _chattr("-i", *files)
        again = httpx.post(
            proxy.url + CHAT, json=chat("read-only"), timeout=30, headers={"Idempotency-Key": "ro"}
        )
        assert again.status_code == 200, again.text
        assert httpx.get(proxy.url + "/healthz", timeout=30).status_code == 200
    assert len(fake.effects()) == 2
    assert_settled(ledger)


def test_a_change_to_a_read_only_ledger_is_exit_4_not_a_traceback(
    tmp_path: Path, fake: FakeProvider, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a filesystem remounted read-only, with the ``-wal`` and ``-shm`` files a crashed
    replica left, SQLite opens the ledger read-only without a word and refuses the first
    write statement: ``budget set`` and ``key new`` exit 4, "ledger unavailable", as a full
    disk does; reading still works; once writable, the same change is made."""
    with small_tmpfs(tmp_path / "tmpfs", "8m") as disk:
        ledger = disk / "db" / "ledger.db"
        ledger.parent.mkdir()
        proxy = start_proxy(ledger, upstreams={"openai": fake.url}, log_path=tmp_path / "a.log")
        assert httpx.post(proxy.url + CHAT, json=chat("warm"), timeout=30).status_code == 200
        proxy.kill(signal.SIGKILL)  # a crash leaves the -wal and -shm files behind
        proxy.process.wait()
        assert Path(f"{ledger}-wal").exists()
        remount = ["mount", "-o", "remount,ro", str(disk)]
        if subprocess.run(remount, capture_output=True).returncode != 0:
            pytest.skip("cannot remount the tmpfs read-only here")
        try:
            for change in (
                ["budget", "set", "team-a", "--limit", "1"],
                ["key", "new", "--root", "team-a"],
            ):
                capsys.readouterr()
                assert cli_main([*change, "--ledger", str(ledger)]) == 4, change
                err = capsys.readouterr().err
                assert "ledger unavailable" in err and "read" in err, err
            assert cli_json("budgets", "--ledger", str(ledger)) is not None
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(disk)], capture_output=True)
        set_again = cli_json("budget", "set", "team-a", "--limit", "1", "--ledger", str(ledger))
        assert set_again is not None
    assert len(fake.effects()) == 1


def test_a_reconcile_that_takes_over_a_gone_worker_on_a_read_only_ledger_is_exit_4(
    tmp_path: Path, fake: FakeProvider, capsys: pytest.CaptureFixture[str]
) -> None:
    """``reconcile`` sweeps first when a call is in flight on a worker that is gone
    (contract §7), registering as a worker whose lock file lives beside the ledger. On a
    filesystem remounted read-only that lock cannot be made: a decision and an authorized
    resend of a call whose owner's lease lapsed exit 4, "ledger unavailable", never a
    traceback (found by ``effectguard sim --maintenance --ledger-faults``, seed 7); once
    writable, the call is taken over and decided as ever."""
    with small_tmpfs(tmp_path / "tmpfs", "8m") as disk:
        ledger = disk / "db" / "ledger.db"
        ledger.parent.mkdir()
        config = tmp_path / "lease.toml"  # a short lease: its owner is soon gone by it
        config.write_text("[server]\nlease_s = 1\nheartbeat_s = 0.25\nsweep_s = 0.5\n")
        proxy = start_proxy(
            ledger,
            upstreams={"openai": fake.url},
            args=["--config", str(config)],
            log_path=tmp_path / "a.log",
        )
        held = {"x-fake-behaviour": "delay=5"}  # the provider has it; the answer comes late
        with ThreadPoolExecutor(1) as pool:
            sent = pool.submit(
                httpx.post, proxy.url + CHAT, json=chat("held"), headers=held, timeout=30
            )
            (call,) = wait_for(
                lambda: cli_json("calls", "--ledger", str(ledger), "--state", "in_flight"),
                20,
                "the call in flight",
            )
            wait_for(lambda: fake.receipts(), 20, "the provider's receipt")
            proxy.kill(signal.SIGSTOP)  # its lease lapses while it holds the ledger open
            show = ["show", call["call_id"], "--ledger", str(ledger)]
            wait_for(lambda: cli_json(*show)["owner_gone"], 20, "its owner's lease to lapse")
            proxy.kill(signal.SIGKILL)  # it leaves the -wal and -shm files, as in the sim
            proxy.process.wait()
            with pytest.raises(httpx.HTTPError):
                sent.result()
        assert Path(f"{ledger}-wal").exists()
        remount = ["mount", "-o", "remount,ro", str(disk)]
        if subprocess.run(remount, capture_output=True).returncode != 0:
            pytest.skip("cannot remount the tmpfs read-only here")
        decide = ["reconcile", call["call_id"], "--not-applied", "--note", "n", "--by", "op"]
        try:
            for argv in (decide, ["reconcile", call["call_id"], "--resend", "--note", "n"]):
                capsys.readouterr()
                assert cli_main([*argv, "--ledger", str(ledger)]) == 4, argv
                err = capsys.readouterr().err
                assert "ledger unavailable" in err and "Traceback" not in err, err
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(disk)], capture_output=True)
        # Writable, its lock shows the process gone: taken over and decided (contract §7).
        capsys.readouterr()
        assert cli_main([*decide, "--ledger", str(ledger)]) == 0
        assert "taken over" in capsys.readouterr().err
        (after,) = cli_json("calls", "--ledger", str(ledger))
        assert after["stage"] == "reconciled_not_applied"
    assert len(fake.receipts()) == 1


@contextlib.contextmanager
def unanswered_connects() -> Iterator[str]:
    """A loopback URL whose connects hang until they time out: its one-slot accept
    queue is already full, so the kernel drops every new SYN. Nothing is ever sent."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=0)
    filler = socket.create_connection(listener.getsockname())
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        filler.close()
        listener.close()


def test_a_not_sent_attempt_the_full_disk_kept_from_recording_is_recorded_once_it_can_be(
    tmp_path: Path,
) -> None:
    """The upstream cannot be reached, and the disk fills while the connect waits: the
    attempt's ``attempt.not_sent`` cannot commit. Once the disk has room, a sweep records
    it, so the call does not stay in flight until a restart (and its key is free again)."""
    config = tmp_path / "effectguard.toml"
    config.write_text(
        "[server]\nsweep_s = 0.5\n[guard]\nmax_retries = 0\n[upstream]\nconnect_timeout_s = 2\n"
    )
    with small_tmpfs(tmp_path / "tmpfs", "8m") as disk, unanswered_connects() as upstream:
        ledger = disk / "db" / "ledger.db"
        ledger.parent.mkdir()
        filler = disk / "filler"
        proxy = start_proxy(
            ledger,
            upstreams={"openai": upstream},
            args=["--config", str(config)],
            log_path=tmp_path / "proxy.log",
        )
        try:
            with ThreadPoolExecutor(1) as pool:
                pending = pool.submit(
                    httpx.post,
                    proxy.url + CHAT,
                    json=chat("unreachable"),
                    timeout=30,
                    headers={"Idempotency-Key": "unreachable"},
                )
                in_flight = "in_flight"
                wait_for(
                    lambda: cli_json("calls", "--ledger", str(ledger), "--state", in_flight),
                    10,
                    "the call to be admitted",
                )
                fill(filler)
                answer = pending.result(timeout=30)
            assert answer.status_code == 503, answer.text
            call_id = answer.headers["effectguard-call-id"]
            filler.unlink()

            def stage() -> str:
                return str(cli_json("show", call_id, "--ledger", str(ledger))["stage"])

            wait_for(lambda: stage() == "not_sent", 15, "a sweep to record the unsent attempt")
            again = httpx.post(
                proxy.url + CHAT,
                json=chat("unreachable"),
                timeout=30,
                headers={"Idempotency-Key": "unreachable"},
            )
            assert again.status_code == 502, again.text
            assert again.json()["error"]["type"] == "upstream_unreachable"
            assert again.headers["effectguard-call-id"] == call_id
        finally:
            proxy.stop()
            filler.unlink(missing_ok=True)
        assert_settled(ledger)
        shutil.copy(ledger, tmp_path / "kept.db")  # the tmpfs goes away with the test
