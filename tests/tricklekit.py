"""An upstream that trickles its answer, and a client's patience with it.

The fake provider trickles an answer when asked (``x-fake-behaviour: trickle=S``): a byte
every S seconds, never silent for ``READ_S`` and far from its end by ``PATIENCE_S``. The
guard's bounds (``BOUNDED``) must cut it off before the client's patience runs out.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import httpx
from conftest import FAST

READ_S = 1
STREAM_S = 2
#: A byte every 0.2 s: never silent for READ_S, and minutes to the end.
TRICKLE = {"x-fake-behaviour": "trickle=0.2"}
#: How long a client waits for the whole of any answer: far past both bounds, far short
#: of a trickled answer's end, so a test fails in bounded time without them.
PATIENCE_S = 15.0
OUTLASTED = "still running when the client's patience ran out"
BOUNDED = dataclasses.replace(
    FAST, upstream_read_timeout_s=READ_S, upstream_stream_timeout_s=STREAM_S
)


async def how_it_ended(r: httpx.Response, label: str = "") -> str:
    """How reading streamed ``r`` to its end went: ``cleanly``, ``OUTLASTED``, or the
    error that ended it (after ``label``)."""
    try:
        async with asyncio.timeout(PATIENCE_S):
            async for _ in r.aiter_raw():
                pass
    except TimeoutError:
        return OUTLASTED
    except httpx.TransportError as exc:
        return f"{label}{type(exc).__name__}: {exc}"
    return "cleanly"


def how_it_ended_sync(r: httpx.Response, label: str = "") -> str:
    """:func:`how_it_ended` for a sync client's response."""
    began = time.monotonic()
    try:
        for _ in r.iter_raw():
            if time.monotonic() - began > PATIENCE_S:
                return OUTLASTED
    except httpx.TransportError as exc:
        return f"{label}{type(exc).__name__}: {exc}"
    return "cleanly"
