"""Room at ``[server] max_connections`` for a request, made by closing idle connections.

uvicorn counts every open connection toward the cap, and answers a request read while it
is reached with a plain 503. A connection with no request in progress (silent since it
opened, or idle between kept-alive requests, or part-way through a request head) holds a
place until ``header_timeout_s`` or ``keep_alive_timeout_s`` closes it: one client's
1,024 silent sockets made every other client's call a 503, again and again. At the cap a
complete request head now takes the place of the connection that has been idle longest,
closed; a connection whose request head was read (its body arriving, its call in flight,
its answer being written, requests pipelined behind it) is never closed for room, and
when every connection has a request the cap holds as before.

The registry is a dict in insertion order: a connection enters it when it opens and each
time an answer leaves it idle, and leaves it when a request head is read or it closes,
so the oldest idle connection is its first key. Two dict operations per request on the
normal path; the closing is done only at the cap.

The same connections give way when the process can open no more files
(:func:`effectguard.ingress.fdlimit.watch_open_files`), as nginx closes idle kept-alive
connections when accept meets EMFILE. Each closing is counted
(``effectguard_connections_closed_for_room_total``, by reason) and logged, at most once a
minute for each reason.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

log = logging.getLogger("effectguard.ingress.roomcap")

#: Why connections were closed for room: the label values of the counter.
AT_THE_CAP = "max_connections"
OUT_OF_FILES = "open_files"
#: A line about connections closed for room is written at most this often, per reason.
SAY_EVERY_S = 60.0


class Closable(Protocol):
    """A server connection that can be closed for room."""

    def close_for_room(self) -> None:
        """Close it (a no-op if it is closing already)."""


class IdleConnections:
    """The connections of one server with no request in progress, idle longest first."""

    def __init__(self, counted: Callable[[str, int], None] | None = None) -> None:
        """``counted``: told of each closing for room (its reason and how many)."""
        self._idle: dict[Closable, None] = {}
        self._counted = counted
        self._said = ClosedForRoom()
        #: Connections closed for room that the server still counts (their close is
        #: seen a loop turn later): they hold no place any more.
        self._leaving: set[Closable] = set()

    def __len__(self) -> int:
        return len(self._idle)

    def idle(self, conn: Closable) -> None:
        """``conn`` has no request in progress from now on (the newest idle one)."""
        self._idle[conn] = None

    def busy(self, conn: Closable) -> None:
        """``conn`` read a request head: never closed for room while it has one."""
        self._idle.pop(conn, None)

    def gone(self, conn: Closable) -> None:
        """``conn`` closed: counted no more."""
        self._idle.pop(conn, None)
        self._leaving.discard(conn)

    def open_places(self, counted: int) -> int:
        """Of ``counted`` connections the server holds, those that keep their place."""
        return counted - len(self._leaving)

    def make_room(self, needed: int) -> bool:
        """Close the ``needed`` connections idle longest; False (and none closed) if
        fewer than that are idle."""
        if needed <= 0:
            return True
        if len(self._idle) < needed:
            return False
        self._close(needed, AT_THE_CAP)
        return True

    def close_idlest(self, most: int) -> int:
        """Close up to ``most`` of the connections idle longest, to free their files;
        return how many were closed."""
        closing = min(most, len(self._idle))
        if closing > 0:
            self._close(closing, OUT_OF_FILES)
        return closing

    def _close(self, count: int, reason: str) -> None:
        for _ in range(count):
            conn = next(iter(self._idle))
            del self._idle[conn]
            self._leaving.add(conn)
            conn.close_for_room()
        if self._counted is not None:
            self._counted(reason, count)
        said = self._said.add(reason, count, time.monotonic())
        if said is not None:
            log.warning(
                "%d idle connections closed to make room (%s)%s: a client "
                "sending on one meets a closed connection, as when keep_alive_timeout_s "
                "closes it; many at once point at a flood of connections that send nothing",
                said[0],
                reason,
                f", since the last such line {said[1]:.0f} s ago" if said[1] else "",
                extra={"event": "closed_for_room", "reason": reason, "closed": said[0]},
            )


@dataclass
class ClosedForRoom:
    """Closings for room not yet said, per reason, and when each reason was last said."""

    unsaid: dict[str, int] = field(default_factory=dict)
    said_at: dict[str, float] = field(default_factory=dict)

    def add(self, reason: str, count: int, now: float) -> tuple[int, float] | None:
        """``count`` closed for ``reason`` at ``now``: the count to say, and over how many
        seconds, when a line is due (the first one at once, then one a minute), else None."""
        unsaid = self.unsaid.get(reason, 0) + count
        last = self.said_at.get(reason)
        if last is not None and now - last < SAY_EVERY_S:
            self.unsaid[reason] = unsaid
            return None
        self.unsaid[reason] = 0
        self.said_at[reason] = now
        return unsaid, 0.0 if last is None else now - last
