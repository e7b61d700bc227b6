"""The open-files limit ``serve`` needs for ``max_connections``.

Every client connection is a file descriptor, and so is the upstream connection its
call makes (and a spooled upload's file): at ``max_connections`` the proxy holds about
twice that many, plus the ledger's files and its listeners. The soft limit many systems
start a process with (1024) is below that for the default ``max_connections`` (1024),
and a proxy at its limit fails quietly: the event loop accepts and at once closes each
new connection (the client sees a reset, and no line is logged), and a call already
admitted cannot connect upstream. :func:`raise_open_files` lifts the soft limit to the
hard one at start, as Go's runtime does for every program, and warns when even the hard
limit is below what ``max_connections`` needs.

Should the limit be reached all the same, the loop turns connections away in C (libuv
accepts each and closes it, and tells no one), so there is nothing to catch: while it
serves, :func:`watch_open_files` checks once a second whether a file can still be
opened, and logs a warning when it cannot (again at most every
:data:`WARN_EVERY_S` while that lasts) and a line when it can again. While it cannot,
it closes the client connections idle longest (never one with a request in progress),
as nginx closes idle kept-alive connections when accept meets EMFILE: a flood of silent
connections larger than the limit gave way to nobody until its sockets closed.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("effectguard.ingress.fdlimit")

#: Descriptors one connection may hold: the client's socket and its call's upstream one.
PER_CONNECTION = 2
#: Descriptors beside the connections: the ledger's files, listeners, the event loop's.
SPARE = 128


def needed(max_connections: int) -> int:
    """The open-files limit ``max_connections`` connections need (0: no bound, none)."""
    return PER_CONNECTION * max_connections + SPARE if max_connections else 0


def raise_open_files(max_connections: int) -> int:
    """Lift the soft ``RLIMIT_NOFILE`` to the hard limit; return the soft limit now.

    Logs a warning when it stays below :func:`needed` for ``max_connections``. A no-op
    where the platform has no such limit (returns 0).
    """
    try:
        import resource
    except ImportError:  # not on a POSIX system
        return 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed(max_connections)
    # An unlimited hard limit cannot be the soft one (the kernel caps it): ask for what
    # the connections need instead.
    target = hard if hard != resource.RLIM_INFINITY else max(soft, want)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (OSError, ValueError) as exc:
            log.debug("could not raise the open-files limit to %d: %s", target, exc)
    if soft != resource.RLIM_INFINITY and soft < want:
        log.warning(
            "the open-files limit is %d, below the %d that max_connections = %d needs: "
            "past it, new connections are dropped without an answer and calls cannot "
            "reach their provider; raise the hard limit (ulimit -Hn, LimitNOFILE=) or "
            "lower max_connections",
            soft,
            want,
            max_connections,
        )
    return int(soft)


#: How often a serving proxy checks that it can still open a file (one open and close).
CHECK_EVERY_S = 1.0
#: ... and while it cannot: each check that finds the table full closes idle connections.
FULL_CHECK_EVERY_S = 0.1
#: While the limit stays reached, its warning is repeated at most this often.
WARN_EVERY_S = 60.0
#: The limit is said to be free again only once no check has found it reached for this
#: long: closing idle connections frees files that a flood takes again, and each turn
#: would otherwise be a warning and an all-clear.
FREE_AFTER_S = 10.0


def files_to_free(limit: int) -> int:
    """How many idle connections one check that finds the table full closes: enough for
    a few calls (each takes a client's file and an upstream one), not the whole flood."""
    return max(8, limit // 16)


def table_full() -> bool:
    """Whether this process can open no more files (EMFILE; ENFILE: the system's table)."""
    try:
        fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        return exc.errno in (errno.EMFILE, errno.ENFILE)
    os.close(fd)
    return False


@dataclass
class LimitReached:
    """What the checks have found: since when the limit is reached (None: it is not),
    and when that was last said."""

    since: float | None = None
    said: float = 0.0
    #: Since when the checks have found files free while the limit was reached.
    free_since: float | None = None

    def step(self, now: float, full: bool) -> str | None:
        """A check at ``now``: ``"reached"``, ``"still"`` or ``"free"`` (once no check has
        found the limit reached for :data:`FREE_AFTER_S`) when a line is due, else None."""
        if not full:
            if self.since is None:
                return None
            if self.free_since is None:
                self.free_since = now
            if now - self.free_since < FREE_AFTER_S:
                return None
            self.since = self.free_since = None
            return "free"
        self.free_since = None
        if self.since is None:
            self.since = self.said = now
            return "reached"
        if now - self.said >= WARN_EVERY_S:
            self.said = now
            return "still"
        return None


async def watch_open_files(
    connections: Callable[[], tuple[int, int]],
    make_room: Callable[[int], int] | None = None,
) -> None:
    """Check every :data:`CHECK_EVERY_S` that a file can be opened; log when it cannot
    and when it can again. ``connections``: the client connections open now, and how many
    of them have no request in progress (a flood of silent ones shows there);
    ``make_room``: closes up to that many idle connections, idle longest first."""
    state = LimitReached()
    full = False
    while True:
        await asyncio.sleep(FULL_CHECK_EVERY_S if full else CHECK_EVERY_S)
        now = time.monotonic()
        since = state.since
        full = table_full()
        if full and make_room is not None:
            make_room(files_to_free(_soft_limit_number()))
        said = state.step(now, full)
        if said is None:
            continue
        if said == "free":
            log.info("open files are free again, after %.0f s at the limit", now - (since or now))
            continue
        open_now, idle = connections()
        log.warning(
            "the open-files limit (%s) is reached%s: new connections are closed without "
            "an answer and calls cannot reach their provider; %d client connections are "
            "open, %d of them with no request in progress; raise the hard limit (ulimit "
            "-Hn, LimitNOFILE=) or lower max_connections",
            _soft_limit(),
            "" if said == "reached" else f", for {now - (since or now):.0f} s",
            open_now,
            idle,
        )


def _soft_limit() -> str:
    limit = _soft_limit_number()
    return str(limit) if limit else "unknown"


def _soft_limit_number() -> int:
    """The soft open-files limit now (``prlimit`` may change it while serving); 0 if
    the platform has none."""
    try:
        import resource
    except ImportError:  # not on a POSIX system
        return 0
    return int(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
