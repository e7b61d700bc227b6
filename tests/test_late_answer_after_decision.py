"""A late answer that arrives after a person decided the call "not applied".

The decision frees the call's ``Idempotency-Key``, and ``show`` used to offer the keyed
resend that such a decision usually calls for, even when the provider's own answer,
kept as evidence afterwards, says the effect happened: following it made the effect a
second time. Effects are counted from the fake provider's receipts.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_dead_owner import run
from test_reconcile_auto import SEND, email, upstreams
from toolkit import cli_json as cli

from effectguard.testing import fake_provider, start_proxy

pytestmark = pytest.mark.slow


def test_show_warns_against_a_resend_when_a_late_answer_contradicts_not_applied(
    tmp_path: Path,
) -> None:
    """A call taken over from a paused ``serve`` and decided ``--not-applied``; the server
    resumes and its late 200 is kept: ``show`` then says not to resend, and names the
    late answer, instead of offering the resend."""
    ledger = tmp_path / "ledger.db"
    where = ("--ledger", str(ledger))
    config = tmp_path / "effectguard.toml"
    config.write_text("[server]\nlease_s = 2\nheartbeat_s = 0.5\n")
    with fake_provider(tmp_path / "receipts.jsonl", idempotent=True) as fake:
        proxy = start_proxy(ledger, upstreams=upstreams(fake), args=("--config", str(config)))
        answers: list[httpx.Response] = []
        slow = threading.Thread(
            target=lambda: answers.append(
                httpx.post(
                    proxy.url + SEND,
                    json=email("q@x"),
                    headers={"x-fake-delay": "2", "Idempotency-Key": "q"},
                    timeout=60,
                )
            )
        )
        try:
            slow.start()
            deadline = time.monotonic() + 10
            calls: list[Any] = []
            while not calls and time.monotonic() < deadline:
                calls = cli("calls", *where, "--state", "in_flight")
                time.sleep(0.05)
            (call,) = calls
            call_id = call["call_id"]
            # In flight is recorded before the send: pause once the provider has the request,
            # or the resumed worker, past its lease, rightly sends nothing at all.
            while not fake.receipts() and time.monotonic() < deadline:
                time.sleep(0.02)
            assert fake.receipts(), "the call never reached the provider"
            proxy.process.send_signal(signal.SIGSTOP)
            try:
                time.sleep(3)  # past the 2 s lease; the provider answers meanwhile
                run("reconcile", call_id, "--not-applied", "--note", "n", *where)  # takes over
                decided = run("reconcile", call_id, "--not-applied", "--note", "none seen", *where)
                assert decided.returncode == 0, decided.stdout + decided.stderr
            finally:
                proxy.process.send_signal(signal.SIGCONT)
            slow.join(30)
            assert answers and answers[0].status_code == 502, answers
        finally:
            proxy.stop()
        shown = cli("show", call_id, *where)
        assert shown["stage"] == "reconciled_not_applied"
        assert [e["status"] for e in shown["evidence"]] == [200], shown["evidence"]
        assert shown["next_command"].startswith("do not resend"), shown["next_command"]
        text = run("show", call_id, *where).stdout
        assert "resend the request with the same Idempotency-Key" not in text
        assert "do not resend: a late answer kept for attempt 1 (status 200)" in text
        assert len(fake.effects()) == 1
