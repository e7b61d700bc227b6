"""whisper-1 transcriptions priced by the audio's length, through the real openai SDK.

whisper-1 bills per minute of audio. effectguard cannot read an upload's duration, so it
reserves one minute; its JSON answers report the duration (``usage: {"type":
"duration", "seconds": S}``), and the call must settle at that, not at the one-minute
stand-in: a ten-minute recording is ten times the price.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
import respx
from test_sdk_transport import OPENAI, PROVIDERS, async_openai, one

from effectguard import AsyncGuardTransport
from effectguard.rules.money import usd_to_nanos

MakeTransport = Callable[..., AsyncGuardTransport]
Finish = Callable[[AsyncGuardTransport], Awaitable[None]]

AUDIO = ("meeting.wav", b"RIFF\x00\x00\x00\x00WAVEfmt ", "audio/wav")
#: whisper-1's bundled price, per minute of audio.
MINUTE = usd_to_nanos("0.006")


def _json(seconds: float) -> httpx.Response:
    return httpx.Response(
        200, json={"text": "Hello.", "usage": {"type": "duration", "seconds": seconds}}
    )


def _verbose(seconds: float) -> httpx.Response:
    body: dict[str, Any] = {
        "task": "transcribe",
        "language": "english",
        "duration": seconds,
        "text": "Hello.",
        "segments": [],
        "usage": {"type": "duration", "seconds": seconds},
    }
    return httpx.Response(200, json=body)


def test_whisper_declares_its_price_per_minute_of_audio() -> None:
    price = PROVIDERS["openai"].price_for("whisper-1")
    assert price is not None and (price.audio_minute, price.per_call) == (MINUTE, MINUTE)


@pytest.mark.parametrize(
    ("answer", "response_format", "cost"),
    [
        (_json(600), "json", 10 * MINUTE),
        (_verbose(90.5), "verbose_json", -(-MINUTE * 90_500 // 60_000)),
        # The text format reports no duration: priced as the one minute it reserved.
        (httpx.Response(200, text="Hello.\n"), "text", MINUTE),
    ],
)
@respx.mock(base_url=OPENAI)
async def test_a_transcription_settles_at_the_duration_its_answer_reports(
    respx_mock: respx.MockRouter,
    make_transport: MakeTransport,
    finish: Finish,
    answer: httpx.Response,
    response_format: Any,
    cost: int,
) -> None:
    respx_mock.post("/v1/audio/transcriptions").mock(return_value=answer)
    t = make_transport()
    await async_openai(t).audio.transcriptions.create(
        model="whisper-1", file=AUDIO, response_format=response_format
    )
    call = one(await t.ledger.calls())
    assert (call.stage, call.reserved_at_admission, call.cost) == ("completed", MINUTE, cost)
    await finish(t)


@pytest.mark.parametrize("seconds", [b'"600"', b"NaN", b"1e300", b"-5", b"true"])
@respx.mock(base_url=OPENAI)
async def test_a_duration_not_believed_settles_at_the_one_minute_reserved(
    respx_mock: respx.MockRouter, make_transport: MakeTransport, finish: Finish, seconds: bytes
) -> None:
    """A duration that is not a finite, non-negative number is not believed: flagged, and
    the call settles at its reservation, never at zero or at an absurd amount."""
    body = b'{"text": "Hello.", "usage": {"type": "duration", "seconds": ' + seconds + b"}}"
    respx_mock.post("/v1/audio/transcriptions").mock(
        return_value=httpx.Response(200, content=body, headers={"content-type": "application/json"})
    )
    t = make_transport()
    await async_openai(t).audio.transcriptions.with_raw_response.create(
        model="whisper-1", file=AUDIO
    )
    call = one(await t.ledger.calls())
    assert (call.stage, call.cost) == ("completed", MINUTE)
    assert call.flagged is not None and call.flagged.startswith("usage ")
    await finish(t)
