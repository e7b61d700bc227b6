"""Workers, leases and fencing (docs/contract.md §7), with real processes where it matters.

* Two proxies on one ledger: the one holding a call is SIGSTOPped past its
  lease, the other takes it over; after SIGCONT the first one's late result
  is refused by the store, and it registers anew and serves new calls.
* A worker whose lease lapsed starts no new dispatch; if it lapses during the
  guard's own retries after a declared 429 (before the retry is recorded or
  before it is sent), the client gets that 429, and a
  503 ``ledger_unavailable`` only when nothing reached the provider.
* A worker fenced while a call is on the wire registers anew; the call's late
  result is still refused.
* A sweeper on another host waits for the lease; one on the same host takes
  over at once when the dead worker's OS lock is free; the dead worker's late
  result is never recorded as success.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import json
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from fencekit import (
    CHAT,
    UPSTREAM,
    Upstream,
    chat,
    make_runtime,
    stopped_while_held,
    taken_over_mid_call,
)
from observing import ledger_events, wait_for

from effectguard.callpath.recovery import WorkerRuntime, lock_dir_for
from effectguard.callpath.runtime import Runtime
from effectguard.errors import FencedError, Refusal
from effectguard.ops.cli import main as cli_main
from effectguard.ops.verify import verify_ledger
from effectguard.testing import fake_provider
from effectguard.testing.clock import ManualClock

pytestmark = pytest.mark.slow


def cli_ok(*args: str) -> str:
    """Run an ``effectguard`` command in this process; assert exit 0; its stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli_main(list(args))
    assert code == 0, out.getvalue()
    return out.getvalue()


def test_stopped_proxy_is_taken_over_fenced_and_recovers(tmp_path: Path) -> None:
    """SIGSTOP past the lease: the peer takes over; after SIGCONT the stopped proxy's
    late result is refused, nothing of its old registration is written again, and it
    registers anew and serves new calls (it does not answer 503 until restarted)."""
    with (
        fake_provider(tmp_path / "receipts.jsonl") as fake,
        stopped_while_held(
            tmp_path, fake, {"Idempotency-Key": "held", "x-fake-delay": "3"}
        ) as held,
    ):
        ledger, first, second = held.ledger, held.first, held.second
        call_id, worker = held.started["call"], held.started["data"]["worker"]
        takeover = wait_for(
            lambda: [
                e
                for e in ledger_events(ledger)
                if e["kind"] == "worker.taken_over" and e["data"]["worker"] == worker
            ],
            15,
            "the second proxy to take over the stopped one",
        )[0]
        # Not before the lease ran out: the stopped process still holds its lock.
        assert time.monotonic() - held.stopped_at >= 1.0
        assert takeover["data"]["reason"] == "lease expired"
        first.kill(signal.SIGCONT)
        late = held.pending.result(timeout=30)

        # The late result is refused, not recorded as success.
        assert late.status_code == 502, late.text
        assert late.json()["error"]["type"] == "observe_refused"
        assert late.json()["error"]["stage"] == "effect_unknown"
        # Its access line names the call's stage afterwards, as `show` does, not "refused".
        (access,) = wait_for(
            lambda: [
                line.split()
                for line in first.log().splitlines()
                if "event=access" in line and f"call_id={call_id}" in line
            ],
            10,
            "the stopped proxy's access line for the held call",
        )
        assert "stage=effect_unknown" in access and "outcome=fenced" in access, access
        kinds = [e["kind"] for e in ledger_events(ledger) if e["call"] == call_id]
        assert "attempt.observed" not in kinds and "call.completed" not in kinds
        assert kinds.index("attempt.interrupted") > kinds.index("attempt.started")

        # The stopped proxy registers anew by itself and serves new calls again.
        wait_for(
            lambda: httpx.get(first.url + "/healthz", timeout=5).status_code == 200,
            30,
            "the fenced proxy to register anew and report healthy",
        )
        fresh = httpx.post(first.url + "/openai" + CHAT, json=chat("after fencing"), timeout=30)
        assert fresh.status_code == 200, fresh.text
        fresh_id = fresh.headers["effectguard-call-id"]
        after = [e for e in ledger_events(ledger) if e["seq"] > takeover["seq"]]
        # Nothing was written as the fenced registration after its takeover; the
        # new one has its own worker id and a later fencing generation.
        assert all(e["worker"] != worker for e in after), after
        (rejoined,) = [
            e
            for e in after
            if e["kind"] == "worker.registered" and e["data"]["pid"] == first.process.pid
        ]
        assert rejoined["data"]["generation"] > held.started["data"]["generation"]
        (fresh_start,) = [
            e for e in after if e["kind"] == "attempt.started" and e["call"] == fresh_id
        ]
        assert fresh_start["data"]["worker"] == rejoined["data"]["worker"]

        # The held call stays effect unknown: the resend is refused, on either proxy.
        for proxy in (first, second):
            resend = httpx.post(
                proxy.url + "/openai" + CHAT,
                json=chat("held"),
                headers={"Idempotency-Key": "held"},
                timeout=30,
            )
            assert resend.status_code == 409, resend.text
            assert resend.json()["error"]["type"] == "effect_unknown"
        assert len(fake.effects()) == 2
    assert (
        json.loads(cli_ok("calls", "--ledger", str(ledger), "--state", "in_flight", "--json")) == []
    )
    (call,) = json.loads(
        cli_ok("calls", "--ledger", str(ledger), "--state", "effect_unknown", "--json")
    )
    assert call["call_id"] == call_id and call["held_usd"] == call["reserved_usd"]
    cli_ok("verify", "--ledger", str(ledger))


