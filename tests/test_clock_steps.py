"""The ledger's clock as it really behaves: stepped back by NTP or a resumed VM, or given
by a test as whole numbers. Each test drives the in-process transport (or the ledger a
user opens) on a SQLite ledger whose clock the test moves, and ends with ``effectguard
verify``.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import respx
from hypothesis import given
from hypothesis import strategies as st

from effectguard import AsyncGuardTransport
from effectguard.ledger import Ledger, room
from effectguard.ops.audit import rates as audit_rates
from effectguard.ops.cli import main as cli_main
from effectguard.rules import ratelimit
from effectguard.rules.budget import BudgetPolicy
from effectguard.rules.ratelimit import RateWindow
from effectguard.testing.clock import ManualClock

CHAT_URL = "https://api.openai.com/v1/chat/completions"
ANSWER = (
    b'{"id": "c", "object": "chat.completion", "model": "gpt-4o-mini", "choices": [],'
    b' "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}'
)
#: 30 seconds into a minute.
T0 = 1_800_000_030.0


class SteppedClock:
    """A wall clock that an operator's NTP may set anywhere, backwards too."""

    def __init__(self, at: float) -> None:
        self._at = at
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._at

    def set(self, at: float) -> None:
        with self._lock:
            self._at = at


def _calls(
    tmp_path: Path, times: list[float], limits: tuple[str, ...] = ("--rpm", "2"), **body: object
) -> tuple[list[httpx.Response], list[float]]:
    """One chat call to budget ``team`` (rpm 2 unless ``limits`` say otherwise) at each
    ledger time in ``times``, through the transport; the answers, and the ledger times at
    which the provider was called. ``body`` adds to each request's body."""
    ledger = str(tmp_path / "l.db")
    assert cli_main(["migrate", "--ledger", ledger]) == 0
    assert cli_main(["budget", "set", "team", *limits, "--ledger", ledger]) == 0
    clock = SteppedClock(times[0])
    sent: list[float] = []

    def reply(request: httpx.Request) -> httpx.Response:
        sent.append(clock())
        return httpx.Response(
            200, headers={"content-type": "application/json"}, stream=httpx.ByteStream(ANSWER)
        )

    async def run() -> list[httpx.Response]:
        sent_body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
        async with Ledger.open(ledger, clock=clock) as led:
            transport = AsyncGuardTransport(httpx.MockTransport(reply), ledger=led)
            async with httpx.AsyncClient(transport=transport) as client:
                out = []
                for at in times:
                    clock.set(at)
                    headers = {"Effectguard-Budget": "team"}
                    out.append(
                        await client.post(CHAT_URL, json={**sent_body, **body}, headers=headers)
                    )
                return out

    return asyncio.run(run()), sent


