"""The verifier's own calendar: which budget period an instant falls in.

Written apart from the store's (:mod:`effectguard.rules.periods`) on purpose, so a wrong
label at admission cannot be confirmed by the same wrong arithmetic. An instant is read
as a wall-clock time in the node's IANA timezone and named by ``strftime``: a day
``%Y-%m-%d``, an ISO week ``%G-W%V``, a month ``%Y-%m``; ``total`` never changes.
"""

from __future__ import annotations

from datetime import datetime
from typing import Final
from zoneinfo import ZoneInfo

_FORMATS: Final = {"day": "%Y-%m-%d", "week": "%G-W%V", "month": "%Y-%m"}


def period_of(kind: str, tz: str, at: float) -> str:
    """The label of the ``kind`` period (in ``tz``) containing ``at`` (``ValueError`` if
    ``kind`` or ``tz`` is unknown)."""
    if kind == "total":
        return "total"
    fmt = _FORMATS.get(kind)
    if fmt is None:
        raise ValueError(f"unknown period kind {kind!r}")
    try:
        zone = ZoneInfo(tz)
    except Exception as exc:  # zoneinfo raises several types for a bad name
        raise ValueError(f"unknown timezone {tz!r}") from exc
    # The whole second decides: a bound is a whole second, and fromtimestamp rounds to the
    # microsecond (half a microsecond before midnight would read as the next day).
    return datetime.fromtimestamp(int(at // 1), zone).strftime(fmt)
