"""A request still in its admission when a stop cuts its caller off (``effectguard
serve``'s drain ends, docs/operations.md "Shutting down: the SIGTERM drain"; a transport's
caller stops waiting and the transport is closed, docs/contract.md §3.8): nothing is sent,
and the admission that commits after that is recorded ``not_sent`` before the ledger
closes, its reservation released.

Real processes: the proxy, the fake provider (whose receipt log counts what reached it)
and this test, which holds the ledger's write lock (SQLite's, as a backup tool does;
PostgreSQL's batch lock, as a wedged replica does) to keep the request in its admission
until its caller has been cut off, then lets it go while the proxy (or the transport)
stops.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from observing import cli_json
from pgkit import ledger_url
from shutdownkit import PATIENCE_S, answer_on, request_under_way, write_lock

import effectguard
from effectguard.testing import FakeProvider, fake_provider, running_proxy

_ = (ledger_url,)  # fixtures

CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def provider(tmp_path: Path) -> Iterator[FakeProvider]:
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        yield fake


def test_an_admission_the_drain_cut_off_is_recorded_not_sent(
    ledger_url: str, provider: FakeProvider, tmp_path: Path
) -> None:
    """The drain ends while the request waits for the ledger; its admission commits only
    as the proxy stops. It is recorded ``not_sent``, its reservation released, before the
    ledger closes. On PostgreSQL the proxy closed the ledger without waiting for it: the
    ``not_sent`` record failed ("not_sent_failed ... is not open") and the call was left
    ``in_flight``, its reservation held, until a later sweep made it ``effect_unknown``,
    though nothing had been sent. (On SQLite it was recorded, as if its client had gone
    away.)"""
    ledger = ledger_url
    config = tmp_path / "drain.toml"
    config.write_text("[server]\ndrain_timeout_s = 1\n")
    upstreams = {"openai": provider.url}
    flags = ["--config", str(config)]
    log_path = tmp_path / "proxy.log"
    with running_proxy(ledger, upstreams=upstreams, args=flags, log_path=log_path) as proxy:
        with write_lock(ledger) as release:
            held = request_under_way(proxy, "held")
            proxy.kill(signal.SIGTERM)
            answer = answer_on(held)  # the drain's end cut it off, the lock still held
            release()  # its admission commits now, while the proxy stops
            code = proxy.process.wait(PATIENCE_S)
        log = proxy.log()
    assert answer == (503, "shutting_down"), (answer, log)
    assert code == 0, log
    assert "not_sent_failed" not in log, log
    calls = cli_json("calls", "--ledger", ledger)
    assert Counter(c["stage"] for c in calls) == {"not_sent": 1}, (calls, log)
    assert [c["held_usd"] for c in calls] == ["0.000000000"], calls
    [attempt] = cli_json("show", calls[0]["call_id"], "--ledger", ledger)["attempts_detail"]
    why = "not sent: admitted as the process stopped: the proxy's drain timeout ended"
    assert attempt["ended"] == why, attempt
    assert provider.receipts() == []


def test_an_admission_whose_caller_stopped_waiting_is_recorded_not_sent_by_the_close(
    ledger_url: str, provider: FakeProvider
) -> None:
    """A transport's caller stops waiting (its own timeout) while its admission waits for
    the ledger, and the transport is closed; the admission commits only then. It is
    recorded ``not_sent`` before the close returns. On PostgreSQL the close closed the
    ledger without waiting for it: its ``not_sent`` record failed and the call was left
    ``in_flight``, its reservation held, though nothing had been sent."""
    ledger = ledger_url
    url = provider.url + "/v1/chat/completions"

    async def scenario() -> None:
        transport = effectguard.AsyncGuardTransport(
            ledger=ledger, upstreams={"openai": provider.url}
        )
        client = httpx.AsyncClient(transport=transport)
        assert (await client.post(url, json=CHAT)).status_code == 200  # started, unlocked
        with write_lock(ledger) as release:
            with pytest.raises(httpx.ReadTimeout):
                await client.post(url, json=CHAT, timeout=0.5)
            closing = asyncio.ensure_future(transport.aclose())
            # Let go from another thread, as another process would: the close may hold the
            # loop. Sooner or later, the admission is recorded the same: the wait only
            # lets the close reach the ledger's close first, as it did before the fix.
            letting_go = threading.Timer(0.3, release)
            letting_go.start()
            await asyncio.wait_for(closing, PATIENCE_S)
            letting_go.join()

    asyncio.run(scenario())
    calls = cli_json("calls", "--ledger", ledger)
    assert Counter(c["stage"] for c in calls) == {"completed": 1, "not_sent": 1}, calls
    [unsent] = [c for c in calls if c["stage"] == "not_sent"]
    assert unsent["held_usd"] == "0.000000000", unsent
    assert len(provider.receipts()) == 1
