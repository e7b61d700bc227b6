"""Crash points (docs/contract.md §11): kill this process, without cleanup, at a named point.

Configured once at the edge from ``EFFECTGUARD_CRASH_AT``; when unset the guard
holds :data:`NO_CRASH`, whose ``hit`` does nothing. ``EFFECTGUARD_CRASH_SIGNAL=SIGSTOP``
freezes the process there instead, once (a pause, a suspended machine), until SIGCONT.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Final

from effectguard.errors import ConfigError

POINTS: Final = frozenset(
    {
        "after:admit",
        "after:dispatch",
        "after:upstream-response",
        "after:observe",
        "mid-stream",
        "after:reconcile",
        "before:observe",
        "after:archive-commit",
        "after:archive-step",
    }
)


#: What ``EFFECTGUARD_CRASH_SIGNAL`` may name: a kill, or a freeze until SIGCONT.
SIGNALS: Final = {"SIGKILL": signal.SIGKILL, "SIGSTOP": signal.SIGSTOP}


class CrashPoints:
    """Kills the process with SIGKILL when :meth:`hit` names the configured point (or,
    with SIGSTOP, freezes it there the first time).

    An unknown point is a :class:`ConfigError`: the command stops at start with exit 2.
    """

    def __init__(self, point: str | None, sig: signal.Signals = signal.SIGKILL) -> None:
        if point is not None and point not in POINTS:
            known = ", ".join(sorted(POINTS))
            raise ConfigError(
                f"EFFECTGUARD_CRASH_AT: unknown crash point {point!r}; known: {known}"
            )
        self.point = point
        self.sig = sig

    def hit(self, point: str) -> None:
        """Signal this process if ``point`` is the configured crash point."""
        if point == self.point:
            for handler in logging.getLogger().handlers:  # serve's lines wait in a queue
                handler.flush()
            sys.stderr.flush()
            if self.sig == signal.SIGSTOP:
                self.point = None  # once: continued, the process goes on as if paused
            os.kill(os.getpid(), self.sig)


NO_CRASH: Final = CrashPoints(None)


def from_environment(environ: dict[str, str] | None = None) -> CrashPoints:
    """The crash point named by ``EFFECTGUARD_CRASH_AT`` (read at the edge only)."""
    env = os.environ if environ is None else environ
    point = env.get("EFFECTGUARD_CRASH_AT") or None
    name = env.get("EFFECTGUARD_CRASH_SIGNAL") or "SIGKILL"
    if name not in SIGNALS:
        raise ConfigError(f"EFFECTGUARD_CRASH_SIGNAL: {name!r} is not one of {sorted(SIGNALS)}")
    return CrashPoints(point, SIGNALS[name]) if point else NO_CRASH
