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
"""

from __future__ import annotations

import logging

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
