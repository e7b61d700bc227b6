# ruff: noqa: F811  (the provider fixture is imported by name and used as an argument)
"""Closing a transport while it is in use, with the real fake provider (its receipt log
counts what reached it) and real threads and tasks (docs/contract.md §1.2, §3.8):

* calls made while a sync transport closes get the closed-transport ``RuntimeError``,
  nothing sent, or are let finish and recorded; none hangs;
* two threads closing one shared sync transport at once both return;
* calls made while an async transport closes are refused, the calls under way finish
  and are recorded, and the close does not start the transport again under itself;
* a call still under way when the close stops waiting (a stream still read, an answer
  not come) is marked ``effect_unknown`` for the close, and a caller still waiting told.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import httpx
import openai
import pytest
from hostilekit import HostileSearch, Script, hostile_search, slow_chat_stream
from transportkit import provider, stages_of  # noqa: F401  (a fixture, used by name)

import effectguard
import effectguard.config.defaults
import effectguard.ingress.transport
from effectguard.ops.cli import main as cli_main
from effectguard.testing import FakeProvider

pytestmark = pytest.mark.slow

CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}

#: A bound on a hang, not a timing claim: a close drains its calls for at most 30 s.
HANG_BOUND_S = 60.0


def _registered(ledger: Path) -> int:
    """How many worker registrations ``ledger`` holds."""
    with contextlib.closing(sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)) as db:
        return int(db.execute("SELECT count(*) FROM workers").fetchone()[0])


def _request(provider: FakeProvider) -> httpx.Request:
    return httpx.Request("POST", provider.url + "/v1/chat/completions", json=CHAT)


def _outcome(call: object) -> str:
    """A call's result as a short label: its status, or its exception's type and cause."""
    if isinstance(call, httpx.Response):
        return str(call.status_code)
    assert isinstance(call, BaseException)
    return "closed" if isinstance(call, RuntimeError) and "closed" in str(call) else repr(call)


def _close_while_calling(
    transport: effectguard.GuardTransport, provider: FakeProvider
) -> Counter[str]:
    """Eight threads call until refused; a ninth closes once they are under way."""
    outcomes: Counter[str] = Counter()

    def call() -> None:
        while True:
            try:
                label = _outcome(transport.handle_request(_request(provider)))
            except Exception as exc:
                label = _outcome(exc)
            outcomes[label] += 1
            if label != "200":  # refused: the close has begun
                return

    callers = [threading.Thread(target=call, daemon=True) for _ in range(8)]
    for caller in callers:
        caller.start()
    while outcomes["200"] < 20:  # the callers are under way
        threading.Event().wait(0.01)
    closer = threading.Thread(target=transport.close, daemon=True)
    closer.start()
    for thread in [closer, *callers]:
        thread.join(HANG_BOUND_S)
    assert not any(t.is_alive() for t in [closer, *callers]), "a call or the close hung"
    return outcomes


def test_calls_made_while_a_sync_transport_closes_never_hang(
    provider: FakeProvider, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Eight threads keep calling while a ninth closes the transport: every call is
    answered and recorded completed, or refused with the closed-transport error and
    never sent. Calls kept arriving until the loop stopped: some waited for ever on a
    loop that no longer ran, others met an executor or a ledger already closed (502 for
    an answer the provider sent, then ``effect_unknown``)."""
    ledger = tmp_path / "ledger.db"
    outcomes: Counter[str] = Counter()
    for _ in range(3):
        transport = effectguard.GuardTransport(
            ledger=str(ledger), upstreams={"openai": provider.url}
        )
        outcomes += _close_while_calling(transport, provider)
    assert set(outcomes) == {"200", "closed"}, outcomes
    assert stages_of(capsys, ledger) == Counter(completed=outcomes["200"])
    assert len(provider.effects()) == outcomes["200"]


def _close_together(clients: list[httpx.Client]) -> list[Exception]:
    """Close ``clients`` from a thread each at the same moment; what the closes raised."""
    together = threading.Barrier(len(clients))
    errors: list[Exception] = []

    def close(client: httpx.Client) -> None:
        together.wait()
        try:
            client.close()
        except Exception as exc:
            errors.append(exc)

    closers = [threading.Thread(target=close, args=(c,), daemon=True) for c in clients]
    for closer in closers:
        closer.start()
    for closer in closers:
        closer.join(HANG_BOUND_S)
    assert not any(c.is_alive() for c in closers), "a close hung"
    return errors


