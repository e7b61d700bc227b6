"""Deliberate breakage, for proving that the fault simulator's checks can fail.

``EFFECTGUARD_TEST_BREAK=<name>[,<name>...]`` switches on a known-wrong
behaviour in the process that reads it. It exists only so that a test can run
a *broken build* through the simulator and assert that an invariant fires
(docs/simulator.md). Never set it anywhere else. Like ``EFFECTGUARD_CRASH_AT``
(:mod:`effectguard.callpath.crash`), this module is the only place that reads it.

Known breaks:

``classify_disconnect_as_not_sent``
    An upstream that read the request and then hung up (aiohttp's
    ``ServerDisconnectedError``, httpx's ``RemoteProtocolError``) is booked as
    "not sent", so the guard releases the reservation and retries: the duplicate
    effect effectguard exists to prevent.
"""

from __future__ import annotations

import os
from typing import Final

ENV: Final = "EFFECTGUARD_TEST_BREAK"
BREAKS: Final = frozenset({"classify_disconnect_as_not_sent"})


def broken(name: str) -> bool:
    """Whether the break ``name`` is switched on in this process's environment."""
    if name not in BREAKS:
        raise ValueError(f"unknown test break {name!r}; known: {', '.join(sorted(BREAKS))}")
    return name in os.environ.get(ENV, "").split(",")


def disconnect_counts_as_not_sent(exc: BaseException) -> bool:
    """Whether the ``classify_disconnect_as_not_sent`` break applies to ``exc``."""
    if not broken("classify_disconnect_as_not_sent"):
        return False
    for error in (exc, exc.__cause__):
        if error is not None and type(error).__name__ in (
            "ServerDisconnectedError",
            "RemoteProtocolError",
        ):
            return True
    return False
