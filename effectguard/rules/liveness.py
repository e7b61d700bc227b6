"""Whether the worker that owns a call in flight is gone, and why. Pure.

A call stays ``in_flight`` until a recovery sweep records ``attempt.interrupted``
(contract §7), and a sweep runs only in a process that writes: ``serve``, a transport,
``effectguard reconcile``. After a crash with nothing restarted, ``show`` says whether
waiting would help, by the same two proofs a sweep takes: the owner's liveness lock is
free on this host, or its lease ran out by the ledger's clock.
"""

from __future__ import annotations

from typing import Final

#: The owner's liveness lock is free: its process is gone (a sweep's own words).
PROCESS_GONE: Final = "process gone"
#: The owner has not renewed its lease in time, by the ledger's clock.
LEASE_EXPIRED: Final = "lease expired"
#: The owner was taken over already, but its call was not yet marked (a sweep that could
#: not commit the marking retries it on each sweep).
TAKEN_OVER: Final = "taken over"


def owner_gone(*, live: bool, lease_expires: float, now: float, lock_free: bool) -> str | None:
    """Why a call's owner will not finish it (None: it may, so wait).

    ``live``: the owner's row is not fenced; ``lock_free``: its liveness lock was found
    free (only a process on the owner's host can tell; elsewhere pass False)."""
    if not live:
        return TAKEN_OVER
    if lock_free:
        return PROCESS_GONE
    if lease_expires < now:
        return LEASE_EXPIRED
    return None


def may_still_answer(why: str | None) -> bool:
    """Whether an owner given up for ``why`` may still be running (paused, overloaded, on
    another host): its lease ran out, but nothing proves its process is gone. Such a
    worker may yet receive the provider's answer, which the ledger then keeps as evidence
    (a late answer); a decision made before it could arrive would ignore it."""
    return why == LEASE_EXPIRED
