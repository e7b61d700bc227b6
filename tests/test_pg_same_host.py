"""On PostgreSQL too, a replica whose process is gone is taken over at once on its host.

Contract §7: a restart on the same host must not wait for the lease to run out when the
old process is provably gone. On SQLite a worker's OS file lock beside the ledger proves
it; on PostgreSQL there was no such lock, so after a replica was SIGKILLed mid-call its
call stayed ``in_flight`` for the whole lease (``calls`` said ``wait``, ``reconcile``
refused it as in flight), the restarted replica included. Now every PostgreSQL worker
holds a lock in a per-user runtime directory of its host, and a process on that host
(a restarted ``serve``, ``reconcile``, ``show``) finds it free once the process is gone.
A replica that is only stopped (SIGSTOP) still holds its lock: nothing takes it over
before its lease runs out. The lease is long (60 s) so that a lease expiry cannot pass
for the proof within a test's bounded waits. Effects are counted from the fake
provider's receipts.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from pgkit import NEEDS_PG, pg_url
from test_reconcile_auto import SEND, email, upstreams
from toolkit import cli_json as cli
from toolkit import cli_run as run
from toolkit import held_in_flight

from effectguard.testing import FakeProvider, Proxy, fake_provider, start_proxy

pytestmark = [*NEEDS_PG, pytest.mark.slow]
_ = (pg_url,)  # fixtures

#: How long a test waits for a takeover: far less than the lease.
WAIT_S = 20.0


def long_lease(tmp_path: Path) -> tuple[str, ...]:
    """``serve`` arguments for a 60 s lease (longer than any wait below)."""
    config = tmp_path / "effectguard.toml"
    config.write_text("[server]\nlease_s = 60\nheartbeat_s = 1\n")
    return ("--config", str(config))


@dataclass
class UnderWay:
    """A call a replica has sent and the provider holds, its client waiting in a thread."""

    proxy: Proxy
    call_id: str
    answers: list[httpx.Response]
    client: threading.Thread


def replica(url: str, fake: FakeProvider, tmp_path: Path, name: str) -> Proxy:
    """A ``serve`` on the PostgreSQL ledger ``url`` (log in ``tmp_path``)."""
    return start_proxy(
        url,
        upstreams=upstreams(fake),
        args=long_lease(tmp_path),
        log_path=tmp_path / f"{name}.log",
    )


@contextlib.contextmanager
def call_under_way(url: str, fake: FakeProvider, tmp_path: Path, delay: str) -> Iterator[UnderWay]:
    """A replica (stopped on exit) and one email sent through it from a thread, yielded
    once the provider holds the request for ``delay`` seconds."""
    proxy = replica(url, fake, tmp_path, "first")
    answers: list[httpx.Response] = []

    def send() -> None:
        with contextlib.suppress(httpx.TransportError):  # the replica killed under it
            answers.append(
                httpx.post(
                    proxy.url + SEND,
                    json=email("a@x"),
                    headers={"x-fake-delay": delay, "Idempotency-Key": "k"},
                    timeout=60,
                )
            )

    client = threading.Thread(target=send)
    try:
        client.start()
        yield UnderWay(proxy, held_in_flight(url, fake), answers, client)
    finally:
        with contextlib.suppress(ProcessLookupError):
            proxy.process.send_signal(signal.SIGCONT)
        proxy.stop()
        client.join(60)


def killed(call: UnderWay) -> None:
    """SIGKILL the replica that owns ``call`` and wait until it is gone."""
    call.proxy.kill()
    assert call.proxy.process.wait(15) == -signal.SIGKILL


def stage_within(url: str, call_id: str, wanted: str, seconds: float) -> str:
    """The call's stage once it is ``wanted``, or the last one seen after ``seconds``."""
    deadline = time.monotonic() + seconds
    stage = cli("show", call_id, "--ledger", url)["stage"]
    while stage != wanted and time.monotonic() < deadline:
        time.sleep(0.2)
        stage = cli("show", call_id, "--ledger", url)["stage"]
    return str(stage)


