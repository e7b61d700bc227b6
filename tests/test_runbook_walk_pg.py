"""The operator's night on a PostgreSQL fleet (docs/operations.md): what `reconcile` says
about a call whose replica was killed a moment ago.

Killed on this host, as this user, the replica's lock is free and `reconcile` decides at
once (tests/test_pg_same_host.py). Where its lock cannot be seen (another host's replica,
another OS user's: here its lock file is removed), only its lease proves it gone
(docs/contract.md §7). The refusal must say so, and where to run the command to see it
gone at once.
"""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path

import httpx
import pytest
from pgkit import NEEDS_PG, pg_url
from toolkit import cli_json, cli_run

from effectguard.callpath.recovery import lock_dir_for
from effectguard.testing import fake_provider, start_proxy

_ = (pg_url,)  # fixtures
pytestmark = [*NEEDS_PG, pytest.mark.slow]


def test_a_call_of_a_replica_whose_lock_is_not_seen_waits_for_its_lease_and_says_so(
    pg_url: str, tmp_path: Path
) -> None:
    """The replica is SIGKILLed mid-call where this command cannot see its lock; the
    operator runs the `reconcile` the runbook gives at once. It is refused (exit 3,
    nothing written), rightly, and the message says the lease (`lease_s`) decides when,
    that a call taken over for its lease is decided by a second run, and that on the
    worker's host, as its user, the command sees a gone process at once."""
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
    locks = lock_dir_for(pg_url)
    assert locks is not None
    for event in cli_json("show", call["call_id"], "--ledger", pg_url)["events"]:
        with contextlib.suppress(FileNotFoundError):  # as another host's: not seen here
            (locks / f"{event['worker']}.lock").unlink()
    refused = cli_run(
        "reconcile", call["call_id"], "--ledger", pg_url, "--applied", "--note", "in the log"
    )
    assert refused.returncode == 3, refused.stdout + refused.stderr
    message = refused.stderr
    assert "lease_s" in message, message
    assert "run on the worker's host (on PostgreSQL, as its OS user)" in message, message
    assert "second run" in message, message
    (still,) = cli_json("calls", "--ledger", pg_url)
    assert still["stage"] == "in_flight"
