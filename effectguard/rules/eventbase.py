"""The base of every event kind: a frozen value that knows its stored name and fields.

The kinds themselves are in :mod:`.callevents`, :mod:`.budgetevents` and
:mod:`.ledgerevents`; :mod:`.events` registers them and stores them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, ClassVar


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """Base of every event kind. ``kind`` is the stable name stored in the ledger."""

    kind: ClassVar[str] = ""

    @property
    def call_id(self) -> str | None:
        """The call this event belongs to, if any."""
        return None

    def to_data(self) -> dict[str, Any]:
        """The event's fields as a JSON-ready dict (without ``kind``)."""
        names, values = _field_reader(type(self))
        return dict(zip(names, values(self), strict=True))


@dataclass(frozen=True, slots=True, kw_only=True)
class CallEvent(Event):
    """An event that belongs to one call."""

    call: str

    @property
    def call_id(self) -> str | None:
        return self.call


_READERS: dict[type[Event], tuple[tuple[str, ...], Callable[[Event], tuple[Any, ...]]]] = {}


def _field_reader(
    cls: type[Event],
) -> tuple[tuple[str, ...], Callable[[Event], tuple[Any, ...]]]:
    # dataclasses.fields() walks the class on every call; sealing an event is on
    # every request's durable path, so each kind's field names are read once.
    reader = _READERS.get(cls)
    if reader is None:
        names = tuple(f.name for f in dataclasses.fields(cls))
        get = attrgetter(*names)
        values = get if len(names) > 1 else (lambda event: (get(event),))
        reader = _READERS[cls] = (names, values)
    return reader
