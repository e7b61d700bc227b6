"""The operator's night on a PostgreSQL fleet (docs/operations.md): what `reconcile` says
about a call whose replica was killed a moment ago, on this very host.

On PostgreSQL no file lock proves a replica's process gone, even on its own host: only its
lease does (docs/contract.md §7). The refusal must say so, not promise what SQLite does.
"""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest
from pgkit import NEEDS_PG, pg_url
from toolkit import cli_json, cli_run

from effectguard.testing import fake_provider, start_proxy

_ = (pg_url,)  # fixtures
pytestmark = [*NEEDS_PG, pytest.mark.slow]


def test_a_call_of_a_replica_killed_here_waits_for_its_lease_and_says_so(
    pg_url: str, tmp_path: Path
) -> None:
    """The replica is SIGKILLed mid-call on this host; the operator runs the `reconcile`
    the runbook gives at once. It is refused (exit 3, nothing written), rightly. The
    message used to say the call is taken over "once that worker's process is gone (seen at
    once on its host) ... and decides it": the process is gone, on this host, and the
    command still refused, with no word that on PostgreSQL the lease (`lease_s`) decides
    when, nor that a call taken over for its lease is decided by a second run."""
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        proxy = start_proxy(
            pg_url,
            upstreams={"openai": fake.url},
            env={"EFFECTGUARD_CRASH_AT": "after:dispatch"},
            log_path=tmp_path / "serve.log",
        )
        try:
            with pytest.raises(httpx.TransportError):
                httpx.post(
                    proxy.url + "/openai/v1/chat/completions",
                    json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]},
                    headers={"Idempotency-Key": "night"},
                    timeout=30,
                )
            assert proxy.process.wait(15) == -signal.SIGKILL
        finally:
            proxy.kill()
        assert len(fake.effects()) == 1
    (call,) = cli_json("calls", "--ledger", pg_url, "--state", "in_flight")
    refused = cli_run(
        "reconcile", call["call_id"], "--ledger", pg_url, "--applied", "--note", "in the log"
    )
    assert refused.returncode == 3, refused.stdout + refused.stderr
    message = refused.stderr
    assert "seen at once on its host" not in message, message
    assert "PostgreSQL" in message and "lease_s" in message, message
    assert "second run" in message, message
    (still,) = cli_json("calls", "--ledger", pg_url)
    assert still["stage"] == "in_flight"
