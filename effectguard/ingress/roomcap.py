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
"""

from __future__ import annotations

from typing import Protocol


class Closable(Protocol):
    """A server connection that can be closed for room."""

    def close_for_room(self) -> None:
        """Close it (a no-op if it is closing already)."""


class IdleConnections:
    """The connections of one server with no request in progress, idle longest first."""

    def __init__(self) -> None:
        self._idle: dict[Closable, None] = {}
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
        for _ in range(needed):
            conn = next(iter(self._idle))
            del self._idle[conn]
            self._leaving.add(conn)
            conn.close_for_room()
        return True