# -- in-process: leases and same-host / other-host takeover ---------------------------


def _request(content: str, key: str | None = None) -> httpx.Request:
    headers = {"Idempotency-Key": key} if key else {}
    return httpx.Request("POST", UPSTREAM + CHAT, json=chat(content), headers=headers)


async def test_lapsed_lease_starts_no_dispatch(tmp_path: Path) -> None:
    """A worker whose lease ran out (no heartbeat) is refused 503 at admission; nothing is sent."""
    clock = ManualClock()
    runtime = make_runtime(
        tmp_path / "l.db", lease_s=60, heartbeat_s=3600, sweep_s=3600, clock=clock
    )
    guard = await runtime.start()
    upstream = Upstream()
    try:
        ok = await guard.handle(guard.providers["openai"], _request("before"), upstream.send)
        assert ok.status_code == 200 and upstream.sent == 1
        clock.advance(61)
        with pytest.raises(Refusal) as refused:
            await guard.handle(guard.providers["openai"], _request("after"), upstream.send)
        assert refused.value.status == 503 and refused.value.type == "ledger_unavailable"
        assert upstream.sent == 1
        calls = await runtime.ledger.calls()
        assert [c.stage for c in calls] == ["completed"]
    finally:
        await runtime.stop()


@dataclass
class Held:
    """A call held in flight upstream by a worker that then 'died'."""

    runtime: Runtime
    upstream: Upstream
    task: asyncio.Task[httpx.Response]
    call_id: str

    async def late_result_is_refused(self) -> None:
        """The dead worker's late result is refused, never recorded as success."""
        self.upstream.release.set()
        with pytest.raises(Refusal) as refused:
            await self.task
        assert refused.value.type == "observe_refused"
        ledger = self.runtime.ledger
        (call,) = await ledger.calls()
        assert call.stage == "effect_unknown" and call.held == call.reserved_at_admission
        kinds = [e.kind for e in await ledger.events(call.call_id)]
        assert "attempt.observed" not in kinds and "call.completed" not in kinds
        assert (await verify_ledger(ledger)).ok


@contextlib.asynccontextmanager
async def dead_worker_call(
    ledger_url: str, clock: ManualClock | None = None
) -> AsyncIterator[Held]:
    """A runtime whose one call is held in flight upstream; its worker then 'dies'
    (heartbeat stopped, OS lock released) while the call is still on the wire."""
    runtime = make_runtime(ledger_url, lease_s=60, heartbeat_s=3600, sweep_s=3600, clock=clock)
    guard = await runtime.start()
    upstream = Upstream(hold=True)
    task = asyncio.ensure_future(
        guard.handle(guard.providers["openai"], _request("held", "k"), upstream.send)
    )
    try:
        while upstream.sent == 0:
            await asyncio.sleep(0.01)
        (call,) = await runtime.ledger.calls()
        assert call.stage == "in_flight"
        assert runtime.worker is not None
        await runtime.worker.stop()
        yield Held(runtime, upstream, task, call.call_id)
    finally:
        upstream.release.set()
        with contextlib.suppress(Exception):
            await task
        await runtime.ledger.store.close()


