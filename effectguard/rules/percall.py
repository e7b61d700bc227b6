"""What a call priced per call (or per result) consumed. Pure.

Most calls are priced by the tokens their answer reports (:mod:`effectguard.rules.usage`).
A model declared with a per-call price alone is not: a file upload costs its per-call
price whatever the answer says; whisper-1 bills the minutes of audio its answer reports
(``audio_minute``); dall-e-2 bills each image it makes, and a request may ask for up to
ten (``n``), so the images its answer lists are counted.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from effectguard.rules.prices import ModelPrice
from effectguard.rules.usage import ABSURD_TOKENS, Usage, UsageResult, check_usage

__all__ = ["PER_CALL", "answer_usage", "form_counts", "per_call_only"]

#: The usage of a call priced per call alone, where its answer says nothing more.
PER_CALL = UsageResult(Usage(0, 0), None)

#: Form fields a reservation reads as counts: the results asked for (an image edit's ``n``).
_COUNT_FIELDS = ("n",)


def per_call_only(price: ModelPrice) -> bool:
    """Whether ``price`` is per call alone (a file upload, a whisper-1 transcription, a
    dall-e-2 image): its cost is the per-call price, times the results its answer lists or
    replaced by the audio's minutes, whatever else the answer says."""
    return price.per_call is not None and price.input == 0 and price.output == 0


def answer_usage(price: ModelPrice, dialect: str, body: bytes) -> UsageResult:
    """The usage of a per-call-only call's answer ``body``: its audio, its results, or
    :data:`PER_CALL` where it reports neither (text, audio bytes, a file object)."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return PER_CALL
    if not isinstance(doc, dict):
        return PER_CALL
    if price.audio_minute is not None:
        return _audio_usage(doc.get("usage")) or PER_CALL
    if dialect != "flat":  # a tool's answer is its own: a list in it is no count of results
        return _item_usage(doc.get("data")) or PER_CALL
    return PER_CALL


def _audio_usage(u: object) -> UsageResult | None:
    """The audio duration a transcription answer reports (``usage: {"type": "duration",
    "seconds": S}``, whisper-1's JSON formats), or None where it reports none (its text,
    srt and vtt formats): such a call is priced per call, as one minute."""
    if not isinstance(u, dict) or u.get("type") != "duration":
        return None
    seconds = u.get("seconds")
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        return UsageResult(None, "malformed")
    if not math.isfinite(seconds) or seconds > ABSURD_TOKENS:
        return UsageResult(None, "absurd")
    # Rounded up to a whole millisecond: the price is never below what the answer says.
    return _judged(Usage(0, 0, audio_ms=math.ceil(Fraction(seconds) * 1000)))


def _item_usage(data: object) -> UsageResult | None:
    """The results an answer lists (``data: [{"url": ...}, ...]``, an images answer), or
    None where it lists none: such a call is priced per call, as one result."""
    if not isinstance(data, list) or not data:
        return None
    return _judged(Usage(0, 0, items=len(data)))


def _judged(usage: Usage) -> UsageResult:
    return UsageResult(usage, check_usage(usage))


def form_counts(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The count fields of a form or multipart body, as the reservation reads them.

    A form's values are text: ``n=3`` is the integer 3. A value that is no plain decimal
    is kept as text, so the reservation refuses it by name (400, ``param: n``) instead
    of pricing one image where the provider may make many."""
    counts: dict[str, Any] = {}
    for key in _COUNT_FIELDS:
        value = fields.get(key)
        if value is None:
            continue
        text = str(value).strip()
        counts[key] = int(text) if text.isascii() and text.isdigit() and len(text) < 8 else text
    return counts
