# ruff: noqa: F811  (the provider fixture is imported by name and used as an argument)
"""A program using the transports as it ends without closing them, and threads that go
on calling once its main thread has returned (docs/contract.md §3.8).

Each program runs as a subprocess against the real fake provider, whose receipt log
shows when a call reached it. The transports' worker threads once followed
``concurrent.futures``' exit rules: a sync program that returned (or took Ctrl-C)
mid-call waited for the provider's answer, up to ``upstream_read_timeout_s``, and still
did not record it; and a thread calling after the main thread returned got
``RuntimeError`` from the sync transport, and from the async one already at import.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from transportkit import provider, stages_of  # noqa: F401  (a fixture, used by name)

import effectguard
from effectguard.ops.cli import main as cli_main
from effectguard.testing import FakeProvider

pytestmark = pytest.mark.slow

#: The provider answers this long after the call reaches it: never within a test, so
#: whatever the load, the program's end (not the answer) ends the call it waits for.
ANSWER_DELAY_S = 600
#: A bound only a hang exceeds (a program's start and first call, its exit), far below
#: the answer's delay: a program that waited for the answer cannot pass. (It was 20 s,
#: 10 s short of a 30 s answer, and covered the start of a Python program, a ledger's
#: creation and a call, fsyncs included, on a host the suite loads.)
HANG_BOUND_S = 120

CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}

ENDS_MID_CALL = """
import sys, threading
import httpx, effectguard

url, ledger, ending, delay = sys.argv[1:5]
transport = effectguard.GuardTransport(ledger=ledger, upstreams={"openai": url})
client = httpx.Client(transport=transport, base_url=url, timeout=100)  # never closed

def call():
    client.post(
        "/v1/chat/completions",
        json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-fake-behaviour": f"delay={delay}", "Idempotency-Key": "k"},
    )

if ending == "returns":  # a daemon thread mid-call when the main thread returns
    threading.Thread(target=call, daemon=True).start()
    sys.stdin.readline()
else:  # Ctrl-C while the main thread waits for the call
    call()
"""

CALLS_LATE = """
import asyncio, sys, threading, time
import httpx, effectguard

url, ledger, kind = sys.argv[1:4]
body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}

def sync_calls():
    transport = effectguard.GuardTransport(ledger=ledger, upstreams={"openai": url})
    with httpx.Client(transport=transport, base_url=url) as client:
        for _ in range(2):
            print(client.post("/v1/chat/completions", json=body).status_code, flush=True)

async def async_calls():
    transport = effectguard.AsyncGuardTransport(ledger=ledger, upstreams={"openai": url})
    async with httpx.AsyncClient(transport=transport, base_url=url) as client:
        for _ in range(2):
            print((await client.post("/v1/chat/completions", json=body)).status_code, flush=True)

def late():
    time.sleep(0.5)  # the main thread has returned: the interpreter has begun to exit
    sync_calls() if kind == "sync" else asyncio.run(async_calls())