async def test_other_host_waits_for_the_lease(tmp_path: Path) -> None:
    """A sweeper on another host cannot see the lock: it takes over only after the
    lease, in one transaction with the interruption; the late result is refused."""
    url = str(tmp_path / "l.db")
    clock = ManualClock()
    async with dead_worker_call(url, clock) as held:
        ledger = held.runtime.ledger
        other = WorkerRuntime(
            ledger,
            lock_dir=lock_dir_for(url),
            lease_s=60,
            heartbeat_s=3600,
            sweep_s=3600,
            host="another-host",
        )
        await other.start()  # its start-up sweep: the lease still runs
        try:
            assert (await ledger.call(held.call_id)).stage == "in_flight"
            clock.advance(61)
            assert await other.sweep() == [held.call_id]
            events = await ledger.store.events_after(0, 10_000)
            kinds = [e.kind for e in events]
            at = kinds.index("worker.taken_over")
            # The takeover and the interruption are one operation: adjacent in the chain.
            assert kinds[at + 1 : at + 3] == ["attempt.interrupted", "budget.held"]
            assert events[at].data["reason"] == "lease expired"
            # The store itself now refuses the old worker, whatever it tries to write.
            assert held.runtime.guard is not None
            with pytest.raises(FencedError):
                await ledger.store.write(held.runtime.guard.writer, lambda tx: None)
        finally:
            await other.stop()
        await held.late_result_is_refused()


@pytest.mark.parametrize("form", ["path", "sqlite-url"])
async def test_same_host_takes_over_at_once_when_the_lock_is_free(
    tmp_path: Path, form: str
) -> None:
    """On the same host a free OS lock proves the process gone: no wait for the lease,
    whichever way the SQLite ledger is named (a path or a ``sqlite:///`` URL)."""
    path = str(tmp_path / "l.db")
    url = path if form == "path" else "sqlite:///" + path
    async with dead_worker_call(url) as held:
        ledger = held.runtime.ledger
        heir = WorkerRuntime(
            ledger, lock_dir=lock_dir_for(url), lease_s=60, heartbeat_s=3600, sweep_s=3600
        )
        started = time.monotonic()
        await heir.start()  # the start-up sweep alone takes it over
        try:
            # Far under the 60 s lease: the free lock, not a lapsed lease, decided it.
            assert time.monotonic() - started < 30.0
            assert (await ledger.call(held.call_id)).stage == "effect_unknown"
            events = await ledger.store.events_after(0, 10_000)
            (takeover,) = [e for e in events if e.kind == "worker.taken_over"]
            assert takeover.data["reason"] == "process gone"
        finally:
            await heir.stop()
        await held.late_result_is_refused()


async def test_live_lock_on_the_same_host_is_not_taken_over(tmp_path: Path) -> None:
    """A worker that holds its lock and lease is alive: a sweeper leaves its call alone."""
    runtime = make_runtime(tmp_path / "l.db", lease_s=60, heartbeat_s=3600, sweep_s=3600)
    guard = await runtime.start()
    upstream = Upstream(hold=True)
    task = asyncio.ensure_future(
        guard.handle(guard.providers["openai"], _request("live"), upstream.send)
    )
    peer = WorkerRuntime(
        runtime.ledger,
        lock_dir=lock_dir_for(str(tmp_path / "l.db")),
        lease_s=60,
        heartbeat_s=3600,
        sweep_s=3600,
    )
    try:
        while upstream.sent == 0:
            await asyncio.sleep(0.01)
        await peer.start()
        assert await peer.sweep() == []
        upstream.release.set()
        assert (await task).status_code == 200
        assert [c.stage for c in await runtime.ledger.calls()] == ["completed"]
    finally:
        upstream.release.set()
        with contextlib.suppress(Exception):
            await task
        await peer.stop()
        await runtime.stop()


async def test_a_clock_stepped_past_every_lease_takes_no_live_worker_over(
    tmp_path: Path,
) -> None:
    """The ledger's clock jumps ten minutes forward (NTP, a resumed VM) while a call is on
    the wire. A sweeper on another host then finds the live worker's lease lapsed, but the
    worker has heartbeated since its previous sweep: it is alive, and its call completes.
    (Before, every replica's in-flight calls became effect_unknown at such a step.)"""
    clock = ManualClock()
    runtime = make_runtime(
        tmp_path / "l.db", lease_s=60, heartbeat_s=3600, sweep_s=3600, clock=clock
    )
    guard = await runtime.start()
    assert runtime.worker is not None
    upstream = Upstream(hold=True)
    task = asyncio.ensure_future(
        guard.handle(guard.providers["openai"], _request("live"), upstream.send)
    )
    peer = WorkerRuntime(
        runtime.ledger, lock_dir=None, lease_s=60, heartbeat_s=3600, sweep_s=3600, host="peer"
    )
    try:
        while upstream.sent == 0:
            await asyncio.sleep(0.01)
        await peer.start()  # its start-up sweep sees the worker's lease
        clock.advance(3)
        await runtime.worker.heartbeat()  # the live worker renews it, as every few seconds
        clock.advance(600)  # and the clock steps past that lease
        assert await peer.sweep() == []
        upstream.release.set()
        assert (await task).status_code == 200
        assert [c.stage for c in await runtime.ledger.calls()] == ["completed"]
    finally:
        upstream.release.set()
        with contextlib.suppress(Exception):
            await task
        await peer.stop()
        await runtime.stop()


