"""A stream still under way when the proxy's SIGTERM drain ends (docs/operations.md,
"Shutting down: the SIGTERM drain").

uvicorn cancels the requests still running when the drain timeout ends. A stream's
client is then cut off (an error, never a clean end), and the guard reads the rest of the
upstream stream in the background phase of the drain, so a provider that finishes in
that time has its call recorded and settled from its usage, not booked ``effect_unknown``.

The upstream is a scripted socket (``hostilekit.slow_chat_stream``) that sends a chat
stream an event at a time, ``PAUSE_S`` apart, as a model generating slowly does.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from hostilekit import Script, hostile_search, slow_chat_stream

from effectguard.ops.cli import main as cli_main
from effectguard.testing import running_proxy

OPENAI_CHAT = "/openai/v1/chat/completions"
PATIENCE_S = 20.0
DRAIN_S = 3
PAUSE_S = 0.5
#: With its usage and [DONE], ten events PAUSE_S apart: still under way when the drain
#: ends (DRAIN_S after the signal), done well before its background phase ends (DRAIN_S more).
CONTENT_EVENTS = 8
#: A stream that outlasts the drain and its background phase by far.
LONG_EVENTS = 8 * DRAIN_S * int(1 / PAUSE_S)


def _cut_by_the_drain(tmp_path: Path, script: Script, signals: int = 1) -> tuple[str, float, str]:
    """A stream through a proxy that gets ``signals`` SIGTERMs once the stream is under
    way: how its client's read ended, how long the proxy took to exit, and its log."""
    config = tmp_path / "drain.toml"
    config.write_text(f"[server]\ndrain_timeout_s = {DRAIN_S}\n")
    result: dict[str, Any] = {}
    first_chunk = threading.Event()
    with hostile_search() as upstream:
        upstream.follow(script)
        with running_proxy(
            tmp_path / "l.db", upstreams={"openai": upstream.url}, args=["--config", str(config)]
        ) as proxy:

            def call() -> None:
                body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
                url = proxy.url + OPENAI_CHAT
                try:
                    with httpx.stream(
                        "POST", url, json=body | {"stream": True}, timeout=PATIENCE_S
                    ) as streamed:
                        for _ in streamed.iter_raw():
                            first_chunk.set()
                    result["ended"] = "cleanly"
                except httpx.HTTPError as exc:
                    result["ended"] = type(exc).__name__
                finally:
                    first_chunk.set()

            client = threading.Thread(target=call)
            client.start()
            assert first_chunk.wait(PATIENCE_S)
            started = time.monotonic()
            for _ in range(signals):
                proxy.kill(signal.SIGTERM)
                time.sleep(0.2)  # the first is being handled: the drain has begun
            client.join(PATIENCE_S)
            proxy.process.wait(PATIENCE_S)
            return result["ended"], time.monotonic() - started, proxy.log()


def _the_call(ledger: Path, capsys: pytest.CaptureFixture[str]) -> tuple[dict[str, Any], list[Any]]:
    """The ledger's only call, and its events."""
    capsys.readouterr()
    assert cli_main(["calls", "--json", "--ledger", str(ledger)]) == 0
    [call] = json.loads(capsys.readouterr().out)
    assert cli_main(["show", call["call_id"], "--json", "--ledger", str(ledger)]) == 0
    return call, json.loads(capsys.readouterr().out)["events"]


def test_a_stream_under_way_when_the_drain_ends_is_read_to_its_end_and_settled(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The client of a stream cut off at the end of the drain gets an error, and the
    call, whose provider ends the stream during the drain's background phase, is
    ``completed`` and settled from the stream's usage. (The cancellation used to reach
    the upstream read itself: the background read then found the stream ended, and the
    call was booked ``effect_unknown``, "stream broke: ended before its terminal event",
    the moment the drain ended.)"""
    ended, shutdown_s, _ = _cut_by_the_drain(tmp_path, slow_chat_stream(CONTENT_EVENTS, PAUSE_S))
    assert ended != "cleanly"
    assert shutdown_s > DRAIN_S, shutdown_s  # cut off by the drain, not ended before it
    call, events = _the_call(tmp_path / "l.db", capsys)
    assert (call["stage"], call["flagged"], call["held_usd"]) == ("completed", None, "0.000000000")
    kinds = [e["kind"] for e in events]
    assert "attempt.interrupted" not in kinds and "budget.settled" in kinds, kinds


def test_a_stream_still_read_when_the_background_phase_ends_is_marked_before_exit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A stream that outlasts the drain and its background phase is marked
    ``effect_unknown`` before the proxy exits, for the reason a cut-off call gets ("the
    proxy's drain timeout ended"), not left in flight for the next start to find."""
    ended, _, _ = _cut_by_the_drain(tmp_path, slow_chat_stream(LONG_EVENTS, PAUSE_S))
    assert ended != "cleanly"
    call, events = _the_call(tmp_path / "l.db", capsys)
    assert (call["stage"], call["held_usd"]) == ("effect_unknown", call["reserved_usd"])
    reasons = [e["data"]["reason"] for e in events if e["kind"] == "attempt.interrupted"]
    assert reasons == ["the proxy's drain timeout ended"], reasons


def test_a_stream_under_way_at_a_second_signal_is_marked_before_exit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second SIGTERM stops the proxy at once, with no background phase: a stream
    under way is marked ``effect_unknown`` then, for the second signal, and the exit logs
    no error (an async generator still running when the loop closed did)."""
    ended, shutdown_s, log = _cut_by_the_drain(
        tmp_path, slow_chat_stream(LONG_EVENTS, PAUSE_S), signals=2
    )
    assert ended != "cleanly"
    assert shutdown_s < DRAIN_S, shutdown_s
    assert "ERROR" not in log and "Traceback" not in log, log
    call, events = _the_call(tmp_path / "l.db", capsys)
    assert call["stage"] == "effect_unknown"
    reasons = [e["data"]["reason"] for e in events if e["kind"] == "attempt.interrupted"]
    assert reasons == ["a second signal stopped the proxy without draining"], reasons
