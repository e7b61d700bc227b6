"""A second SIGTERM or Ctrl-C during ``effectguard serve``'s drain (docs/operations.md,
"Shutting down: the SIGTERM drain"): the proxy stops at once, and nothing that had not
gone to the provider by then goes there afterwards.

Real processes throughout: the proxy, the fake provider (whose receipt log counts what
reached it) and this test, which holds the ledger's write lock (SQLite's, as a backup
tool does; PostgreSQL's batch lock, as a wedged replica does) to keep requests in their
admission. For those admissions to commit just as
the second signal arrives, the proxy is frozen (SIGSTOP), sent the signal, the lock is
let go, and the proxy let go (SIGCONT): the signal and the free lock then meet it at
the same instant, as they may on a loaded host.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from observing import wait_for
from pgkit import ledger_url
from shutdownkit import (
    OPENAI_CHAT,
    PATIENCE_S,
    answer_on,
    chat,
    refusing,
    request_under_way,
    settled_stages,
    whole_answer_on,
    write_lock,
)

from effectguard.testing import FakeProvider, fake_provider, running_proxy

#: A bound on a hang of the sweep that takes over what the stopped proxy left (on PostgreSQL,
#: once its lease has expired).
SWEEP_PATIENCE_S = 90.0
#: Requests kept in their admission by the locked ledger when the second signal comes.
HELD = 3


@pytest.fixture
def provider(tmp_path: Path) -> Iterator[FakeProvider]:
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        yield fake


_ = (ledger_url,)  # fixtures


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_nothing_reaches_the_provider_after_a_second_signal(
    ledger_url: str, provider: FakeProvider, second: signal.Signals, tmp_path: Path
) -> None:
    """A second SIGTERM (or a Ctrl-C) during the drain, just as requests held in their
    admission commit: none of them is sent. Each is answered 503 ``shutting_down`` and
    recorded ``not_sent``, or, cut off before that, left as a crash leaves it; the call
    still waiting for its provider is ``effect_unknown``; the exit status is 0, and the
    next start leaves no call in flight. (The second signal used to leave sending on:
    an admission committing before the process ended was sent, its effect begun after
    the proxy was told to stop at once. And on SQLite, a batch still waiting for the
    write lock as the loop's teardown cancelled it left a transaction open on the
    writer's connection: every later write failed, "cannot start a transaction within a
    transaction", and the call cut off was left unmarked, its client answered 503.)"""
    ledger = ledger_url
    upstreams = {"openai": provider.url}
    with running_proxy(ledger, upstreams=upstreams, log_path=tmp_path / "proxy.log") as proxy:
        waiting = request_under_way(proxy, "slow", "x-fake-delay: 30\r\n")
        wait_for(lambda: len(provider.receipts()) == 1, PATIENCE_S, "the slow call's receipt")
        with write_lock(ledger) as release:
            held = [request_under_way(proxy, f"held {n}") for n in range(HELD)]
            proxy.kill(signal.SIGTERM)
            wait_for(lambda: refusing(proxy), PATIENCE_S, "the drain to close the listener")
            with pytest.raises(httpx.ConnectError):  # a request arriving now is turned away
                httpx.post(proxy.url + OPENAI_CHAT, content=chat("late"), timeout=PATIENCE_S)
            proxy.kill(signal.SIGSTOP)
            sent_before = provider.receipts()
            proxy.kill(second)
            release()
            proxy.kill(signal.SIGCONT)
            code = proxy.process.wait(PATIENCE_S)
        whole = [whole_answer_on(sock) for sock in held]
        cut_off = answer_on(waiting)
        log = proxy.log()
    answers = [None if a is None else (a.status, a.json()["error"]["type"]) for a in whole]
    assert code == 0, log
    assert "stopped without draining (a second signal)" in log, log
    assert len(sent_before) == 1, sent_before
    assert provider.receipts() == sent_before, (answers, log)
    assert cut_off in (None, (504, "effect_unknown")), (cut_off, log)
    assert all(a in (None, (503, "shutting_down")) for a in answers), answers
    for answer in filter(None, whole):  # key-less, not sent: a resend is safe, and new work
        advice = answer.json()["error"]["message"]
        assert answer.headers["x-should-retry"] == "true", (advice, answer.headers)
        unsent = ("nothing was sent", "before this request was sent")
        assert any(u in advice for u in unsent) and "same Idempotency-Key" not in advice, advice
    # The next start takes over what the stopped process could not mark.
    with running_proxy(ledger, upstreams=upstreams, log_path=tmp_path / "next.log"):
        stages = wait_for(lambda: settled_stages(ledger), SWEEP_PATIENCE_S, "no call in flight")
    assert stages["effect_unknown"] >= 1, stages  # the slow call, sent and never answered
    assert set(stages) <= {"effect_unknown", "not_sent"}, stages
    assert stages.total() <= 1 + HELD, stages
    assert provider.receipts() == sent_before