def test_two_threads_closing_one_shared_sync_transport_both_return(
    provider: FakeProvider, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two clients share a GuardTransport and close it at the same moment from two
    threads: both closes return without an error and the transport is closed. The second
    close used to run the close again on a loop the first was stopping: it hung, or raised
    "Event loop is closed", an AttributeError or a ValueError."""
    ledger = tmp_path / "ledger.db"
    for _ in range(4):
        transport = effectguard.GuardTransport(
            ledger=str(ledger), upstreams={"openai": provider.url}
        )
        clients = [httpx.Client(transport=transport, base_url=provider.url) for _ in range(2)]
        assert clients[0].post("/v1/chat/completions", json=CHAT).status_code == 200
        assert _close_together(clients) == []
        transport.close()  # a later close returns at once
        with pytest.raises(RuntimeError, match="closed"):
            transport.handle_request(_request(provider))
    assert stages_of(capsys, ledger) == Counter(completed=4)
    assert len(provider.effects()) == 4


def test_calls_made_while_an_async_transport_closes_are_refused_not_restarted(
    provider: FakeProvider, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Eight tasks keep calling while a ninth runs ``aclose()``: a call made during the
    close is refused (``RuntimeError``, nothing sent), the calls under way finish and are
    recorded completed, and the close leaves one worker registration behind. Calls during
    the close used to start the guard again under it (a second registration, running
    after ``aclose()`` returned), or meet the closed ledger: 502 for an answer the
    provider sent, then ``effect_unknown``."""
    ledger = tmp_path / "ledger.db"

    async def run() -> Counter[str]:
        transport = effectguard.AsyncGuardTransport(
            ledger=str(ledger), upstreams={"openai": provider.url}
        )
        outcomes: Counter[str] = Counter()

        async def call() -> None:
            while True:
                try:
                    answer = await asyncio.wait_for(
                        transport.handle_async_request(_request(provider)), HANG_BOUND_S
                    )
                    label = _outcome(answer)
                except Exception as exc:
                    label = "closing" if "closing" in str(exc) else repr(exc)
                outcomes[label] += 1
                if label != "200":
                    return

        callers = [asyncio.ensure_future(call()) for _ in range(8)]
        while outcomes["200"] < 20:  # the callers are under way
            await asyncio.sleep(0.01)
        await asyncio.wait_for(transport.aclose(), HANG_BOUND_S)
        await asyncio.wait_for(asyncio.gather(*callers), HANG_BOUND_S)
        return outcomes

    outcomes = asyncio.run(run())
    assert set(outcomes) == {"200", "closing"}, outcomes
    assert stages_of(capsys, ledger) == Counter(completed=outcomes["200"])
    assert len(provider.effects()) == outcomes["200"]
    assert _registered(ledger) == 1


class _Recording(httpx.HTTPTransport):
    """An inner transport that notes its close."""

    closes = 0

    def close(self) -> None:
        self.closes += 1
        super().close()


def test_closing_an_unused_sync_transport_closes_its_inner_once(tmp_path: Path) -> None:
    """A GuardTransport closed before its first call (twice, as two clients sharing it
    would) still closes the transport it wraps, once, and refuses calls afterwards."""
    inner = _Recording()
    transport = effectguard.GuardTransport(inner, ledger=str(tmp_path / "ledger.db"))
    transport.close()
    transport.close()
    assert inner.closes == 1
    with pytest.raises(RuntimeError, match="closed"):
        transport.handle_request(httpx.Request("GET", "http://127.0.0.1:9/"))


def test_a_stream_still_read_when_a_close_stops_waiting_is_marked_not_left_in_flight(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A close waits for a stream under way up to 30 s; one whose provider is still
    sending then is marked ``effect_unknown`` (its key answers 409 ``effect_unknown``,
    to be reconciled), not left in flight under a closed ledger, where its key answered
    409 ``in_progress`` until another worker's sweep came by. Its reader is told so."""
    ledger = tmp_path / "l.db"
    monkeypatch.setattr(effectguard.config.defaults, "DRAIN_TIMEOUT_S", SHORT_DRAIN_S)

    async def scenario(upstream: str) -> str:
        transport = effectguard.AsyncGuardTransport(
            ledger=str(ledger), upstreams={"openai": upstream}
        )
        client = openai.AsyncOpenAI(
            base_url=upstream + "/v1",
            api_key="sk-test",
            max_retries=0,
            http_client=httpx.AsyncClient(transport=transport),
        )
        stream = await client.chat.completions.create(**CHAT, stream=True)
        reader = asyncio.ensure_future(_read_all(stream))
        await asyncio.sleep(1)  # under way: its first events have come
        await transport.aclose()
        return await reader

    with hostile_search() as upstream:
        upstream.follow(slow_chat_stream(events=120, pause_s=0.5))  # a minute of answer
        told = asyncio.run(scenario(upstream.url))
    # Told, never shown a clean end: that it is read in the background (a read that
    # came after the close began), or, still reading when the close stopped waiting,
    # why its stream was cut off.
    closed = effectguard.ingress.transport.CLOSED_MID_CALL
    assert "background" in told or closed in told, told
    assert stages_of(capsys, ledger) == Counter({"effect_unknown": 1})
    [call] = json.loads(_cli(capsys, "calls", "--json", "--ledger", str(ledger)))
    events = json.loads(_cli(capsys, "show", call["call_id"], "--json", "--ledger", str(ledger)))
    reasons = [e["data"]["reason"] for e in events["events"] if e["kind"] == "attempt.interrupted"]
    assert reasons == [effectguard.ingress.transport.CLOSED_MID_CALL], reasons


#: An upstream that reads the request and never answers.
SILENT = Script((b"",), ending="hang")
#: The close's 30 s window, made short: a bound on the test, not a claim about timing.
SHORT_DRAIN_S = 1.0


def _until_sent(upstream: HostileSearch) -> None:
    """Wait (bounded) until the call has reached ``upstream``."""
    for _ in range(int(HANG_BOUND_S / 0.02)):
        if upstream.hits("/v1/chat/completions"):
            return
        threading.Event().wait(0.02)
    raise AssertionError("the call never reached the provider")


def _interrupt_reasons(capsys: pytest.CaptureFixture[str], ledger: Path, call_id: str) -> list[str]:
    """The reasons of ``call_id``'s ``attempt.interrupted`` events, read through the CLI."""
    events = json.loads(_cli(capsys, "show", call_id, "--json", "--ledger", str(ledger)))
    return [e["data"]["reason"] for e in events["events"] if e["kind"] == "attempt.interrupted"]


def _cut_off_as_the_close_says(
    told: object, capsys: pytest.CaptureFixture[str], ledger: Path
) -> None:
    """The only call of ``ledger`` is ``effect_unknown`` for the transport's close, its
    reservation held, and ``told`` (what its caller got) is 504 ``effect_unknown`` saying so."""
    assert stages_of(capsys, ledger) == Counter({"effect_unknown": 1})
    closed = effectguard.ingress.transport.CLOSED_MID_CALL
    [call] = json.loads(_cli(capsys, "calls", "--json", "--ledger", str(ledger)))
    assert call["held_usd"] == call["reserved_usd"] != "0.000000000", call
    assert _interrupt_reasons(capsys, ledger, call["call_id"]) == [closed]
    assert isinstance(told, openai.APIStatusError), repr(told)
    assert told.status_code == 504, told
    assert "effect_unknown" in str(told.body), told.body
    assert call["call_id"] in told.message and closed in told.message, told.message


def test_a_call_still_unanswered_when_a_close_stops_waiting_is_marked_and_its_caller_told(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A close waits for a call under way up to 30 s; one whose provider has not answered
    by then is marked ``effect_unknown`` for the close (its reservation held), and its
    caller gets 504 ``effect_unknown`` naming the call and the close. It was left in
    flight under the closed ledger, its key answering 409 ``in_progress`` until another
    worker's sweep came by, and its caller got a 502 blaming the provider once the close
    broke the provider's connection."""
    monkeypatch.setattr(effectguard.config.defaults, "DRAIN_TIMEOUT_S", SHORT_DRAIN_S)
    ledger = tmp_path / "l.db"

    async def scenario(upstream: HostileSearch) -> BaseException | None:
        transport = effectguard.AsyncGuardTransport(
            ledger=str(ledger), upstreams={"openai": upstream.url}
        )
        client = openai.AsyncOpenAI(
            base_url=upstream.url + "/v1",
            api_key="sk-test",
            max_retries=0,
            http_client=httpx.AsyncClient(transport=transport),
        )
        call = asyncio.ensure_future(client.chat.completions.create(**CHAT))
        await asyncio.to_thread(_until_sent, upstream)
        await asyncio.wait_for(transport.aclose(), HANG_BOUND_S)
        done, _ = await asyncio.wait({call}, timeout=HANG_BOUND_S / 3)
        assert done, "its caller still waits on a closed transport"
        return call.exception()

    with hostile_search() as upstream:
        upstream.follow(SILENT)
        told = asyncio.run(scenario(upstream))
    _cut_off_as_the_close_says(told, capsys, ledger)


def test_a_call_its_caller_gave_up_on_is_marked_when_a_close_stops_waiting_for_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller that goes away once its call is sent (its task cancelled, as a timeout
    does) leaves the call to go on in the background; a close that stops waiting before
    the provider answers marks it ``effect_unknown`` for the close, as a call whose caller
    still waits. It was left in flight under the closed ledger."""
    monkeypatch.setattr(effectguard.config.defaults, "DRAIN_TIMEOUT_S", SHORT_DRAIN_S)
    ledger = tmp_path / "l.db"

    async def scenario(upstream: HostileSearch) -> None:
        transport = effectguard.AsyncGuardTransport(
            ledger=str(ledger), upstreams={"openai": upstream.url}
        )
        async with httpx.AsyncClient(transport=transport) as client:
            url = upstream.url + "/v1/chat/completions"
            call = asyncio.ensure_future(client.post(url, json=CHAT))
            await asyncio.to_thread(_until_sent, upstream)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
        # Leaving the block closed the transport.

    with hostile_search() as upstream:
        upstream.follow(SILENT)
        asyncio.run(scenario(upstream))
    assert stages_of(capsys, ledger) == Counter({"effect_unknown": 1})
    [call] = json.loads(_cli(capsys, "calls", "--json", "--ledger", str(ledger)))
    reasons = _interrupt_reasons(capsys, ledger, call["call_id"])
    assert reasons == [effectguard.ingress.transport.CLOSED_MID_CALL], reasons


def test_a_call_still_unanswered_when_a_sync_close_stops_waiting_is_marked_and_its_caller_told(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same through the sync transport, its caller in a thread of its own: it got a
    bare ``CancelledError`` as the close ended the transport's loop, and the call stayed
    in flight."""
    monkeypatch.setattr(effectguard.config.defaults, "DRAIN_TIMEOUT_S", SHORT_DRAIN_S)
    ledger = tmp_path / "l.db"
    told: list[BaseException] = []
    with hostile_search() as upstream:
        upstream.follow(SILENT)
        transport = effectguard.GuardTransport(
            ledger=str(ledger), upstreams={"openai": upstream.url}
        )
        client = openai.OpenAI(
            base_url=upstream.url + "/v1",
            api_key="sk-test",
            max_retries=0,
            http_client=httpx.Client(transport=transport),
        )

        def call() -> None:
            try:
                client.chat.completions.create(**CHAT)
            except BaseException as exc:  # what its caller is told, whatever it is
                told.append(exc)

        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        _until_sent(upstream)
        transport.close()
        caller.join(HANG_BOUND_S / 3)
        assert not caller.is_alive(), "its caller still waits on a closed transport"
    _cut_off_as_the_close_says(told[0] if told else "answered", capsys, ledger)


SYNC_CLOSE_UNDER_A_READER = """
import sys, threading, time
import httpx, effectguard
import effectguard.config.defaults

effectguard.config.defaults.DRAIN_TIMEOUT_S = 2.0  # the close's 30 s window, made short
url, ledger = sys.argv[1:3]
body = {"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
transport = effectguard.GuardTransport(ledger=ledger, upstreams={"openai": url})
client = httpx.Client(transport=transport, base_url=url)
started = threading.Event()

def read():
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        try:
            for _ in response.iter_raw():
                started.set()
        except Exception as exc:
            print("reader:", type(exc).__name__, exc, flush=True)

reader = threading.Thread(target=read)
reader.start()
started.wait(30)
transport.close()
reader.join(30)
print("closed", flush=True)
"""


def test_closing_a_sync_transport_under_a_waiting_reader_prints_no_asyncio_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A reader thread waiting on a stalled stream when the close stops waiting: the
    close ended the portal's loop by closing its async generators while that read still
    ran them, and asyncio printed "aclose(): asynchronous generator is already running"
    twice on stderr. The read is cancelled first now; the call is marked all the same."""
    ledger = tmp_path / "l.db"
    program = tmp_path / "program.py"
    program.write_text(SYNC_CLOSE_UNDER_A_READER)
    with hostile_search() as upstream:
        upstream.follow(slow_chat_stream(events=120, pause_s=0.5))  # a minute of answer
        done = subprocess.run(
            [sys.executable, str(program), upstream.url, str(ledger)],
            capture_output=True,
            text=True,
            timeout=HANG_BOUND_S,
        )
    assert done.returncode == 0, done.stderr
    # Its reader is told, never shown a clean end (which error depends on where its read
    # stood when the close came).
    told, closed = done.stdout.splitlines()
    assert told.startswith(("reader: RuntimeError", "reader: RemoteProtocolError")), told
    assert closed == "closed"
    assert done.stderr == "", done.stderr
    assert stages_of(capsys, ledger) == Counter({"effect_unknown": 1})


async def _read_all(stream: openai.AsyncStream[object]) -> str:
    """Read ``stream`` to its end; what ended it."""
    try:
        async for _ in stream:
            pass
    except openai.APIError as exc:
        return str(exc.__cause__ or exc)
    return "a clean end"


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    capsys.readouterr()
    assert cli_main(list(args)) == 0
    return capsys.readouterr().out
