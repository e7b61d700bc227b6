# ruff: noqa: F811  (the provider fixture is imported by name and used as an argument)
"""A call admitted only once a transport's close has stopped waiting is never sent
(docs/contract.md §3.8), counted by the fake provider's receipt log.

The interleaving is injected: the call's admission is held until the close has stopped
waiting for the calls under way (its 30 s made short), then let commit. The admission
reached the provider and went out after the close had decided to stop (sent after
the ledger was closing, its answer could not be recorded): now it is recorded
``not_sent``, its reservation released, and its caller told 503 ``shutting_down``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import sqlite3
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hostilekit import HostileSearch, Script, hostile_search
from transportkit import provider, stages_of  # noqa: F401  (a fixture, used by name)

import effectguard
import effectguard.config.defaults
from effectguard.callpath.dispatches import Dispatches
from effectguard.ledger import Ledger
from effectguard.ops.cli import main as cli_main
from effectguard.testing import FakeProvider, start_proxy

pytestmark = pytest.mark.slow

CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
#: The key of the call whose admission is held; the others pass.
LATE = "admitted-late"
#: A bound on a hang, not a timing claim.
HANG_BOUND_S = 60.0


@pytest.fixture
def held_admission(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Hold the admission of the call keyed :data:`LATE` until a close has stopped
    waiting (it cuts off what is still under way), then let it commit ahead of the
    ledger's close: the event set once the close stopped waiting."""
    monkeypatch.setattr(effectguard.config.defaults, "DRAIN_TIMEOUT_S", 1.0)
    stopped, committing = threading.Event(), threading.Event()
    admit, cut_off_all = Ledger.admit, Dispatches.cut_off_all

    async def held(self: Ledger, writer: Any, request: Any, *rest: Any) -> Any:
        if request.idempotency_key != LATE:
            return await admit(self, writer, request, *rest)
        await asyncio.to_thread(stopped.wait, HANG_BOUND_S)
        admission = asyncio.ensure_future(admit(self, writer, request, *rest))
        await asyncio.sleep(0)  # its first step has run: it is in the commit queue
        committing.set()
        return await admission

    async def stopping(self: Dispatches, reason: str) -> bool:
        stopped.set()
        # The close goes on once the admission is queued: ahead of the ledger's close.
        await asyncio.to_thread(committing.wait, HANG_BOUND_S)
        return await cut_off_all(self, reason)

    monkeypatch.setattr(Ledger, "admit", held)
    monkeypatch.setattr(Dispatches, "cut_off_all", stopping)
    yield stopped


def _not_sent_as_the_close_says(
    told: httpx.Response, capsys: pytest.CaptureFixture[str], ledger: Path
) -> None:
    """``told`` is 503 ``shutting_down`` naming the late call, which is ``not_sent``, its
    reservation released; the call before it completed."""
    assert told.status_code == 503, told.text
    error = told.json()["error"]
    assert error["type"] == "shutting_down", error
    assert stages_of(capsys, ledger) == Counter(completed=1, not_sent=1)
    capsys.readouterr()
    assert cli_main(["calls", "--state", "not_sent", "--json", "--ledger", str(ledger)]) == 0
    [call] = json.loads(capsys.readouterr().out)
    assert call["held_usd"] == "0.000000000", call
    assert call["call_id"] in error["message"], error


def test_a_call_admitted_after_an_async_close_stopped_waiting_is_not_sent(
    provider: FakeProvider,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    held_admission: threading.Event,
) -> None:
    """Its admission was still committing when the close stopped waiting: it was sent
    then, after the close had decided to stop."""
    ledger = tmp_path / "l.db"
    url = provider.url + "/v1/chat/completions"

    async def scenario() -> httpx.Response:
        transport = effectguard.AsyncGuardTransport(
            ledger=str(ledger), upstreams={"openai": provider.url}
        )
        client = httpx.AsyncClient(transport=transport)
        assert (await client.post(url, json=CHAT)).status_code == 200
        late = asyncio.ensure_future(client.post(url, json=CHAT, headers={"Idempotency-Key": LATE}))
        await asyncio.wait({late}, timeout=0.2)  # under way: in its admission
        await asyncio.wait_for(transport.aclose(), HANG_BOUND_S)
        assert held_admission.is_set()
        return await asyncio.wait_for(late, HANG_BOUND_S)

    told = asyncio.run(scenario())
    assert len(provider.effects()) == 1
    _not_sent_as_the_close_says(told, capsys, ledger)


def test_a_call_admitted_after_a_sync_close_stopped_waiting_is_not_sent(
    provider: FakeProvider,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    held_admission: threading.Event,
) -> None:
    """The same through the sync transport, its caller in a thread of its own."""
    ledger = tmp_path / "l.db"
    url = provider.url + "/v1/chat/completions"
    transport = effectguard.GuardTransport(ledger=str(ledger), upstreams={"openai": provider.url})
    client = httpx.Client(transport=transport)
    assert client.post(url, json=CHAT).status_code == 200
    told: list[object] = []

    def late() -> None:
        try:
            told.append(client.post(url, json=CHAT, headers={"Idempotency-Key": LATE}))
        except Exception as exc:  # what its caller is told, whatever it is
            told.append(exc)

    caller = threading.Thread(target=late, daemon=True)
    caller.start()
    caller.join(0.2)  # under way: in its admission
    transport.close()
    caller.join(HANG_BOUND_S)
    assert not caller.is_alive(), "its caller still waits on a closed transport"
    assert held_admission.is_set()
    assert len(provider.effects()) == 1
    assert isinstance(told[0], httpx.Response), told
    _not_sent_as_the_close_says(told[0], capsys, ledger)