async def test_fenced_proxy_reports_unhealthy(tmp_path: Path) -> None:
    """A proxy whose worker was taken over refuses every request until its heartbeat
    finds out and it registers anew, so meanwhile ``/healthz`` must not answer 200."""
    from effectguard.config.settings import load_settings
    from effectguard.ingress.server import create_app

    ledger = str(tmp_path / "l.db")
    settings = load_settings(ledger=ledger, upstreams={"openai": UPSTREAM})
    # A lease that lapses long before its first renewal: a config file may not set this
    # (heartbeat_s must be shorter than lease_s), so it is set here directly.
    settings = dataclasses.replace(settings, lease_s=0.3, heartbeat_s=3600, sweep_s=3600)
    app = create_app(settings, inner=httpx.MockTransport(lambda r: httpx.Response(500)))
    await app.startup()
    peer = WorkerRuntime(
        app.runtime.ledger,
        lock_dir=lock_dir_for(ledger),
        lease_s=60,
        heartbeat_s=3600,
        sweep_s=3600,
    )
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://proxy"
        ) as client:
            assert (await client.get("/healthz")).status_code == 200
            await asyncio.sleep(0.5)  # the lease lapses; nothing renews it
            await peer.start()  # its start-up sweep sees the lapsed lease
            await peer.sweep()  # and, seeing it unrenewed a sweep later, takes it over
            refused = await client.post("/openai" + CHAT, json=chat("fenced"))
            assert refused.status_code == 503
            assert (await client.get("/healthz")).status_code == 503
    finally:
        await peer.stop()
        await app.shutdown()


async def test_fenced_worker_registers_anew_and_its_old_calls_stay_refused(tmp_path: Path) -> None:
    """A worker fenced while a call is on the wire registers anew on its next heartbeat;
    that call's late result is still written as the old registration and refused, even
    before the takeover marked the call, and new calls are admitted as the new one."""
    runtime = make_runtime(tmp_path / "l.db", lease_s=60, heartbeat_s=0.05, sweep_s=3600)
    guard = await runtime.start()
    openai = guard.providers["openai"]
    held = Upstream(hold=True)
    try:
        # A peer's takeover that has fenced the worker but not yet marked its call (a
        # sweep that cannot commit as one transaction marks the calls one by one later).
        async with taken_over_mid_call(
            runtime, guard, _request("held", "k"), held, interrupt_calls=False
        ) as (task, old):
            deadline = time.monotonic() + 10
            while guard.writer == old:
                assert time.monotonic() < deadline, "the fenced worker did not register anew"
                await asyncio.sleep(0.01)
            new = guard.writer
            assert new.worker != old.worker and new.generation > old.generation
            with pytest.raises(FencedError):
                await runtime.ledger.store.write(old, lambda tx: None)
            (call,) = await runtime.ledger.calls()
            assert call.stage == "in_flight"

            held.release.set()
            with pytest.raises(Refusal) as refused:
                await task
            assert refused.value.status == 502 and refused.value.type == "observe_refused"
            assert (await runtime.ledger.call(call.call_id)).stage == "in_flight"
            assert runtime.worker is not None
            assert await runtime.worker.sweep() == [call.call_id]  # now the call is marked

            fresh = await guard.handle(openai, _request("fresh"), Upstream().send)
            assert fresh.status_code == 200
            fresh_id = fresh.headers["effectguard-call-id"]
            events = await runtime.ledger.events(fresh_id)
            started = [e for e in events if e.kind == "attempt.started"]
            assert [(e.worker, e.generation) for e in started] == [(new.worker, new.generation)]
            stages = {c.call_id: c.stage for c in await runtime.ledger.calls()}
            assert stages == {call.call_id: "effect_unknown", fresh_id: "completed"}
            assert (await verify_ledger(runtime.ledger)).ok
    finally:
        await runtime.stop()


