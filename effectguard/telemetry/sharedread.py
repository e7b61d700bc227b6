"""One ledger read shared by concurrent callers, never one that began before a caller asked.

Fifty Prometheus scrapers (or a scrape loop per dashboard) each reading the ledger's
gauges at once took a proxy from 140 to 15 requests/s. :class:`SharedRead` runs one
read at a time: callers that arrive while no read has begun wait for the same read;
callers that arrive while a read is running wait for the *next* one, which begins once
the running read ends and which all of them share. So a caller's figures are never read
before it asked: a scrape that follows a change it made (or saw) sees that change
(docs/metrics.md), and at most two reads are ever running or waiting, however many call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


class SharedRead:
    """Runs ``read`` for callers, one read at a time, shared as described above."""

    def __init__(self, read: Callable[[], Awaitable[None]]) -> None:
        self._read = read
        self._running: asyncio.Task[None] | None = None
        self._next: asyncio.Task[None] | None = None

    async def __call__(self) -> None:
        """Wait for a read that begins after this call; raise what that read raised."""
        loop = asyncio.get_running_loop()
        if self._next is not None and (self._next.done() or self._next.get_loop() is not loop):
            # A task of a loop that ended (a test's, a restarted server's) never runs
            # here, and one cancelled while it waited (the loop shutting down) never reads.
            self._next = self._running = None
        if self._next is None:
            self._next = loop.create_task(self._after(self._running))
        # Shielded: a scraper that hangs up must not cancel the read the others wait for.
        await asyncio.shield(self._next)

    async def _after(self, previous: asyncio.Task[None] | None) -> None:
        if previous is not None and previous.get_loop() is asyncio.get_running_loop():
            await asyncio.wait([previous])  # its outcome is its own callers'
        # From here the read has begun: later callers queue the next one.
        self._next, self._running = None, asyncio.current_task()
        try:
            await self._read()
        finally:
            if self._running is asyncio.current_task():
                self._running = None
