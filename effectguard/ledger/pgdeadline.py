"""The PostgreSQL writer's deadline: a connection that gives no answer is shut down.

A connection can go silent with no reset (a middlebox that stopped forwarding, a server
host that vanished): the kernel takes hours to call it dead, and a path whose far end
stops reading still has its kernel acknowledge what was sent, so neither libpq's
``tcp_user_timeout`` nor keepalives end it. The writer thread then waited on it for all
that time, and every write of the replica (admissions, observations, heartbeats) queued
behind it: clients got no answer at all, not the 503 they get when the ledger is down.

The writer is a synchronous connection on a thread of its own, so ``asyncio.wait_for``
cannot bound its calls (as it bounds the reader's, :mod:`effectguard.ledger.pgreader`),
and psycopg has no bound on a statement's wait for its answer: ``cancel_safe`` asks the
server to cancel over a new connection, which a silent path does not carry either, and
the blocked call still waits on the old one. So one watchdog thread per writer looks at
when the writer's outstanding round trip began, and once it waited :data:`WRITE_WAIT_S`
shuts the connection's socket down. The blocked call then fails as on a lost connection
(psycopg marks the connection closed), and the writer's rules for those take over: it
reconnects and finds out whether the batch committed, never running it twice
(:class:`~effectguard.ledger.groupcommit.GroupCommitter`).

The writer's cost is a clock read per round trip; there is no timer per commit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from typing import Any

from effectguard.ledger.daemonthreads import join_ended
from effectguard.ledger.pgdriver import psycopg

log = logging.getLogger("effectguard.ledger")

#: How long the writer waits for one answer before it gives the connection up. Far above
#: any healthy round trip: a statement waits at most ``lock_timeout`` (5 s) for a lock,
#: and a batch that held the batch lock this long would already have made every other
#: replica's batches fail their own 5 s wait. Far below the hours a silent connection
#: takes. And above ``idle_in_transaction_session_timeout`` (5 s): by the time the writer
#: gives up, a live server that heard nothing more has ended the transaction and freed the
#: batch lock, so the check of the batch's fate on a new connection does not wait for it.
WRITE_WAIT_S = 30.0
#: How often the watchdog looks: a wake-up a second per replica, whatever the load.
_LOOK_EVERY_S = 1.0


class WriteDeadline:
    """Shuts down the writer connection's socket when a round trip waits too long."""

    def __init__(self, bound_s: float = WRITE_WAIT_S) -> None:
        self.bound_s = bound_s
        #: When the outstanding round trip began (``None``: the writer is not waiting).
        #: Plain assignments, read by the watchdog without a lock: a float or None
        #: is swapped whole.
        self._since: float | None = None
        self._socket: socket.socket | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, name="effectguard-pg-deadline", daemon=True
        )
        self._thread.start()

    def watch(self, conn: psycopg.Connection[Any]) -> None:
        """From now on ``conn`` is the connection to shut down (called as it opens)."""
        # A duplicate of its descriptor, not the number: libpq closes its own descriptor
        # when it finds the connection dead, and the number may then name another socket.
        fresh = socket.socket(fileno=os.dup(conn.fileno()))
        old, self._socket = self._socket, fresh
        if old is not None:
            old.close()

    def arm(self) -> None:
        """A round trip begins: the clock starts (again)."""
        self._since = time.monotonic()

    def disarm(self) -> None:
        """The writer is not waiting on the connection (between transactions)."""
        self._since = None

    def close(self) -> None:
        """End the watchdog and let go of the socket."""
        self._stopped.set()
        join_ended([self._thread])  # it wakes within a second, unless a log handler hangs
        if self._socket is not None:
            self._socket.close()

    def _watch(self) -> None:
        cut: float | None = None  # the round trip already cut: logged once
        while not self._stopped.wait(_LOOK_EVERY_S):
            since = self._since
            if since is None or since == cut or time.monotonic() - since < self.bound_s:
                continue
            cut, sock = since, self._socket
            if sock is None:
                continue
            log.warning(
                "ledger writer got no answer within %g s; connection shut down",
                self.bound_s,
                extra={"event": "ledger_writer_silent", "seconds": self.bound_s},
            )
            # The writer may have got its answer since we looked: then this cuts a live
            # connection, which its next round trip meets as lost and settles exactly.
            # A socket replaced meanwhile is closed, and refuses (OSError).
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