class LapsingUpstream:
    """Answers each request as told, letting the worker's lease lapse after the first."""

    def __init__(
        self, clock: ManualClock, first: httpx.Response | Exception, by: float = 61
    ) -> None:
        self.clock = clock
        self.first = first
        self.by = by
        self.sent = 0

    async def send(self, request: httpx.Request) -> httpx.Response:
        self.sent += 1
        self.clock.advance(self.by)  # past the lease (61): no later attempt may start
        if isinstance(self.first, Exception):
            raise self.first
        return self.first


async def test_lease_lapsing_between_retries_answers_the_providers_429(tmp_path: Path) -> None:
    """A lease that lapses during the guard's own retries after a declared 429 answers
    that 429 (the provider was reached), never 503 ledger_unavailable ("nothing sent")."""
    clock = ManualClock()
    runtime = make_runtime(
        tmp_path / "l.db", lease_s=60, heartbeat_s=3600, sweep_s=3600, clock=clock
    )
    guard = await runtime.start()
    body = {"error": {"type": "rate_limit_exceeded", "message": "slow down"}}
    limited = httpx.Response(
        429,
        headers={"content-type": "application/json"},
        stream=httpx.ByteStream(json.dumps(body).encode()),
    )
    upstream = LapsingUpstream(clock, limited)
    try:
        answer = await guard.handle(guard.providers["openai"], _request("limited"), upstream.send)
        await answer.aread()  # a transport's answer: its client reads it
        assert answer.status_code == 429 and answer.json() == body
        assert upstream.sent == 1
        (call,) = await runtime.ledger.calls()
        assert answer.headers["effectguard-call-id"] == call.call_id
        assert (call.stage, call.attempts, call.reserved) == ("not_processed", 1, 0)
        assert (await verify_ledger(runtime.ledger)).ok
    finally:
        await runtime.stop()


def _limited() -> tuple[httpx.Response, dict[str, object]]:
    body: dict[str, object] = {"error": {"type": "rate_limit_exceeded", "message": "slow down"}}
    limited = httpx.Response(
        429,
        headers={"content-type": "application/json"},
        stream=httpx.ByteStream(json.dumps(body).encode()),
    )
    return limited, body


async def test_lease_lapsing_before_the_retry_is_sent_answers_the_providers_429(
    tmp_path: Path,
) -> None:
    """A retry after a declared 429 that is recorded but not sent because the lease lapsed
    just then answers that 429 (the provider was reached), never 503 ledger_unavailable."""
    clock = ManualClock()
    runtime = make_runtime(
        tmp_path / "l.db", lease_s=60, heartbeat_s=3600, sweep_s=3600, clock=clock
    )
    guard = await runtime.start()
    limited, body = _limited()
    # To the lease's last instant: the ledger still starts the retry (its lease has not
    # run out), with no time left to send it in.
    upstream = LapsingUpstream(clock, limited, by=60)
    try:
        answer = await guard.handle(guard.providers["openai"], _request("limited"), upstream.send)
        await answer.aread()
        assert answer.status_code == 429 and answer.json() == body
        assert upstream.sent == 1
        (call,) = await runtime.ledger.calls()
        assert answer.headers["effectguard-call-id"] == call.call_id
        assert (call.stage, call.attempts, call.reserved) == ("not_sent", 2, 0)
        events = [e for e in ledger_events(tmp_path / "l.db") if e["call"] == call.call_id]
        assert [e["kind"] for e in events][-2:] == ["attempt.not_sent", "budget.released"]
        assert "lease lapsed" in events[-2]["data"]["reason"]
        assert (await verify_ledger(runtime.ledger)).ok
    finally:
        await runtime.stop()


async def test_lease_lapsing_after_a_not_sent_attempt_stays_503(tmp_path: Path) -> None:
    """When nothing reached the provider (connect error) and the retry cannot start,
    the answer is 503 ledger_unavailable: then it is true that nothing was sent."""
    clock = ManualClock()
    runtime = make_runtime(
        tmp_path / "l.db", lease_s=60, heartbeat_s=3600, sweep_s=3600, clock=clock
    )
    guard = await runtime.start()
    upstream = LapsingUpstream(clock, httpx.ConnectError("refused"))
    try:
        with pytest.raises(Refusal) as refused:
            await guard.handle(guard.providers["openai"], _request("unreached"), upstream.send)
        assert (refused.value.status, refused.value.type) == (503, "ledger_unavailable")
        assert refused.value.retryable  # x-should-retry: true, as every such 503 says
        assert upstream.sent == 1
        (call,) = await runtime.ledger.calls()
        assert (call.stage, call.attempts, call.reserved) == ("not_sent", 1, 0)
        assert (await verify_ledger(runtime.ledger)).ok
    finally:
        await runtime.stop()
