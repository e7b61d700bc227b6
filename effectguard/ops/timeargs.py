"""``--since``: an ISO date or time, or a duration back from now (``90s``, ``30m``, ``2h``,
``7d``). Naive dates and times are UTC, as every time the CLI prints is."""

from __future__ import annotations

import argparse
import datetime as dt
import re

_DURATION = re.compile(r"(\d+)([smhdw])", re.ASCII)
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
#: From 0001-01-01 to 9999-12-31: no duration back from now reaches further than that, and
#: a longer one (``111…1d``, 400 digits) overflowed a float with a traceback.
_LONGEST_S = (dt.date.max - dt.date.min).days * 86400


def since(text: str, now: float) -> float:
    """The Unix time ``text`` names; raises ``ValueError`` saying what it accepts."""
    value = text.strip()
    match = _DURATION.fullmatch(value)
    if match:
        seconds = int(match.group(1)) * _UNIT_S[match.group(2)]
        if seconds > _LONGEST_S:
            raise ValueError(f"{text!r} reaches back past year 1, where the calendar starts")
        return now - seconds
    try:
        moment = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(
            f"{text!r} is neither a duration (90s, 30m, 2h, 7d, 2w) nor an ISO date/time"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)
    return moment.timestamp()


def since_argument(text: str) -> str:
    """argparse type for ``--since``: checked now, resolved against the clock later."""
    try:
        since(text, 0.0)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return text