threading.Thread(target=late).start()
"""


def _wait_for_effects(provider: FakeProvider, count: int) -> None:
    """Until ``count`` calls have reached the provider (a bound, not a timing claim)."""
    deadline = time.monotonic() + HANG_BOUND_S
    while len(provider.effects()) < count:
        assert time.monotonic() < deadline, "the call never reached the provider"
        time.sleep(0.05)


def _ended_within_bound(program: subprocess.Popen[str]) -> None:
    """Wait for ``program`` to exit; fail (and kill it) if it outlives the bound."""
    try:
        program.wait(timeout=HANG_BOUND_S)
    except subprocess.TimeoutExpired:
        program.kill()
        program.wait()
        raise AssertionError(
            f"the program waited for the provider's answer ({ANSWER_DELAY_S} s) to exit"
        ) from None


@pytest.mark.parametrize("ending", ["returns", "sigint"])
def test_a_sync_program_ending_mid_call_unclosed_exits_at_once_and_keeps_the_call(
    provider: FakeProvider, tmp_path: Path, capsys: pytest.CaptureFixture[str], ending: str
) -> None:
    """A sync-transport program whose main thread returns, or takes Ctrl-C, while a call
    waits for a slow provider, without close(), exits without waiting for the answer, and
    the call stays in flight, as after a crash: the next start marks it effect_unknown."""
    ledger = tmp_path / "ledger.db"
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(ENDS_MID_CALL))
    program = subprocess.Popen(
        [sys.executable, str(script), provider.url, str(ledger), ending, str(ANSWER_DELAY_S)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for_effects(provider, 1)
        if ending == "returns":
            assert program.stdin is not None
            program.stdin.write("return\n")
            program.stdin.flush()
        else:
            program.send_signal(signal.SIGINT)
        _ended_within_bound(program)
    finally:
        if program.poll() is None:
            program.kill()
        program.communicate()
    assert stages_of(capsys, ledger) == Counter(in_flight=1)
    _next_start(ledger, provider)
    assert stages_of(capsys, ledger) == Counter(effect_unknown=1, completed=1)


def _next_start(ledger: Path, provider: FakeProvider) -> None:
    """A later program on the same ledger: its start takes the ended one's calls over."""
    transport = effectguard.GuardTransport(ledger=str(ledger), upstreams={"openai": provider.url})
    with httpx.Client(transport=transport, base_url=provider.url) as client:
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_thread_calling_after_the_main_thread_returned_is_served(
    provider: FakeProvider, tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    """A non-daemon thread that makes and uses a transport after the main thread returned
    (the interpreter waits for it) gets its answers, as with plain httpx."""
    ledger = tmp_path / "ledger.db"
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(CALLS_LATE))
    try:
        done = subprocess.run(
            [sys.executable, str(script), provider.url, str(ledger), kind],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the program did not exit: {exc.stdout!r} {exc.stderr!r}") from exc
    assert (done.returncode, done.stdout, done.stderr) == (0, "200\n200\n", "")
    assert stages_of(capsys, ledger) == Counter(completed=2)
    assert len(provider.effects()) == 2


ENDS_MID_STREAM = """
import asyncio, sys
import httpx, effectguard

url, ledger = sys.argv[1:3]
body = {"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "hi"}]}

async def main():
    transport = effectguard.AsyncGuardTransport(ledger=ledger, upstreams={"openai": url})
    client = httpx.AsyncClient(transport=transport, base_url=url)  # never closed
    request = client.build_request(
        "POST", "/v1/chat/completions", json=body, headers={"x-fake-behaviour": "endless"}
    )
    response = await client.send(request, stream=True)
    await response.aiter_raw().__anext__()  # one chunk, then main returns

asyncio.run(main())
"""


def test_an_async_program_ending_mid_stream_says_its_loop_ended_not_that_the_provider_did(
    provider: FakeProvider, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``asyncio.run`` ending with a stream half read closes the upstream's reader under
    the guard: its attempt was recorded as "stream broke: ended before its terminal
    event", which blames a provider that was still sending. It now names the loop."""
    ledger = tmp_path / "ledger.db"
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(ENDS_MID_STREAM))
    done = subprocess.run(
        [sys.executable, str(script), provider.url, str(ledger)],
        capture_output=True,
        text=True,
        timeout=HANG_BOUND_S * 3,
    )
    assert done.returncode == 0, done.stderr
    assert stages_of(capsys, ledger) == Counter(effect_unknown=1)
    assert cli_main(["calls", "--json", "--ledger", str(ledger)]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert cli_main(["show", "--json", "--ledger", str(ledger), row["call_id"]]) == 0
    (attempt,) = json.loads(capsys.readouterr().out)["attempts_detail"]
    assert "its event loop shut down (asyncio.run ended)" in attempt["ended"], attempt
    assert "stream broke" not in attempt["ended"], attempt
    assert len(provider.effects()) == 1
