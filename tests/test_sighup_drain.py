"""SIGHUP to ``effectguard serve`` (a terminal hangup, a logrotate ``postrotate``, a
process manager's reload) drains as SIGTERM does (docs/operations.md, "Shutting down:
the SIGTERM drain"): a call in flight finishes, its client has its answer, the process
exits 0 and says why it stopped. It used to end the process at once, like any unhandled
signal: the call left in flight, later ``effect_unknown``, and its client's connection reset.

Real processes: the proxy and the fake provider, which holds the call (``x-fake-delay``).
"""

from __future__ import annotations

import contextlib
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from observing import cli_json, wait_for
from shutdownkit import PATIENCE_S, refusing, request_under_way, whole_answer_on

from effectguard.testing import FakeProvider, Proxy, fake_provider, running_proxy


@pytest.fixture
def provider(tmp_path: Path) -> Iterator[FakeProvider]:
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        yield fake


@contextlib.contextmanager
def _draining_on_sighup(
    ledger: str, tmp_path: Path, provider: FakeProvider, delay_s: int
) -> Iterator[tuple[Proxy, socket.socket]]:
    """A ``serve`` on ``ledger`` draining on SIGHUP, and the raw connection of its call in
    flight, which the provider holds for ``delay_s``."""
    upstreams = {"openai": provider.url}
    log_path = tmp_path / "proxy.log"
    with running_proxy(ledger, upstreams=upstreams, log_path=log_path) as proxy:
        waiting = request_under_way(proxy, "slow", f"x-fake-delay: {delay_s}\r\n")
        wait_for(lambda: len(provider.receipts()) == 1, PATIENCE_S, "the call's receipt")
        proxy.kill(signal.SIGHUP)
        wait_for(lambda: refusing(proxy), PATIENCE_S, "the drain to begin")
        yield proxy, waiting


def test_sighup_drains_the_call_in_flight(tmp_path: Path, provider: FakeProvider) -> None:
    ledger = str(tmp_path / "l.db")
    with _draining_on_sighup(ledger, tmp_path, provider, 2) as (proxy, waiting):
        answer = whole_answer_on(waiting)
        status = proxy.process.wait(PATIENCE_S)
        log = proxy.log()
    assert answer is not None, f"the client's connection was closed unanswered; {log}"
    assert answer.status == 200, (answer.status, log)
    assert status == 0, (status, log)
    assert "SIGHUP" in log, log  # the stop says why
    call_id = answer.headers["effectguard-call-id"]
    shown = cli_json("show", call_id, "--ledger", ledger)
    assert shown["stage"] == "completed", shown
    assert len(provider.receipts()) == 1


def test_a_second_sighup_stops_at_once(tmp_path: Path, provider: FakeProvider) -> None:
    """A second signal during a SIGHUP's drain stops the process at once, as a second
    SIGTERM does: exit 0, the documented log line, the call cut off ``effect_unknown``."""
    ledger = str(tmp_path / "l.db")
    with _draining_on_sighup(ledger, tmp_path, provider, 30) as (proxy, waiting):
        proxy.kill(signal.SIGHUP)
        answer = whole_answer_on(waiting)
        status = proxy.process.wait(PATIENCE_S)
        log = proxy.log()
    assert status == 0, (status, log)
    assert "stopped without draining (a second signal)" in log, log
    assert answer is not None and answer.status == 504, (answer, log)
    assert answer.json()["error"]["type"] == "effect_unknown", answer
    assert len(provider.receipts()) == 1