def test_a_clock_stepped_back_reopens_no_minute(tmp_path: Path) -> None:
    """rpm 2: two calls in minute m, then the clock steps back 45 s into minute m-1 and
    later returns to m. No request after the step reaches the provider until the window's
    minute is over, the 429 says how long that is by the stepped clock, and verify agrees."""
    answers, sent = _calls(tmp_path, [T0, T0, T0 - 45, T0 - 45, T0 + 5])
    assert [a.status_code for a in answers] == [200, 200, 429, 429, 429]
    assert Counter(int(at) // 60 for at in sent) == {int(T0) // 60: 2}
    # Stepped back to 45 s into minute m-1, the window (minute m) ends 75 s later.
    assert answers[2].headers["retry-after"] == "75"
    assert cli_main(["verify", "--ledger", str(tmp_path / "l.db")]) == 0


def test_calls_admitted_after_a_step_back_give_their_estimates_back(tmp_path: Path) -> None:
    """tpm 3000, each call estimated at over 1000 tokens (max_tokens 1000) and reporting 2:
    one call in minute m, then the clock steps back 45 s and three more are made. Each
    settles at 2 tokens, so all four are sent. (Before, the calls after the step back kept
    their estimates in the window: the fourth was refused 429 with 8 tokens spent.)"""
    answers, sent = _calls(tmp_path, [T0] + [T0 - 45] * 3, ("--tpm", "3000"), max_tokens=1000)
    assert [a.status_code for a in answers] == [200] * 4
    assert len(sent) == 4
    assert cli_main(["verify", "--ledger", str(tmp_path / "l.db")]) == 0


def test_a_clock_corrected_from_far_ahead_does_not_hold_the_window(tmp_path: Path) -> None:
    """rpm 2: the clock runs three hours ahead for two calls, then NTP corrects it. The
    window starts over at the corrected time instead of refusing the node until the clock
    reaches the wrong time again; a step back of ten minutes starts it over too."""
    answers, sent = _calls(tmp_path, [T0 + 3 * 3600] * 3 + [T0] * 3 + [T0 - 600] * 3)
    assert [a.status_code for a in answers] == [200, 200, 429] * 3
    assert len(sent) == 6
    assert cli_main(["verify", "--ledger", str(tmp_path / "l.db")]) == 0


def test_a_clock_stepped_back_past_midnight_does_not_reopen_the_day(tmp_path: Path) -> None:
    """A daily budget with room for one call: spent at 00:00:10, then the clock steps back
    20 s into the day before. The next call is charged to the day that had started (402),
    not to the day before's untouched room; a step back of an hour is charged to the day
    before, as the contract says. verify agrees."""
    ledger = str(tmp_path / "l.db")
    assert cli_main(["migrate", "--ledger", ledger]) == 0
    midnight = 1_800_057_600.0  # 2027-01-16T00:00:00Z
    clock = SteppedClock(midnight + 10)
    upstream = httpx.MockTransport(
        lambda request: httpx.Response(
            200, headers={"content-type": "application/json"}, stream=httpx.ByteStream(ANSWER)
        )
    )

    async def run() -> list[int]:
        body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
        async with Ledger.open(ledger, clock=clock) as led:
            await led.set_policy(BudgetPolicy("team", period="day"))
            transport = AsyncGuardTransport(upstream, ledger=led)
            async with httpx.AsyncClient(transport=transport) as client:

                async def status(at: float) -> int:
                    clock.set(at)
                    headers = {"Effectguard-Budget": "team"}
                    return (await client.post(CHAT_URL, json=body, headers=headers)).status_code

                first = await status(midnight + 10)
                (call,) = await led.calls()
                # Room for exactly one reservation: the day's first call used it.
                await led.set_policy(
                    BudgetPolicy("team", limit=call.reserved_at_admission, period="day")
                )
                later = [await status(at) for at in (midnight + 10, midnight - 20)]
                return [first, *later, await status(midnight - 3600)]

    assert asyncio.run(run()) == [200, 402, 402, 200]
    assert cli_main(["verify", "--ledger", ledger]) == 0


def test_a_clock_answering_whole_numbers_keeps_the_ledger_verifiable(tmp_path: Path) -> None:
    """A ManualClock started at a whole number of seconds (an int) times events that verify
    reads back and accepts."""
    ledger = str(tmp_path / "l.db")

    async def run() -> None:
        async with Ledger.open(ledger, clock=ManualClock(start=1_800_000_000)) as led:
            await led.set_policy(BudgetPolicy("team", rpm=3))

    asyncio.run(run())
    assert cli_main(["verify", "--ledger", ledger]) == 0


@given(
    times=st.lists(st.floats(0, 600, allow_nan=False), min_size=1, max_size=80),
    rpm=st.integers(0, 10),
)
def test_no_window_admits_more_than_rpm_whichever_way_the_clock_moves(
    times: list[float], rpm: int
) -> None:
    """Admissions at times in any order (a clock stepped back and forth): no window admits
    more than rpm, and a window goes back to an earlier minute only for a step back of
    more than a minute."""
    policies = {"a": BudgetPolicy("a", rpm=rpm)}
    window = RateWindow("a")
    windows = 0
    admitted: Counter[int] = Counter()
    for now in times:
        if ratelimit.check(policies, {"a": window}, lambda _: 0, "a", now, 0) is None:
            moved = ratelimit.admitted(window, now, 0, 1)
            if moved.minute < window.minute:
                assert window.minute - moved.minute > ratelimit.KEPT_BACK
            if moved.requests == 1:
                windows += 1
            window = moved
            admitted[windows] += 1
    assert all(n <= rpm for n in admitted.values())


def _admitted_unmarked(window: RateWindow, at: float, tokens: int, position: int) -> RateWindow:
    """:func:`ratelimit.admitted` as releases up to writer format 4 counted: a step back
    recorded no position (nor, before writer format 6, the highest minute reached)."""
    current = window.at(ratelimit.minute_of(at))
    return replace(
        current, requests=current.requests + 1, tokens=current.tokens + tokens, reached=None
    )


def test_a_step_back_booked_as_releases_before_writer_format_1_did_still_verifies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ledger the previous release wrote, upgraded in place: it charged a call made 20 s
    before midnight, after a clock step back, to the day before, and started its rate
    window over in the minute before (it had neither kept-back rule). That ledger is
    honest, and verify by this release says so (it reported it BROKEN: "names periods
    {...2027-01-15} but the call was admitted in {...2027-01-16}", and a rate window the
    events did not give). The previous release's admission is this one's without the two
    rules (nor the position a step back records), which the test takes out while the calls
    are made."""
    ledger = str(tmp_path / "l.db")
    assert cli_main(["migrate", "--ledger", ledger]) == 0
    midnight = 1_800_057_600.0  # 2027-01-16T00:00:00Z
    clock = SteppedClock(midnight + 10)
    upstream = httpx.MockTransport(
        lambda request: httpx.Response(
            200, headers={"content-type": "application/json"}, stream=httpx.ByteStream(ANSWER)
        )
    )
    monkeypatch.setattr(room.budgets, "labels_ahead", lambda *args: {})
    monkeypatch.setattr(ratelimit, "KEPT_BACK", 0)
    monkeypatch.setattr(ratelimit, "admitted", _admitted_unmarked)

    async def run() -> list[int]:
        body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
        async with Ledger.open(ledger, clock=clock) as led:
            await led.set_policy(BudgetPolicy("team", limit=10**9, period="day", rpm=10))
            transport = AsyncGuardTransport(upstream, ledger=led)
            async with httpx.AsyncClient(transport=transport) as client:
                out = []
                for at in (midnight + 10, midnight - 20):
                    clock.set(at)
                    headers = {"Effectguard-Budget": "team"}
                    out.append(
                        (await client.post(CHAT_URL, json=body, headers=headers)).status_code
                    )
                return out

    assert asyncio.run(run()) == [200, 200]
    # Its archive's checkpoint carries the rate window as that release counted it.
    monkeypatch.setattr(audit_rates, "_KEPT_BACK", 0)
    monkeypatch.setattr(audit_rates, "_MARKS", False)
    monkeypatch.setattr(audit_rates, "_TRACKS", False)
    archive = str(tmp_path / "archive.jsonl")
    assert (
        cli_main(["archive", "--ledger", ledger, "--before", "2027-02-01", "--out", archive]) == 0
    )
    monkeypatch.undo()
    assert cli_main(["verify", "--ledger", ledger]) == 0
    assert cli_main(["verify", "--ledger", ledger, "--archive", archive]) == 0


def _sse(*objects: dict[str, object]) -> bytes:
    return b"".join(b"data: " + json.dumps(o).encode() + b"\n\n" for o in objects)


CHUNK = _sse(
    {
        "id": "c",
        "object": "chat.completion.chunk",
        "model": "gpt-4o-mini",
        "choices": [{"index": 0, "delta": {"content": "hello"}}],
    }
)
USAGE = (
    _sse(
        {
            "id": "c",
            "object": "chat.completion.chunk",
            "model": "gpt-4o-mini",
            "choices": [],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    )
    + b"data: [DONE]\n\n"
)


class GatedStream(httpx.AsyncByteStream):
    """A provider's stream: its first chunk at once, the rest (with the usage) once the
    test opens the gate."""

    def __init__(self, gate: asyncio.Event) -> None:
        self._gate = gate

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield CHUNK
        await self._gate.wait()
        yield USAGE


def test_a_stream_in_flight_across_a_step_back_gives_its_estimate_back(tmp_path: Path) -> None:
    """tpm 1500, every call reporting 2 tokens: a stream (max_tokens 500, so an estimate
    over 500) is opened in minute m and is still streaming when NTP steps the clock back
    45 s and a second call of max_tokens 500 is made; then the stream ends. Both gave
    their estimates back, so calls of max_tokens 1000 fit in the minute. (Before, the
    call made after the step kept its estimate, and the first of them was refused 429;
    with the first fix, which counted only the calls reserved after the step, the stream
    kept its estimate instead, with the same 429.)"""
    ledger = str(tmp_path / "l.db")
    assert cli_main(["migrate", "--ledger", ledger]) == 0
    assert cli_main(["budget", "set", "team", "--tpm", "1500", "--ledger", ledger]) == 0
    clock = SteppedClock(T0)

    async def run() -> list[int]:
        gate = asyncio.Event()

        def reply(request: httpx.Request) -> httpx.Response:
            if json.loads(request.content).get("stream") is True:
                stream: httpx.AsyncByteStream = GatedStream(gate)
                return httpx.Response(
                    200, headers={"content-type": "text/event-stream"}, stream=stream
                )
            return httpx.Response(
                200, headers={"content-type": "application/json"}, stream=httpx.ByteStream(ANSWER)
            )

        body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
        body["max_tokens"] = 500
        headers = {"Effectguard-Budget": "team"}
        async with Ledger.open(ledger, clock=clock) as led:
            transport = AsyncGuardTransport(httpx.MockTransport(reply), ledger=led)
            async with httpx.AsyncClient(transport=transport) as client:
                streamed = {**body, "stream": True}
                async with client.stream("POST", CHAT_URL, json=streamed, headers=headers) as r:
                    chunks = r.aiter_bytes()
                    await anext(chunks)
                    clock.set(T0 - 45)
                    stepped = await client.post(CHAT_URL, json=body, headers=headers)
                    gate.set()
                    async for _ in chunks:
                        pass
                body["max_tokens"] = 1000
                later = [await client.post(CHAT_URL, json=body, headers=headers) for _ in "abc"]
                return [r.status_code, stepped.status_code, *(a.status_code for a in later)]

    assert asyncio.run(run()) == [200] * 5
    assert cli_main(["verify", "--ledger", ledger]) == 0


def test_a_stream_of_a_minute_a_forward_step_reenters_gives_nothing_to_the_new_window(
    tmp_path: Path,
) -> None:
    """tpm 1500, every call reporting 2 tokens: stream A (max_tokens 500) is opened 30 s into
    minute m; NTP steps the clock back three minutes (a call there starts the window over),
    then forward again into m, where stream D (max_tokens 500) starts the window over once
    more. A ends: the new window never counted it, so it still holds D's estimate, and a
    call of max_tokens 1000 does not fit (429, never sent). (The window counted minute m
    whole: A's settlement took its estimate off D's, and that call was sent, about 1500
    tokens under way in the minute.)"""
    ledger = str(tmp_path / "l.db")
    assert cli_main(["migrate", "--ledger", ledger]) == 0
    assert cli_main(["budget", "set", "team", "--tpm", "1500", "--ledger", ledger]) == 0
    clock = SteppedClock(T0)

    async def run() -> tuple[list[int], int]:
        gates = [asyncio.Event(), asyncio.Event()]
        streams = iter(gates)

        def reply(request: httpx.Request) -> httpx.Response:
            if json.loads(request.content).get("stream") is True:
                stream = GatedStream(next(streams))
                return httpx.Response(
                    200, headers={"content-type": "text/event-stream"}, stream=stream
                )
            return httpx.Response(200, headers={"content-type": "application/json"}, content=ANSWER)

        body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
        body["max_tokens"] = 500
        streamed = {**body, "stream": True}
        headers = {"Effectguard-Budget": "team"}
        async with Ledger.open(ledger, clock=clock) as led, respx.mock() as upstream:
            route = upstream.post(CHAT_URL).mock(side_effect=reply)
            transport = AsyncGuardTransport(httpx.AsyncHTTPTransport(), ledger=led)
            async with httpx.AsyncClient(transport=transport) as client:
                async with client.stream("POST", CHAT_URL, json=streamed, headers=headers) as a:
                    a_chunks = a.aiter_bytes()
                    await anext(a_chunks)
                    clock.set(T0 - 180)
                    back = await client.post(
                        CHAT_URL, json={**body, "max_tokens": 10}, headers=headers
                    )
                    clock.set(T0 + 10)
                    async with client.stream("POST", CHAT_URL, json=streamed, headers=headers) as d:
                        d_chunks = d.aiter_bytes()
                        await anext(d_chunks)
                        gates[0].set()
                        async for _ in a_chunks:
                            pass
                        late = await client.post(
                            CHAT_URL, json={**body, "max_tokens": 1000}, headers=headers
                        )
                        gates[1].set()
                        async for _ in d_chunks:
                            pass
                statuses = [a.status_code, back.status_code, d.status_code, late.status_code]
                return statuses, route.call_count

    statuses, sent = asyncio.run(run())
    assert statuses == [200, 200, 200, 429]
    assert sent == 3
    assert cli_main(["verify", "--ledger", ledger]) == 0
