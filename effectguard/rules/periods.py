"""Budget periods: which calendar period an instant falls in, in a declared timezone. Pure.

A budget node's period is ``day``, ``week`` (ISO weeks, Monday first), ``month`` or
``total`` (never resets). An instant (seconds since the epoch, from the ledger's clock)
is read as a wall-clock time in the node's IANA timezone, and the period is named by a
label: ``2026-12-01``, ``2026-W49``, ``2026-12`` or ``total``.

Labels come from the local *date* of the instant, never from adding 86,400 seconds, so
days of 23 or 25 hours (DST changes) and zones whose midnight is skipped are handled by
the timezone database, not by arithmetic here. :func:`bounds` gives the first instant
of a period and the first instant of the next one.
"""

from __future__ import annotations

import math
import re
import zoneinfo
from datetime import UTC, date, datetime, timedelta
from functools import lru_cache
from typing import Final, Literal, get_args
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

PeriodKind = Literal["day", "week", "month", "total"]
PERIOD_KINDS: Final[tuple[PeriodKind, ...]] = get_args(PeriodKind)
TOTAL: Final = "total"
DEFAULT_TZ: Final = "UTC"

_DAY = re.compile(r"(\d{4})-(\d{2})-(\d{2})", re.ASCII)
_WEEK = re.compile(r"(\d{4})-W(\d{2})", re.ASCII)
_MONTH = re.compile(r"(\d{4})-(\d{2})", re.ASCII)


#: How far back a clock may be stepped (NTP) across a period's start and still charge the
#: period that had started: an admission this close before a boundary, on a node the next
#: period has already charged, is charged to the next period (docs/contract.md §5.5).
KEPT_BACK_S: Final = 60

#: Names the timezone database answers with whatever this machine's clock is set to:
#: a budget declared in one would reset at different instants on different replicas.
HOST_ZONES: Final = frozenset({"localtime", "posixrules"})


@lru_cache(maxsize=256)
def zone(name: str) -> ZoneInfo:
    """The IANA timezone ``name``; ``ValueError`` if there is none."""
    try:
        return ZoneInfo(name)
    # OSError: a name too long for a file name is no zone either.
    except (ZoneInfoNotFoundError, ValueError, OSError) as exc:
        shown = repr(name) if len(name) <= 64 else repr(name[:40]) + f"... ({len(name)} chars)"
        raise ValueError(f"unknown timezone {shown} (use an IANA name like Europe/Paris)") from exc


@lru_cache(maxsize=1)
def _iana_names() -> frozenset[str]:
    # The names of the IANA database that this machine holds (its own copy and the tzdata
    # package's). It leaves out the directories some systems add beside them (Debian's
    # posix/ and right/ copies): ZoneInfo loads those here, but a replica that has only
    # the tzdata package (a slim container) has no such file.
    return frozenset(zoneinfo.available_timezones())


def validate_zone(name: str) -> str:
    """``name`` if it is an IANA zone that means the same on every machine, else
    ``ValueError`` (for a new policy; stored policies are read with :func:`zone`)."""
    if name in HOST_ZONES:
        raise ValueError(
            f"{name!r} is this machine's own zone, which other machines read differently; "
            "name the zone (e.g. Europe/Paris)"
        )
    zone(name)
    if name not in _iana_names():
        raise ValueError(
            f"{name!r} is not an IANA zone name (only this machine's copy has it); "
            "name the zone (e.g. Europe/Paris)"
        )
    return name


def validate_kind(kind: str) -> PeriodKind:
    """``kind`` if it is a period kind, else ``ValueError``."""
    for known in PERIOD_KINDS:
        if kind == known:
            return known
    raise ValueError(f"unknown period {kind!r}: use one of {', '.join(PERIOD_KINDS)}")


def label_of_date(kind: PeriodKind, day: date) -> str:
    """The label of the period of kind ``kind`` that contains the local date ``day``."""
    if kind == "day":
        return day.isoformat()
    if kind == "week":
        year, week, _ = day.isocalendar()
        return f"{year:04d}-W{week:02d}"
    if kind == "month":
        return f"{day.year:04d}-{day.month:02d}"
    return TOTAL


def label(kind: PeriodKind, tz: str, at: float) -> str:
    """The label of the period of kind ``kind`` (in timezone ``tz``) containing instant ``at``."""
    if kind == "total":
        return TOTAL
    # Period bounds fall on whole seconds (zone offsets are whole seconds), so the whole
    # second decides; fromtimestamp would round 23:59:59.9999996 up into the next day.
    return label_of_date(kind, datetime.fromtimestamp(math.floor(at), zone(tz)).date())


def kind_of_label(text: str) -> PeriodKind:
    """Which kind of period ``text`` names (``ValueError`` if it names none)."""
    if text == TOTAL:
        return "total"
    first_day(text)  # validates the numbers
    if _DAY.fullmatch(text):
        return "day"
    return "week" if _WEEK.fullmatch(text) else "month"


def first_day(text: str) -> date:
    """The first local date of the period labelled ``text`` (``ValueError`` if not a label)."""
    try:
        if m := _DAY.fullmatch(text):
            return date(int(m[1]), int(m[2]), int(m[3]))
        if m := _WEEK.fullmatch(text):
            return date.fromisocalendar(int(m[1]), int(m[2]), 1)
        if m := _MONTH.fullmatch(text):
            return date(int(m[1]), int(m[2]), 1)
    except ValueError as exc:
        raise ValueError(f"not a period: {text!r} ({exc})") from exc
    raise ValueError(f"not a period: {text!r} (use YYYY-MM-DD, YYYY-Www, YYYY-MM or total)")


def next_first_day(text: str) -> date:
    """The first local date after the period labelled ``text``."""
    start = first_day(text)
    kind = kind_of_label(text)
    if kind == "day":
        return start + timedelta(days=1)
    if kind == "week":
        return start + timedelta(days=7)
    return date(start.year + start.month // 12, start.month % 12 + 1, 1)


def _midnight(day: date, tz: str) -> float:
    """The first instant of local date ``day`` in ``tz``.

    A midnight that a DST change skips does not exist; ``fold=0`` reads it with the
    offset in force before the change, which is exactly the instant of the change —
    the first instant whose local date is ``day``.
    """
    local = datetime(day.year, day.month, day.day, tzinfo=zone(tz), fold=0)
    return local.astimezone(UTC).timestamp()


def bounds(text: str, tz: str) -> tuple[float, float] | None:
    """``(start, end)``: the first instant of period ``text`` in ``tz`` and of the next one.

    ``None`` for ``total``, which has no bounds.
    """
    if text == TOTAL:
        return None
    return _midnight(first_day(text), tz), _midnight(next_first_day(text), tz)


def shared_labels(kind: PeriodKind, old_tz: str, new_tz: str, at: float) -> list[str]:
    """The periods of ``new_tz`` not yet over at ``at`` (the current one and the next)
    whose label ``old_tz`` may already have charged, at other hours than ``new_tz`` puts
    that period. Counters are kept per label, not per zone, so a node moved from
    ``old_tz`` to ``new_tz`` at ``at`` counts in each such period what it was charged
    under that label before the move (docs/contract.md §5.5)."""
    if kind == "total" or old_tz == new_tz:
        return []
    current = label(kind, new_tz, at)
    following = label(kind, new_tz, _midnight(next_first_day(current), new_tz))
    out = []
    for text in dict.fromkeys((current, following)):
        old = bounds(text, old_tz)
        if old is not None and old[0] <= at and old != bounds(text, new_tz):
            out.append(text)
    return out
