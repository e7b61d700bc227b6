"""An admission slower than a stop's whole wait: it commits only as the ledger closes
(docs/operations.md "Shutting down: the SIGTERM drain"; a transport's close,
docs/contract.md §3.8).

The ledger's write lock (SQLite's, as a backup tool holds it; PostgreSQL's batch lock, as
a wedged replica holds it) is held from outside while a request waits in its admission;
the transport is closed, and the lock let go only once the close has stopped waiting for
its callers and is closing the ledger, which takes no new write from then on. Nothing may
be sent (the close stopped sending long before); the caller is told so (503
``shutting_down``, ``x-should-retry: true``); and the call is recorded ``not_sent``, its
reservation released. Until 2026-12-05 its ``not_sent`` record came after the admission,
was refused by the closing ledger (its caller got 503 ``ledger_unavailable``), and the
call was left ``in_flight``, its reservation held (then ``effect_unknown`` at the next
start), though nothing had been sent. Effects are counted with the fake provider's receipts.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from observing import cli_json, wait_for
from pgkit import ledger_url
from shutdownkit import (
    PATIENCE_S,
    answer_on,
    chat,
    closing_lets_the_lock_go,
    request_under_way,
    whole_answer_on,
    write_lock,
)

import effectguard
import effectguard.callpath.dispatches
import effectguard.callpath.guard
import effectguard.config.defaults
import effectguard.ingress.transport
from effectguard.callpath.recorder import Recorder
from effectguard.testing import FakeProvider, fake_provider, running_proxy

_ = (ledger_url,)  # fixtures

pytestmark = pytest.mark.slow


@pytest.fixture
def provider(tmp_path: Path) -> Iterator[FakeProvider]:
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        yield fake


def test_an_admission_committing_as_the_ledger_closes_is_recorded_not_sent(
    ledger_url: str, provider: FakeProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The close's waits made short (well inside the lock's 5 s timeout), the lock let go
    as the ledger closes: the admission commits then. Its caller gets 503, nothing is
    sent, and the call is ``not_sent``, nothing reserved or held; ``verify`` passes."""
    monkeypatch.setattr(effectguard.config.defaults, "DRAIN_TIMEOUT_S", 0.3)
    monkeypatch.setattr(effectguard.ingress.transport, "MARKING_WAIT_S", 0.3)
    ledger = ledger_url
    url = provider.url + "/v1/chat/completions"
    headers = {"content-type": "application/json"}

    async def scenario() -> httpx.Response | Exception:
        transport = effectguard.AsyncGuardTransport(
            ledger=ledger, upstreams={"openai": provider.url}
        )
        client = httpx.AsyncClient(transport=transport, timeout=PATIENCE_S)
        warm = await client.post(url, content=chat("started"), headers=headers)
        assert warm.status_code == 200, warm.text  # the runtime started, the ledger made
        store: Any = transport.ledger.store
        with write_lock(ledger) as release:
            closing_lets_the_lock_go(store, ledger, release)
            call = asyncio.ensure_future(client.post(url, content=chat("held"), headers=headers))
            await asyncio.sleep(0.1)  # its admission waits for the lock
            await asyncio.wait_for(transport.aclose(), PATIENCE_S * 2)
            try:
                return await asyncio.wait_for(call, PATIENCE_S)
            except Exception as exc:  # what its caller is told, whatever it is
                return exc

    answer = asyncio.run(scenario())
    assert len(provider.receipts()) == 1  # the warm-up's: nothing sent after the stop
    assert isinstance(answer, httpx.Response), answer
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["type"] == "shutting_down", answer.text
    assert answer.headers["x-should-retry"] == "true", answer.headers
    calls = cli_json("calls", "--ledger", ledger)
    held = [c for c in calls if c["stage"] != "completed"]
    assert [(c["stage"], c["held_usd"]) for c in held] == [("not_sent", "0.000000000")], calls
    (node,) = [b for b in cli_json("budgets", "--ledger", ledger) if b["path"] == "default"]
    assert (node["reserved_usd"], node["held_usd"]) == ("0.000000000", "0.000000000"), node
    assert cli_json("verify", "--ledger", ledger)["ok"] is True