def test_a_replica_restarted_after_a_kill_takes_over_its_call_at_once(
    tmp_path: Path, pg_url: str
) -> None:
    """The restarted replica's start-up sweep marks the killed one's call effect_unknown
    long before the lease runs out, and ``reconcile`` then decides it at once."""
    where = ("--ledger", pg_url)
    with fake_provider(tmp_path / "receipts.jsonl", idempotent=True) as fake:
        with call_under_way(pg_url, fake, tmp_path, "5") as call:
            killed(call)
            restarted = replica(pg_url, fake, tmp_path, "restarted")
            try:
                stage = stage_within(pg_url, call.call_id, "effect_unknown", WAIT_S)
                assert stage == "effect_unknown", (
                    f"the killed replica's call is still {stage} {WAIT_S} s after the "
                    "restart: the restart waits out its lease"
                )
                decided = run("reconcile", call.call_id, "--applied", "--note", "n", *where)
                assert decided.returncode == 0, decided.stdout + decided.stderr
            finally:
                restarted.stop()
        assert cli("show", call.call_id, *where)["stage"] == "reconciled_applied"
        assert len(fake.effects()) == 1
        assert cli("verify", *where)["ok"] is True


def test_reconcile_takes_over_a_killed_replica_at_once_without_a_restart(
    tmp_path: Path, pg_url: str
) -> None:
    """With nothing restarted, ``calls`` and ``show`` say the owner's process is gone (the
    table's next step is reconcile, not wait), and ``reconcile`` takes it over and decides
    in one command."""
    where = ("--ledger", pg_url)
    with fake_provider(tmp_path / "receipts.jsonl", idempotent=True) as fake:
        with call_under_way(pg_url, fake, tmp_path, "5") as call:
            killed(call)
            shown = cli("show", call.call_id, *where)
            assert shown["owner_gone"] == "process gone", shown
            (listed,) = cli("calls", *where)
            assert listed["owner_gone"] == "process gone", listed
            table = run("calls", *where).stdout
            assert "reconcile (owner gone: process gone)" in table, table
            decided = run("reconcile", call.call_id, "--applied", "--note", "n", *where)
            assert decided.returncode == 0, decided.stdout + decided.stderr
            assert "process gone" in decided.stderr
        assert cli("show", call.call_id, *where)["stage"] == "reconciled_applied"
        assert len(fake.effects()) == 1
        assert cli("verify", *where)["ok"] is True


def test_a_stopped_replica_is_not_taken_over_before_its_lease_runs_out(
    tmp_path: Path, pg_url: str
) -> None:
    """A replica stopped (SIGSTOP) keeps its lock: ``show`` says wait, ``reconcile`` refuses,
    a second replica's start-up sweep leaves the call in flight, and once resumed the
    stopped replica finishes the call itself."""
    where = ("--ledger", pg_url)
    with fake_provider(tmp_path / "receipts.jsonl", idempotent=True) as fake:
        with call_under_way(pg_url, fake, tmp_path, "2") as call:
            call.proxy.process.send_signal(signal.SIGSTOP)
            try:
                assert cli("show", call.call_id, *where)["owner_gone"] is None
                refused = run("reconcile", call.call_id, "--applied", "--note", "n", *where)
                assert refused.returncode == 3, refused.stdout + refused.stderr
                assert "taken over" not in refused.stderr
                other = replica(pg_url, fake, tmp_path, "other")
                try:
                    assert cli("show", call.call_id, *where)["stage"] == "in_flight"
                finally:
                    other.stop()
            finally:
                call.proxy.process.send_signal(signal.SIGCONT)
            call.client.join(30)
            assert call.answers and call.answers[0].status_code == 200, call.answers
        assert cli("show", call.call_id, *where)["stage"] == "completed"
        assert len(fake.effects()) == 1