#: Run in ``serve``: a file made as the call keyed :data:`LATE` enters its admission.
ADMITTING = f"""
import os
from effectguard.ledger import Ledger

_admit = Ledger.admit

async def admit(self, writer, request, *rest):
    if request.idempotency_key == {LATE!r}:
        open(os.environ["EFFECTGUARD_TEST_ADMITTING"], "w").close()
    return await _admit(self, writer, request, *rest)

Ledger.admit = admit
"""


def _until(path: Path) -> None:
    for _ in range(int(HANG_BOUND_S / 0.02)):
        if path.exists():
            return
        threading.Event().wait(0.02)
    raise AssertionError(f"{path} never appeared")


def test_a_request_whose_admission_commits_as_serves_drain_ends_is_not_sent(
    provider: FakeProvider, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``serve``'s SIGTERM drain ends (its ``drain_timeout_s`` made short) while a
    request's admission waits for the ledger's write lock (held here, as another process
    would): the request is cancelled and answered 503 ``shutting_down``; its admission
    completes once the lock is free, and its attempt is recorded ``not_sent``
    (reservation released), never sent. Serve had this right already (the drain cancels
    the request's own task, and a cancelled admission is recorded not sent): held here."""
    site, admitting = tmp_path / "site", tmp_path / "admitting"
    site.mkdir()
    (site / "sitecustomize.py").write_text(ADMITTING)
    (tmp_path / "config.toml").write_text("[server]\ndrain_timeout_s = 1\n")
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONPATH": path, "EFFECTGUARD_TEST_ADMITTING": str(admitting)}
    ledger = tmp_path / "l.db"
    args = ["--config", str(tmp_path / "config.toml")]
    proxy = start_proxy(ledger, upstreams={"openai": provider.url}, args=args, env=env)
    url = proxy.url + "/openai/v1/chat/completions"
    try:
        assert httpx.post(url, json=CHAT, timeout=HANG_BOUND_S).status_code == 200
        lock = sqlite3.connect(ledger, isolation_level=None)
        lock.execute("BEGIN IMMEDIATE")  # the ledger's write lock, as another writer holds it
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            late = pool.submit(
                httpx.post, url, json=CHAT, headers={"Idempotency-Key": LATE}, timeout=HANG_BOUND_S
            )
            _until(admitting)
            proxy.process.send_signal(signal.SIGTERM)
            told = late.result(HANG_BOUND_S)
        lock.execute("ROLLBACK")
        lock.close()
        assert proxy.process.wait(HANG_BOUND_S) == 0
    finally:
        if proxy.process.poll() is None:
            proxy.process.kill()
    assert len(provider.effects()) == 1
    assert told.status_code == 503, told.text
    assert told.json()["error"]["type"] == "shutting_down", told.text
    assert stages_of(capsys, ledger) == Counter(completed=1, not_sent=1)


def test_a_retry_joining_another_workers_call_is_told_the_close_stopped_its_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A declared retry waits for the same call another worker (here a second transport
    on the same ledger) has in flight; the transport it came through closes. Once the
    close stops waiting, the retry is answered 503 ``shutting_down`` naming the call,
    nothing sent by it. It waited on until the ledger had closed under it, then got 503
    ``ledger_unavailable``, which blamed the ledger."""
    monkeypatch.setattr(effectguard.config.defaults, "DRAIN_TIMEOUT_S", 1.0)
    ledger = str(tmp_path / "l.db")

    async def scenario(upstream: HostileSearch) -> tuple[httpx.Response, int]:
        url = upstream.url + "/v1/chat/completions"
        owner = effectguard.AsyncGuardTransport(ledger=ledger, upstreams={"openai": upstream.url})
        other = effectguard.AsyncGuardTransport(ledger=ledger, upstreams={"openai": upstream.url})
        first = asyncio.ensure_future(
            httpx.AsyncClient(transport=owner, timeout=None).post(url, json=CHAT)
        )
        await asyncio.to_thread(_until_sent, upstream)
        retry = {"x-stainless-retry-count": "1"}
        joined = asyncio.ensure_future(
            httpx.AsyncClient(transport=other, timeout=None).post(url, json=CHAT, headers=retry)
        )
        await asyncio.wait({joined}, timeout=0.3)  # waiting for the owner's call
        await asyncio.wait_for(other.aclose(), HANG_BOUND_S)
        told = await asyncio.wait_for(joined, HANG_BOUND_S)
        sent = upstream.hits("/v1/chat/completions")
        await asyncio.wait_for(owner.aclose(), HANG_BOUND_S)
        await asyncio.wait({first}, timeout=HANG_BOUND_S)
        return told, sent

    with hostile_search() as upstream:
        upstream.follow(Script((b"",), ending="hang"))  # reads the request, never answers
        told, sent = asyncio.run(scenario(upstream))
    assert sent == 1
    assert told.status_code == 503, told.text
    error = told.json()["error"]
    assert error["type"] == "shutting_down", error
    assert error["stage"] == "in_flight", error


def _until_sent(upstream: HostileSearch) -> None:
    """Wait (bounded) until a call has reached ``upstream``."""
    for _ in range(int(HANG_BOUND_S / 0.02)):
        if upstream.hits("/v1/chat/completions"):
            return
        threading.Event().wait(0.02)
    raise AssertionError("the call never reached the provider")
