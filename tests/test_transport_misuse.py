# ruff: noqa: F811  (the provider fixture is imported by name and used as an argument)
"""The transports under careless use, with the real openai SDK and the real fake provider
(its receipt log counts what reached it):

* a sync stream dropped half-read without ``close()``, left to the garbage collector:
  the collector may finalize it on the transport's own loop thread, where closing it
  once waited on that loop from inside it and hung every later request; and streams
  dropped that way were booked ``effect_unknown`` though the provider sent them whole;
* an async stream dropped the same way is read to its end and settled ``completed``;
* a caller cancelled while its admission commits: the call it started is recorded as
  never sent (resendable at once), not left in flight until a restart marks it unknown;
* using a sync transport after ``close()`` is a clear error, never a hang;
* a stream dropped before it was read at all is settled by the collector too;
* Ctrl-C in the sync client cancels a call not yet sent, as an async cancellation does;
* a sync transport made before a fork, unused until then, works in the child;
* a stream finalized after its client closed the transport closes quietly.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import sqlite3
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transportkit import provider, stages_of  # noqa: F401  (a fixture, used by name)

import effectguard
from effectguard.ops.cli import main as cli_main
from effectguard.testing import FakeProvider

pytestmark = pytest.mark.slow

#: A bound on waiting for background settlement, not a timing claim.
SETTLE_BOUND_S = 30.0


def _verified(capsys: pytest.CaptureFixture[str], ledger: Path) -> bool:
    capsys.readouterr()
    return cli_main(["verify", "--ledger", str(ledger)]) == 0


def _message(n: int) -> list[Any]:
    return [{"role": "user", "content": f"hello {n}"}]


def _async_client(
    ledger: Path, provider: FakeProvider
) -> tuple[effectguard.AsyncGuardTransport, openai.AsyncOpenAI]:
    """An AsyncGuardTransport on ``ledger`` to the fake provider, and the SDK around it."""
    transport = effectguard.AsyncGuardTransport(
        ledger=str(ledger), upstreams={"openai": provider.url}
    )
    client = openai.AsyncOpenAI(
        base_url=provider.url + "/v1",
        api_key="sk-test",
        max_retries=0,
        http_client=httpx.AsyncClient(transport=transport),
    )
    return transport, client


async def _settled(transport: effectguard.AsyncGuardTransport) -> Counter[str]:
    """The calls' stages once none is in flight (or after :data:`SETTLE_BOUND_S`)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE_BOUND_S
    while True:
        stages = Counter(c.stage for c in await transport.ledger.calls())
        if not stages["in_flight"] or loop.time() > deadline:
            return stages
        await asyncio.sleep(0.05)


