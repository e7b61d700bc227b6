"""Lookups through the proxy, with real crashes (``EFFECTGUARD_CRASH_AT``) and the fake
provider's lagging, key-checked search. Charges are counted from its receipts.

* A keyed resend of an unknown call is refused while the search lags or the call is
  younger than the declared freshness, and decided by lookup afterwards.
* The sweeper decides unknown calls old enough, with no request at all, from its first
  sweep at startup on.
* ``reconcile --auto`` asks the declared lookup with the provider's key from the
  environment; without the key the provider refuses and the call stays unknown.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from toolkit import KEY, SEND, charge, charges, declare

from effectguard.testing import FakeProvider, fake_provider, start_proxy

pytestmark = pytest.mark.slow

ROUTE = "/payments" + SEND
ENV = {"PAYMENTS_API_KEY": KEY}


def cli(*args: str, env: dict[str, str] | None = None) -> Any:
    """Run the real ``effectguard`` command with ``--json``; assert exit 0; parse stdout."""
    done = subprocess.run(
        [sys.executable, "-m", "effectguard", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def proxy_args(tmp_path: Path, freshness: float, sweep_s: float) -> tuple[str, ...]:
    """Flags for a proxy that knows ``payments`` and sweeps every ``sweep_s`` seconds."""
    config = tmp_path / f"sweep-{sweep_s}.toml"
    config.write_text(f"[server]\nsweep_s = {sweep_s}\n")
    return ("--providers", str(declare(tmp_path, freshness)), "--config", str(config))


def crash(ledger: Path, fake: FakeProvider, point: str, key: str, args: tuple[str, ...]) -> None:
    """One payment through a proxy that kills itself at ``point``."""
    proxy = start_proxy(
        ledger,
        upstreams={"payments": fake.url},
        args=args,
        env={**ENV, "EFFECTGUARD_CRASH_AT": point},
    )
    try:
        with pytest.raises(httpx.TransportError):
            httpx.post(
                proxy.url + ROUTE, json=charge(1), headers={"Idempotency-Key": key}, timeout=30
            )
        assert proxy.process.wait(15) == -signal.SIGKILL
    finally:
        proxy.kill()


def decisions(ledger: Path, call_id: str) -> list[dict[str, Any]]:
    """The call's ``call.reconciled`` events' data, from ``effectguard show``."""
    shown = cli("show", call_id, "--ledger", str(ledger))
    return [e["data"] for e in shown["events"] if e["kind"] == "call.reconciled"]


def test_keyed_resends_are_refused_while_fresh_then_decided_by_lookup(tmp_path: Path) -> None:
    """Applied (reached the provider): 409, then its object recovered, no new charge.
    Lost (crashed before dispatch): 409, then resent exactly once."""
    ledger = tmp_path / "ledger.db"
    args = proxy_args(tmp_path, freshness=15, sweep_s=3600)
    extra = ["--search-lag", "10", "--lookup-key", KEY]
    with fake_provider(tmp_path / "receipts.jsonl", extra_args=extra) as fake:
        crash(ledger, fake, "after:dispatch", "paid", args)
        crash(ledger, fake, "after:admit", "lost", args)
        # Taken after the crash returns, so it is no earlier than the lost call's
        # admission: a slow proxy start must not leave that call inside its freshness.
        lost_at = time.time()
        assert len(charges(fake)) == 1
        proxy = start_proxy(ledger, upstreams={"payments": fake.url}, args=args, env=ENV)
        try:

            def resend(key: str) -> httpx.Response:
                headers = {"Idempotency-Key": key}
                return httpx.post(proxy.url + ROUTE, json=charge(1), headers=headers, timeout=30)

            for key in ("paid", "lost"):
                refused = resend(key)
                assert refused.status_code == 409, refused.text
                assert refused.json()["error"]["type"] == "effect_unknown"
            time.sleep(max(0.0, lost_at + 15.5 - time.time()))  # past the lag and freshness
            paid, lost = resend("paid"), resend("lost")
        finally:
            proxy.stop()
        assert paid.status_code == 200, paid.text
        assert paid.headers["effectguard-recovered"] == "lookup:payments"
        assert lost.status_code == 200, lost.text
        assert "effectguard-recovered" not in lost.headers
        receipts = charges(fake)
        assert len(receipts) == 2  # the paid one once, the lost one once
        assert paid.json()["id"] == f"send_fake{receipts[0]['seq']}"
        for response, applied in ((paid, True), (lost, False)):
            (decided,) = decisions(ledger, response.headers["effectguard-call-id"])
            assert (decided["by"], decided["applied"]) == ("lookup:payments", applied)
            assert "evidence sha256:" in decided["note"]
        assert cli("verify", "--ledger", str(ledger))["ok"] is True


@pytest.mark.parametrize("sweep_s", [0.2, 3600], ids=["periodic", "startup-only"])
def test_the_sweeper_decides_what_a_dead_process_left_by_lookup(
    tmp_path: Path, sweep_s: float
) -> None:
    """With no request at all, the sweeper asks the lookup of the unknown calls crashes
    left behind: sweeping every 0.2 s, and in its first sweep at startup alone (sweep_s =
    3600: no periodic sweep runs)."""
    ledger = tmp_path / "ledger.db"
    args = proxy_args(tmp_path, freshness=0, sweep_s=sweep_s)
    with fake_provider(tmp_path / "receipts.jsonl", extra_args=["--lookup-key", KEY]) as fake:
        crash(ledger, fake, "after:dispatch", "paid", args)
        crash(ledger, fake, "after:admit", "lost", args)
        proxy = start_proxy(ledger, upstreams={"payments": fake.url}, args=args, env=ENV)
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                calls = cli("calls", "--ledger", str(ledger))
                stages = {c["idempotency_key"]: c["stage"] for c in calls}
                if "effect_unknown" not in stages.values():
                    break
                time.sleep(0.2)
        finally:
            proxy.stop()
        assert stages == {"paid": "reconciled_applied", "lost": "reconciled_not_applied"}
        assert len(charges(fake)) == 1
        assert cli("verify", "--ledger", str(ledger))["ok"] is True


def test_reconcile_auto_sends_the_providers_key(tmp_path: Path) -> None:
    """--auto asks the declared search with the key from PAYMENTS_API_KEY (without it the
    provider answers 401, which decides nothing), and keeps the object it found, which a
    later keyed resend through the proxy replays with no provider call."""
    ledger = tmp_path / "ledger.db"
    args = proxy_args(tmp_path, freshness=0, sweep_s=3600)
    folder = args[1]
    with fake_provider(tmp_path / "receipts.jsonl", extra_args=["--lookup-key", KEY]) as fake:
        crash(ledger, fake, "after:dispatch", "paid", args)
        # A restart marks the crashed call unknown; without the key its startup sweep's
        # lookup is refused 401, so the call is left for --auto.
        keyless = {"PAYMENTS_API_KEY": ""}
        start_proxy(ledger, upstreams={"payments": fake.url}, args=args, env=keyless).stop()
        auto = ("reconcile", "--auto", "--ledger", str(ledger), "--providers", folder)
        auto += ("--upstream", f"payments={fake.url}")
        (unauthorized,) = cli(*auto, env=keyless)
        assert unauthorized["result"] == "unknown"
        assert "401" in unauthorized["note"]
        (authorized,) = cli(*auto, env=ENV)
        assert authorized["result"] == "applied"
        (decided,) = decisions(ledger, authorized["call_id"])
        assert decided["by"] == "lookup:payments"
        assert cli(*auto, env=ENV) == []
        # --auto kept the object the search returned: the client's resend replays it.
        proxy = start_proxy(ledger, upstreams={"payments": fake.url}, args=args, env=ENV)
        try:
            replay = httpx.post(
                proxy.url + ROUTE, json=charge(1), headers={"Idempotency-Key": "paid"}, timeout=30
            )
        finally:
            proxy.stop()
        assert replay.status_code == 200, replay.text
        assert replay.headers["effectguard-replayed"] == "true"
        assert replay.headers["effectguard-recovered"] == "lookup:payments"
        (receipt,) = charges(fake)
        assert replay.json()["id"] == f"send_fake{receipt['seq']}"
        assert cli("verify", "--ledger", str(ledger))["ok"] is True
