"""A worker frozen between recording an attempt and sending it (docs/contract.md §7).

A pause (SIGSTOP, a suspended VM, a long GC) can land after ``attempt.started`` is
durable and before the request leaves. Past the worker's lease another replica takes
the call over (effect unknown), and a keyed resend's lookup proves it not applied and
sends it. The frozen worker, continued, must not send its attempt as well: the provider
would apply the operation twice. Counted with the fake provider's receipts.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from observing import wait_for
from toolkit import AUTH, KEY, SEND, charge, declare
from toolkit import cli_json as cli

from effectguard.testing import FakeProvider, Proxy, fake_provider, start_proxy

pytestmark = pytest.mark.slow

#: A short lease, so another replica takes a frozen one over within seconds.
CONFIG = "[server]\nlease_s = 2\nheartbeat_s = 0.5\nsweep_s = 0.5\n"
ROUTE = "/payments" + SEND


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeProvider]:
    """The provider, its search a little behind its effects and asking for the key."""
    extra = ["--search-lag", "0.2", "--lookup-key", KEY]
    with fake_provider(tmp_path / "receipts.jsonl", extra_args=extra) as provider:
        yield provider


@contextlib.contextmanager
def replica(tmp_path: Path, name: str, fake: FakeProvider, **env: str) -> Iterator[Proxy]:
    """One ``serve`` of the ``payments`` tool (lookup freshness 1 s) on the shared ledger."""
    config = tmp_path / "effectguard.toml"
    config.write_text(CONFIG)
    proxy = start_proxy(
        tmp_path / "ledger.db",
        upstreams={"payments": fake.url},
        args=["--config", str(config), "--providers", str(declare(tmp_path, freshness=1))],
        env={"PAYMENTS_API_KEY": KEY, **env},
        log_path=tmp_path / f"{name}.log",
    )
    try:
        yield proxy
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proxy.process.pid, signal.SIGCONT)
        proxy.stop()


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (state ``T`` in /proc)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rpartition(")")[2].split()[0] == "T"


def test_a_worker_frozen_before_sending_does_not_send_once_it_was_taken_over(
    tmp_path: Path, fake: FakeProvider
) -> None:
    """Replica A records the attempt and freezes; replica B takes it over, its lookup
    proves the call not applied and B sends it. Continued, A sends nothing: the
    operation is applied once, and A's client is told nothing was sent."""
    ledger = str(tmp_path / "ledger.db")
    headers = {**AUTH, "Idempotency-Key": "pay-1"}
    freeze = {"EFFECTGUARD_CRASH_AT": "after:admit", "EFFECTGUARD_CRASH_SIGNAL": "SIGSTOP"}
    with (
        replica(tmp_path, "a", fake, **freeze) as a,
        replica(tmp_path, "b", fake) as b,
        ThreadPoolExecutor(1) as pool,
    ):
        pending = pool.submit(
            httpx.post, a.url + ROUTE, json=charge(1), headers=headers, timeout=60
        )
        wait_for(lambda: stopped(a.process.pid), 10, "replica A to freeze after admission")
        (call,) = cli("calls", "--ledger", ledger)
        call_id = call["call_id"]
        # B's sweeper marks it effect_unknown, and may decide it at once by its lookup.
        taken = {"effect_unknown", "reconciled_not_applied"}
        wait_for(
            lambda: cli("show", call_id, "--ledger", ledger)["stage"] in taken,
            20,
            "replica B to take the frozen replica's call over",
        )
        resent = httpx.post(b.url + ROUTE, json=charge(1), headers=headers, timeout=30)
        assert resent.status_code == 200, resent.text
        assert [r["op"] for r in fake.effects()] == [call_id]

        os.kill(a.process.pid, signal.SIGCONT)
        answer = pending.result(timeout=30)
    assert [r["op"] for r in fake.effects()] == [call_id], answer.text
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["type"] == "ledger_unavailable"
    assert cli("show", call_id, "--ledger", ledger)["stage"] == "completed"
    assert cli("verify", "--ledger", ledger)["ok"] is True