def test_sync_streams_dropped_unclosed_never_hang_and_settle_completed(
    provider: FakeProvider, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ledger = tmp_path / "ledger.db"
    client = _sync_client(ledger, provider)
    done: list[int] = []

    def drop_streams() -> None:
        for n in range(12):
            stream = client.chat.completions.create(
                model="gpt-4o-mini", messages=_message(n), stream=True
            )
            for _ in stream:
                break  # dropped half-read: no close()
            del stream
            done.append(n)

    worker = threading.Thread(target=drop_streams, daemon=True)
    worker.start()
    worker.join(60)  # a bound on a hang, not a timing claim
    assert not worker.is_alive(), f"hung after {len(done)} dropped streams"
    gc.collect()
    client.close()  # closes the transport, which reads to their end the streams left open
    assert len(provider.effects()) == 12
    assert stages_of(capsys, ledger) == Counter(completed=12)
    assert _verified(capsys, ledger)
    with pytest.raises(RuntimeError, match="closed"):
        client.chat.completions.create(model="gpt-4o-mini", messages=_message(99))
    assert len(provider.effects()) == 12


def test_a_stream_collected_while_its_thread_hands_in_a_call_never_hangs(
    provider: FakeProvider,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The collector runs at any allocation, in the middle of the transport's own code
    too: here, while the thread that dropped a stream hands its next call to the loop.
    The stream's close, run by the collector on that thread, once waited for the lock
    that thread held, and the thread hung for ever."""
    ledger = tmp_path / "ledger.db"
    client = _sync_client(ledger, provider)
    handing_in = asyncio.run_coroutine_threadsafe

    def collect_then_hand_in(coro: Any, loop: asyncio.AbstractEventLoop) -> Any:
        gc.collect()  # where an allocation could have started it
        return handing_in(coro, loop)

    def drop_then_call() -> None:
        stream = client.chat.completions.create(
            model="gpt-4o-mini", messages=_message(0), stream=True
        )
        for _ in stream:
            break  # dropped half-read: no close(); the SDK's stream is a cycle
        del stream
        monkeypatch.setattr(asyncio, "run_coroutine_threadsafe", collect_then_hand_in)
        client.chat.completions.create(model="gpt-4o-mini", messages=_message(1))

    gc.disable()  # the collector runs where this test says, not before
    try:
        worker = threading.Thread(target=drop_then_call, daemon=True)
        worker.start()
        worker.join(30)  # a bound on a hang, not a timing claim
    finally:
        gc.enable()
        monkeypatch.undo()
    assert not worker.is_alive(), "the thread hung on its own lock"
    client.close()
    assert len(provider.effects()) == 2
    assert stages_of(capsys, ledger) == Counter(completed=2)


def test_async_streams_dropped_unclosed_settle_completed(
    provider: FakeProvider, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ledger = tmp_path / "ledger.db"

    async def run() -> list[int]:
        transport, client = _async_client(ledger, provider)

        async def drop(n: int) -> None:
            stream = await client.chat.completions.create(
                model="gpt-4o-mini",
                messages=_message(n),
                stream=True,
                extra_headers={"idempotency-key": f"drop-{n}"},
            )
            async for _ in stream:
                break  # dropped half-read: no close()

        await asyncio.gather(*(drop(n) for n in range(10)))
        gc.collect()
        await _settled(transport)
        # A resend of a dropped call's key gets its recorded answer, not a second effect.
        resends = []
        for n in range(10):
            again = await client.chat.completions.with_raw_response.create(
                model="gpt-4o-mini",
                messages=_message(n),
                stream=True,
                extra_headers={"idempotency-key": f"drop-{n}"},
            )
            resends.append(again.status_code)
            await again.http_response.aclose()
        await transport.aclose()
        return resends

    resends = asyncio.run(run())
    assert resends == [200] * 10
    assert len(provider.effects()) == 10
    assert stages_of(capsys, ledger) == Counter(completed=10)
    assert _verified(capsys, ledger)


def test_a_caller_cancelled_during_admission_leaves_its_call_not_sent(
    provider: FakeProvider, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ledger = tmp_path / "ledger.db"

    async def run() -> tuple[Counter[str], list[str]]:
        transport, client = _async_client(ledger, provider)

        async def call(n: int) -> str:
            await client.chat.completions.create(
                model="gpt-4o-mini",
                messages=_message(n),
                extra_headers={"idempotency-key": f"cancel-{n}"},
            )
            return "answered"

        await call(-1)  # warm: the transport has started

        async def cancelled(n: int) -> str:
            try:
                return await asyncio.wait_for(call(n), 0.001)
            except TimeoutError:
                return "cancelled"

        first = Counter(await asyncio.gather(*(cancelled(n) for n in range(40))))
        # Each call settles by itself (sent and answered, or recorded as never sent);
        # none is left in flight while the transport runs.
        stages = await _settled(transport)
        again = [await call(n) for n in range(40)]  # every key resends at once
        await transport.aclose()
        assert first["cancelled"] > 0, first
        return stages, again

    stages, again = asyncio.run(run())
    assert stages["in_flight"] == 0, stages
    assert set(stages) <= {"completed", "not_sent"}, stages
    assert again == ["answered"] * 40
    assert len(provider.effects()) == 41  # the warm call and each key once
    assert _verified(capsys, ledger)


def test_an_async_transport_refuses_a_second_event_loop(
    provider: FakeProvider, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its heartbeat and background settlements live on the loop it started on: while
    that loop runs (on another thread), a call from another loop is refused before
    anything is recorded or sent, with a message naming the cause. After ``aclose()`` it
    may be used again. (A loop that has ended, a script's earlier ``asyncio.run``, does
    not hold it: tests/test_transport_loops.py.)"""
    ledger = tmp_path / "ledger.db"
    first, first_client = _async_client(ledger, provider)
    closing, closing_client = _async_client(ledger, provider)

    async def call(client: openai.AsyncOpenAI, n: int) -> Any:
        return await client.chat.completions.create(model="gpt-4o-mini", messages=_message(n))

    running = asyncio.new_event_loop()
    thread = threading.Thread(target=running.run_forever, daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(call(first_client, 0), running).result(SETTLE_BOUND_S)
        with pytest.raises(RuntimeError, match="another running event loop"):
            asyncio.run(call(first_client, 1))
        asyncio.run_coroutine_threadsafe(first.aclose(), running).result(SETTLE_BOUND_S)
    finally:
        running.call_soon_threadsafe(running.stop)
        thread.join(SETTLE_BOUND_S)

    async def call_then_close(n: int) -> None:  # closed in the loop that used it
        await call(closing_client, n)
        await closing.aclose()

    # As httpx's own transports: used again after aclose(), it starts again, on the
    # same loop or on the next one.
    asyncio.run(call_then_close(2))
    asyncio.run(call_then_close(3))
    asyncio.run(call_then_close(4))
    assert len(provider.effects()) == 4
    assert stages_of(capsys, ledger) == Counter(completed=4)


def test_closing_an_async_transport_lets_its_calls_in_flight_finish(
    provider: FakeProvider, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``aclose()`` with calls on their way waits for them (up to its drain timeout):
    answers are recorded, not turned into effect_unknown under a closed ledger. A stream
    nobody read by then is read to its end in the background, and its reader is told to
    resend for the answer instead of getting a stream that just stops."""
    ledger = tmp_path / "ledger.db"

    async def run() -> list[str]:
        transport, client = _async_client(ledger, provider)

        async def call(n: int) -> str:
            answer = await client.chat.completions.create(
                model="gpt-4o-mini",
                messages=_message(n),
                stream=n % 2 == 1,
                extra_headers={"idempotency-key": f"close-{n}", "x-fake-behaviour": "delay=1"},
            )
            if isinstance(answer, openai.AsyncStream):
                await asyncio.sleep(2)  # read only after the transport closed
                try:
                    async for _ in answer:
                        pass
                except openai.APIConnectionError as exc:
                    return "resend" if "resend it" in str(exc.__cause__) else repr(exc)
                return "stream read after close"
            return "answered"

        calls = [asyncio.ensure_future(call(n)) for n in range(4)]
        await asyncio.sleep(0.3)  # all four on their way
        await transport.aclose()
        return list(await asyncio.gather(*calls))

    assert asyncio.run(run()) == ["answered", "resend", "answered", "resend"]
    assert len(provider.effects()) == 4
    assert stages_of(capsys, ledger) == Counter(completed=4)
    assert _verified(capsys, ledger)


def _sync_client(ledger: Path, provider: FakeProvider) -> openai.OpenAI:
    """An OpenAI client over a GuardTransport on ``ledger`` to the fake provider."""
    transport = effectguard.GuardTransport(ledger=str(ledger), upstreams={"openai": provider.url})
    return openai.OpenAI(
        base_url=provider.url + "/v1",
        api_key="sk-test",
        max_retries=0,
        http_client=httpx.Client(transport=transport),
    )


def _settled_stages(capsys: pytest.CaptureFixture[str], ledger: Path) -> Counter[str]:
    """The calls' stages, read from another connection, once none is in flight (or after
    :data:`SETTLE_BOUND_S`), while the transport that writes them still runs."""
    deadline = time.monotonic() + SETTLE_BOUND_S
    while (stages := stages_of(capsys, ledger))["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return stages


def test_streams_dropped_unread_settle_while_their_transport_runs(
    provider: FakeProvider, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A stream the caller never iterates (an exception between ``create`` and the loop, a
    handler that returns early) and then drops is settled once the collector finalizes
    it, sync and async, without closing the transport. Nothing was ever finalized for it:
    the call stayed in flight, its upstream connection held, until the transport closed
    (or, in a program that exited first, was booked effect_unknown by the next start)."""
    ledger = tmp_path / "ledger.db"
    client = _sync_client(ledger, provider)
    for n in range(3):
        stream = client.chat.completions.create(
            model="gpt-4o-mini", messages=_message(n), stream=True
        )
        del stream  # never read, never closed
    gc.collect()
    assert _settled_stages(capsys, ledger) == Counter(completed=3)

    async def run() -> Counter[str]:
        transport, aclient = _async_client(ledger, provider)
        for n in range(3, 6):
            stream = await aclient.chat.completions.create(
                model="gpt-4o-mini", messages=_message(n), stream=True
            )
            del stream
        gc.collect()
        stages = await _settled(transport)
        await transport.aclose()
        return stages

    assert asyncio.run(run()) == Counter(completed=6)
    client.close()
    assert len(provider.effects()) == 6
    assert _verified(capsys, ledger)


def test_an_interrupt_before_the_call_is_sent_sends_nothing(
    provider: FakeProvider,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    default_sigint: None,
) -> None:
    """Ctrl-C (KeyboardInterrupt) while the sync transport waits to admit a call cancels
    it, as a cancelled async caller is: its attempt is recorded as never sent, and nothing
    reaches the provider. The portal's coroutine used to run on, and the call the user had
    stopped went out once the ledger let it in."""
    ledger = tmp_path / "ledger.db"
    client = _sync_client(ledger, provider)
    client.chat.completions.create(model="gpt-4o-mini", messages=_message(0))  # started
    main = threading.main_thread().ident
    assert main is not None and threading.current_thread() is threading.main_thread()
    blocker = sqlite3.connect(ledger, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # the admission waits for the write lock
    interrupt = threading.Timer(0.3, signal.pthread_kill, (main, signal.SIGINT))
    interrupt.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            client.chat.completions.create(model="gpt-4o-mini", messages=_message(1))
    finally:
        interrupt.join()
        blocker.execute("ROLLBACK")
        blocker.close()
    stages = _settled_stages(capsys, ledger)
    client.close()
    assert len(provider.effects()) == 1  # the first call only
    assert stages["completed"] == 1 and set(stages) <= {"completed", "not_sent"}, stages
    assert _verified(capsys, ledger)


def test_a_sync_transport_made_before_a_fork_serves_the_child(
    provider: FakeProvider, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A client built at import, then forked into workers before its first call (gunicorn
    ``--preload``, a prefork pool): each child's calls work and are recorded. The
    transport's loop thread started when it was made, did not come along, and every call
    in a child was refused as if the transport had been used before the fork."""
    ledger = tmp_path / "ledger.db"
    client = _sync_client(ledger, provider)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        status = 1
        try:
            answer = client.chat.completions.create(model="gpt-4o-mini", messages=_message(1))
            client.close()
            os.write(write_end, answer.choices[0].message.content.encode()[:20] or b"?")
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(read_end, "rb") as child:
        assert os.waitstatus_to_exitcode(status) == 0 and child.read()
    client.chat.completions.create(model="gpt-4o-mini", messages=_message(2))  # the parent's
    client.close()
    assert len(provider.effects()) == 2
    assert stages_of(capsys, ledger) == Counter(completed=2)
    assert _verified(capsys, ledger)


def test_a_stream_finalized_after_its_client_closed_is_quiet(
    provider: FakeProvider, tmp_path: Path
) -> None:
    """``for chunk in stream: break`` inside ``with OpenAI(...)``: the client closes its
    transport first (which settles the stream), and the SDK's generator is finalized
    afterwards. Its close used to raise "this GuardTransport is closed" from the
    collector, one "Exception ignored" traceback on stderr per stream."""
    unraisable: list[Any] = []
    hook = sys.unraisablehook
    sys.unraisablehook = unraisable.append
    try:
        with _sync_client(tmp_path / "ledger.db", provider) as client:
            stream = client.chat.completions.create(
                model="gpt-4o-mini", messages=_message(0), stream=True
            )
            for _ in stream:
                break
        del stream
        gc.collect()
    finally:
        sys.unraisablehook = hook
    assert [repr(u.exc_value) for u in unraisable] == []
    assert len(provider.effects()) == 1


def _registered(ledger: Path) -> int:
    """How many workers ``ledger`` has registered, read beside the transport writing it."""
    if not ledger.exists():
        return 0
    with contextlib.closing(sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)) as db:
        try:
            return int(db.execute("SELECT count(*) FROM workers").fetchone()[0])
        except sqlite3.OperationalError:  # not created yet
            return 0


def test_callers_cancelled_while_the_transport_starts_leave_one_start(
    provider: FakeProvider, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """First callers that go away while the transport starts (short timeouts at program
    start) stop only their own wait: the start goes on, once, and serves the next call
    under one worker registration. Each cancelled caller used to cancel the start the
    others waited on, so each started it again, registering a worker every time, and a
    crowd of short timeouts could keep the transport from ever starting."""
    ledger = tmp_path / "ledger.db"

    async def run() -> int:
        transport, client = _async_client(ledger, provider)
        callers = [
            asyncio.ensure_future(
                client.chat.completions.create(model="gpt-4o-mini", messages=_message(n))
            )
            for n in range(5)
        ]
        while not _registered(ledger):  # the start is under way: it registered a worker
            await asyncio.sleep(0.001)
        for caller in callers:
            caller.cancel()
        await asyncio.gather(*callers, return_exceptions=True)
        await client.chat.completions.create(model="gpt-4o-mini", messages=_message(9))
        workers = len(await transport.ledger.store.workers())
        await transport.aclose()
        return workers

    assert asyncio.run(run()) == 1
    assert len(provider.effects()) == 1
    assert stages_of(capsys, ledger) == Counter(completed=1)
    assert _verified(capsys, ledger)


def test_a_sync_client_shared_by_more_threads_than_connections_never_stalls(
    provider: FakeProvider, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """200 threads share one sync client, twice the inner transport's 100 pooled
    connections, three calls each: every call is answered. Sends and body reads shared one
    pool of 100 threads; the second hundred sends took every thread waiting for a connection,
    while
    the answers holding the connections needed a thread to be read to their end and give
    them back, so every call waited for its pool timeout (the SDK's: 10 minutes)."""
    ledger = tmp_path / "ledger.db"
    client = _sync_client(ledger, provider)
    threads = 200
    start = threading.Barrier(threads)
    answered: list[int] = []

    def call(n: int) -> None:
        start.wait()
        for k in range(3):  # streamed and not: a stream holds its connection while read
            with contextlib.suppress(openai.APIError):  # an answer, if an error one (below)
                answer = client.chat.completions.create(
                    model="gpt-4o-mini", messages=_message(3 * n + k), stream=k == 1
                )
                if isinstance(answer, openai.Stream):
                    for _ in answer:
                        pass
        answered.append(n)

    callers = [threading.Thread(target=call, args=(n,), daemon=True) for n in range(threads)]
    for caller in callers:
        caller.start()
    deadline = time.monotonic() + 90  # a bound on a stall, not a timing claim
    for caller in callers:
        caller.join(max(0.0, deadline - time.monotonic()))
    assert len(answered) == threads, f"{threads - len(answered)} calls still waiting"
    client.close()
    effects = len(provider.effects())
    stages = stages_of(capsys, ledger)
    # httpcore's sync pool may close a connection it had just handed to a waiting request
    # (encode/httpcore#1110): a call whose request then failed before it went out reached
    # no provider and is booked so; one that failed after it went out ends effect_unknown.
    # Every call is booked, none is left in flight, and none reached the provider twice.
    assert sum(stages.values()) == 3 * threads and not stages["in_flight"], stages
    assert stages["completed"] <= effects <= stages["completed"] + stages["effect_unknown"]
    assert _verified(capsys, ledger)
