"""A call cut off at the end of ``effectguard serve``'s drain whose marking the ledger
refuses (docs/operations.md, "Shutting down: the SIGTERM drain"): it is left as a crash
leaves it, and its client is still told that it may have taken effect.

Real processes: the proxy, the fake provider, and this test holding SQLite's write lock
(as a backup tool does) from before the drain ends until the client has its answer, so
the marking waits SQLite's 5 s for the lock and is refused.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from observing import wait_for
from shutdownkit import PATIENCE_S, answer_on, request_under_way, settled_stages, write_lock

from effectguard.testing import FakeProvider, fake_provider, running_proxy


@pytest.fixture
def provider(tmp_path: Path) -> Iterator[FakeProvider]:
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        yield fake


def test_a_call_cut_off_unmarked_is_answered_effect_unknown(
    tmp_path: Path, provider: FakeProvider
) -> None:
    """The drain ends while the call waits for its provider and the ledger's write lock is
    held elsewhere: the marking fails, the call stays in flight for the next start, and
    its client gets 504 ``effect_unknown`` (the request reached the provider). It was
    answered 503 ``shutting_down``, "ended as in_flight ... resend it with the same
    Idempotency-Key", as if the call had ended before it was cut off."""
    ledger = str(tmp_path / "l.db")
    config = tmp_path / "drain.toml"
    config.write_text("[server]\ndrain_timeout_s = 1\n")
    upstreams = {"openai": provider.url}
    flags = ["--config", str(config)]
    log_path = tmp_path / "proxy.log"
    with running_proxy(ledger, upstreams=upstreams, args=flags, log_path=log_path) as proxy:
        waiting = request_under_way(proxy, "slow", "x-fake-delay: 30\r\n")
        wait_for(lambda: len(provider.receipts()) == 1, PATIENCE_S, "the call's receipt")
        with write_lock(ledger):
            proxy.kill(signal.SIGTERM)
            answer = answer_on(waiting)  # given while the lock is still held
        proxy.process.wait(PATIENCE_S)
        log = proxy.log()
    assert "interrupt_failed" in log, log  # the marking was refused, as this test meant
    assert answer == (504, "effect_unknown"), (answer, log)
    with running_proxy(ledger, upstreams=upstreams, log_path=tmp_path / "next.log"):
        stages = wait_for(lambda: settled_stages(ledger), PATIENCE_S, "no call in flight")
    assert stages == {"effect_unknown": 1}, stages
    assert len(provider.receipts()) == 1