def test_a_sync_transports_admission_committing_as_the_ledger_closes_is_not_sent(
    tmp_path: Path, provider: FakeProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same through the sync transport, its caller in a thread of its own: answered
    (not left waiting on a closed transport), 503, nothing sent, the call ``not_sent``."""
    monkeypatch.setattr(effectguard.config.defaults, "DRAIN_TIMEOUT_S", 0.3)
    monkeypatch.setattr(effectguard.ingress.transport, "MARKING_WAIT_S", 0.3)
    ledger = str(tmp_path / "l.db")
    url = provider.url + "/v1/chat/completions"
    transport = effectguard.GuardTransport(ledger=ledger, upstreams={"openai": provider.url})
    client = httpx.Client(transport=transport, timeout=PATIENCE_S)
    assert client.post(url, content=chat("started")).status_code == 200
    store: Any = transport.ledger.store
    told: list[object] = []

    def call() -> None:
        try:
            told.append(client.post(url, content=chat("held")))
        except Exception as exc:  # what its caller is told, whatever it is
            told.append(exc)

    with write_lock(ledger) as release:
        closing_lets_the_lock_go(store, ledger, release)
        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        wait_for(lambda: not caller.is_alive() or _admitting(transport), PATIENCE_S, "admitting")
        transport.close()
        caller.join(PATIENCE_S)
    assert not caller.is_alive(), "its caller still waits on a closed transport"
    (answer,) = told
    assert isinstance(answer, httpx.Response), answer
    assert (answer.status_code, answer.json()["error"]["type"]) == (503, "shutting_down")
    assert len(provider.receipts()) == 1
    calls = cli_json("calls", "--ledger", ledger)
    held = [(c["stage"], c["held_usd"]) for c in calls if c["stage"] != "completed"]
    assert held == [("not_sent", "0.000000000")], calls
    assert cli_json("verify", "--ledger", ledger)["ok"] is True


def _admitting(transport: effectguard.GuardTransport) -> bool:
    """Whether a call is under way in ``transport`` (its admission waits for the lock)."""
    return bool(transport._async._calls)


#: Run in ``serve``: its wait for admissions (5 s) made short, so the ledger closes well
#: inside the lock's 5 s timeout; the closing ledger takes no new write, and says when it
#: begins to close (a file), so the test lets the lock go only then.
CLOSING = """
import os
import pathlib

import effectguard.callpath.runtime as runtime
from effectguard.errors import LedgerUnavailable
from effectguard.ledger.sqlite import SqliteStore

runtime.settle_admissions.__defaults__ = (0.2,)
_close = SqliteStore.close


async def close(self):
    async def refused(*_):
        raise LedgerUnavailable(f"ledger {self.path} is not open")

    self.write = refused
    pathlib.Path(os.environ["EFFECTGUARD_TEST_CLOSING"]).touch()
    await _close(self)


SqliteStore.close = close
"""


def test_serves_admission_committing_as_the_ledger_closes_is_recorded_not_sent(
    provider: FakeProvider, tmp_path: Path
) -> None:
    """SIGTERM while a request waits for the write lock (held here, as another process
    would): the drain's end answers it 503 ``shutting_down``; the lock is let go only as
    the proxy closes its ledger. The admission commits then: recorded ``not_sent``, never
    sent, nothing reserved or held."""
    site, closing = tmp_path / "site", tmp_path / "closing"
    site.mkdir()
    (site / "sitecustomize.py").write_text(CLOSING)
    (tmp_path / "c.toml").write_text("[server]\ndrain_timeout_s = 1\n")
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONPATH": path, "EFFECTGUARD_TEST_CLOSING": str(closing)}
    ledger = str(tmp_path / "l.db")
    args = ["--config", str(tmp_path / "c.toml")]
    upstreams = {"openai": provider.url}
    with running_proxy(ledger, upstreams=upstreams, args=args, env=env) as proxy:
        url = proxy.url + "/openai/v1/chat/completions"
        warm = httpx.post(url, content=chat("started"), timeout=PATIENCE_S)
        assert warm.status_code == 200, warm.text
        with write_lock(ledger) as release:
            held = request_under_way(proxy, "held")
            proxy.kill(signal.SIGTERM)
            answer = answer_on(held)  # the drain's end cut it off, the lock still held
            wait_for(closing.exists, PATIENCE_S, "the proxy closing its ledger")
            release()  # its admission commits now, as the ledger closes
            code = proxy.process.wait(PATIENCE_S)
        log = proxy.log()
    assert answer == (503, "shutting_down"), (answer, log)
    assert code == 0, log
    assert len(provider.receipts()) == 1, log  # the warm-up's
    calls = cli_json("calls", "--ledger", ledger)
    held_calls = [c for c in calls if c["stage"] != "completed"]
    stages = [(c["stage"], c["held_usd"]) for c in held_calls]
    assert stages == [("not_sent", "0.000000000")], (calls, log)
    assert "not_sent_failed" not in log, log
    assert cli_json("verify", "--ledger", ledger)["ok"] is True


def test_a_retry_starting_as_the_ledger_closes_is_recorded_not_sent(
    tmp_path: Path, provider: FakeProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guard's own retry after the provider's 429: its attempt start waits for the
    write lock (held here from just before it is queued) past the close's waits (made
    short), and commits only as the ledger closes, taking no new write. Nothing more is
    sent, and the retry is recorded ``not_sent`` in the start's own transaction, nothing
    reserved or held. Until 2026-12-05 its ``not_sent`` record came in a write of its
    own, refused by the closing ledger: the call was left ``in_flight``, its reservation
    held (``effect_unknown`` at the next start), though the retry was never sent."""
    monkeypatch.setattr(effectguard.config.defaults, "DRAIN_TIMEOUT_S", 0.3)
    monkeypatch.setattr(effectguard.ingress.transport, "MARKING_WAIT_S", 0.3)
    # The cut-off's wait for the dispatch, and for the markings, too.
    monkeypatch.setattr(effectguard.callpath.dispatches, "MARKING_WAIT_S", 0.3)
    monkeypatch.setattr(effectguard.callpath.guard, "MARKING_WAIT_S", 0.3)
    ledger = str(tmp_path / "l.db")
    url = provider.url + "/v1/chat/completions"
    headers = {"content-type": "application/json", "x-fake-behaviour": "status=429"}
    next_attempt = Recorder.next_attempt

    async def scenario() -> httpx.Response | Exception:
        transport = effectguard.AsyncGuardTransport(
            ledger=ledger, upstreams={"openai": provider.url}
        )
        client = httpx.AsyncClient(transport=transport, timeout=PATIENCE_S)
        store: Any = transport.ledger.store
        with contextlib.ExitStack() as stack:
            starting = asyncio.Event()
            releases: list[Callable[[], None]] = []

            async def held(self: Recorder, prepared: Any, previous: Any) -> Any:
                # The lock taken before the retry's start is queued: it waits for it.
                releases.append(stack.enter_context(write_lock(ledger)))
                starting.set()
                return await next_attempt(self, prepared, previous)

            monkeypatch.setattr(Recorder, "next_attempt", held)
            # No new write once it closes; the queued start commits (the lock taken by then).
            closing_lets_the_lock_go(store, ledger, lambda: releases[0]())
            call = asyncio.ensure_future(client.post(url, content=chat("limited"), headers=headers))
            await asyncio.wait_for(starting.wait(), PATIENCE_S)
            await asyncio.sleep(0.1)  # the retry's start waits for the lock
            await asyncio.wait_for(transport.aclose(), PATIENCE_S * 2)
            try:
                return await asyncio.wait_for(call, PATIENCE_S)
            except Exception as exc:  # what its caller is told, whatever it is
                return exc

    answer = asyncio.run(scenario())
    assert [r["status"] for r in provider.receipts()] == [429]  # the retry never went out
    assert isinstance(answer, httpx.Response), answer
    assert answer.status_code == 429, (answer.status_code, answer.text)
    calls = cli_json("calls", "--ledger", ledger)
    assert [(c["stage"], c["attempts"], c["held_usd"]) for c in calls] == [
        ("not_sent", 2, "0.000000000")
    ], (calls, answer.status_code, answer.text)
    (node,) = [b for b in cli_json("budgets", "--ledger", ledger) if b["path"] == "default"]
    assert (node["reserved_usd"], node["held_usd"]) == ("0.000000000", "0.000000000"), node
    assert cli_json("verify", "--ledger", ledger)["ok"] is True


#: Run in ``serve``: the guard's retry start waits, once under way (a file says so), until
#: the ledger begins to close (a file), as a start waiting for the write lock would; the
#: cut-off's wait for a dispatch made short, and the dispatch's own wait for the start
#: shorter still (the bound under test).
SLOW_RETRY = """
import asyncio
import os
import pathlib

import effectguard.callpath.attempts as attempts
import effectguard.callpath.dispatches as dispatches
from effectguard.callpath.recorder import Recorder
from effectguard.ledger.sqlite import SqliteStore

dispatches.MARKING_WAIT_S = 2.0  # margin over the bound below on a loaded host
attempts.RETRY_START_WAIT_S = 0.2
_next_attempt = Recorder.next_attempt
_close = SqliteStore.close
closing = pathlib.Path(os.environ["EFFECTGUARD_TEST_CLOSING"])


async def next_attempt(self, prepared, previous):
    pathlib.Path(os.environ["EFFECTGUARD_TEST_STARTING"]).touch()
    while not closing.exists():
        await asyncio.sleep(0.02)
    return await _next_attempt(self, prepared, previous)


async def close(self):
    closing.touch()
    await asyncio.sleep(0.3)  # the retry's start commits as the ledger closes
    await _close(self)


Recorder.next_attempt = next_attempt
SqliteStore.close = close
"""


def test_a_retry_start_slower_than_the_cut_off_still_answers_the_providers_429(
    provider: FakeProvider, tmp_path: Path
) -> None:
    """SIGTERM while the guard's own retry after the provider's 429 is starting, its start
    slower than the cut-off's whole wait for the dispatch (it commits only as the ledger
    closes). The client is still answered the provider's 429 (contract.md §3.5), and the
    retry, never sent, is recorded ``not_sent``. Until 2026-12-05 the dispatch waited for
    the start without bound, the cut-off stopped waiting for it first, and the client got
    503 ``shutting_down`` instead."""
    site, closing, starting = tmp_path / "site", tmp_path / "closing", tmp_path / "starting"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_RETRY)
    (tmp_path / "c.toml").write_text("[server]\ndrain_timeout_s = 1\n")
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    env = {
        "PYTHONPATH": path,
        "EFFECTGUARD_TEST_CLOSING": str(closing),
        "EFFECTGUARD_TEST_STARTING": str(starting),
    }
    ledger = str(tmp_path / "l.db")
    args = ["--config", str(tmp_path / "c.toml")]
    with running_proxy(ledger, upstreams={"openai": provider.url}, args=args, env=env) as proxy:
        limited = request_under_way(proxy, "limited", "x-fake-behaviour: status=429\r\n")
        wait_for(starting.exists, PATIENCE_S, "the guard starting its retry")
        proxy.kill(signal.SIGTERM)
        answer = whole_answer_on(limited)
        code = proxy.process.wait(PATIENCE_S)
        log = proxy.log()
    assert answer is not None, log
    assert answer.status == 429, (answer.status, answer.body, log)
    assert code == 0, log
    assert [r["status"] for r in provider.receipts()] == [429], log  # the retry never went out
    calls = cli_json("calls", "--ledger", ledger)
    assert [(c["stage"], c["attempts"], c["held_usd"]) for c in calls] == [
        ("not_sent", 2, "0.000000000")
    ], (calls, log)
    assert cli_json("verify", "--ledger", ledger)["ok"] is True
