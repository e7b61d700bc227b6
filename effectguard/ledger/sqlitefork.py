"""A process forked while a SQLite ledger was open here may not open one (docs/contract.md §3.8).

SQLite keeps in the process's memory the locks its connections hold on each file (shared
by every connection of the process to it) and the mutexes its threads hold. A fork copies
that memory as it was at that instant, without the threads that would release them. A
transport open in the parent renews its lease, checkpoints and commits on threads of its
own, so at any instant one may be inside SQLite: a child that then opened the ledger found
it "database is locked" for ever about half the time (measured: 19 of 40 forks from a
parent with three threads calling), and could hang. It is refused at open instead, every
time, before any SQLite call, with what to do; a store opened before the fork and used in
the child (an open ``Ledger`` passed to its transports) is refused at its first use.
"""

from __future__ import annotations

import os
import weakref

from effectguard.errors import LedgerUnavailable

#: The SQLite stores open in this process (held weakly: one collected closed its files).
_OPEN: weakref.WeakSet[Opened] = weakref.WeakSet()
#: The ledgers (real paths) open in this process or an ancestor when it was forked (kept
#: for good: the copied state stays in this process's memory, and a grandchild's).
_FORKED_WITH: list[str] = []
_AT_FORK: list[bool] = []  # registered once, at the first open (no work at import)


class Opened:
    """One open SQLite store, as this module tracks it."""

    __slots__ = ("__weakref__", "forked", "path")

    def __init__(self, path: str) -> None:
        self.path = path
        #: Set in a child forked while it was open: its connections and threads are the
        #: parent's (the threads did not come along: a read waited on one for ever).
        self.forked = False


def opened(path: str) -> Opened:
    """Note a store of ``path`` opened in this process; hand the token to :func:`closed`."""
    if not _AT_FORK:
        os.register_at_fork(after_in_child=_forked)
        _AT_FORK.append(True)
    token = Opened(os.path.realpath(path))
    _OPEN.add(token)
    return token


def closed(token: Opened) -> None:
    """The store ``token`` stands for has closed its connections."""
    _OPEN.discard(token)


def _forked() -> None:
    """In a child just forked: remember which ledgers the parent had open."""
    for token in list(_OPEN):
        token.forked = True
        if token.path not in _FORKED_WITH:
            _FORKED_WITH.append(token.path)
    _OPEN.clear()


def refuse_if_forked_open(path: str) -> None:
    """Refuse to open ``path`` in a process forked while it was open (here, or in an
    ancestor). Another file is let be: the locks SQLite keeps are per file, and a test
    suite that forks would otherwise be refused for a ledger an earlier test left open."""
    if os.path.realpath(path) in _FORKED_WITH:
        raise forked_open(f"cannot open ledger {path} in this process")


def forked_open(what: str) -> LedgerUnavailable:
    """The refusal of ``what`` in a process forked while a SQLite ledger was open (a store
    opened before the fork, used in the child, is refused with it too)."""
    return LedgerUnavailable(
        f"{what}: it was forked while its parent had that SQLite ledger open, "
        "and SQLite's locks and "
        "mutexes do not survive a fork (opened or used here, the ledger could stay locked "
        "for ever, or hang); nothing was sent. Start worker processes with spawn or forkserver "
        '(multiprocessing.get_context("spawn")), make the first call in each worker '
        "(gunicorn --preload, Celery prefork: a transport made at import but not used "
        "before the fork is fine), or close the parent's transport before forking. A "
        "PostgreSQL ledger has no such limit"
    )
