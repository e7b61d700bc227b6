"""Before ``effectguard reconcile`` decides: take over the workers whose process is gone.

After a crash with nothing restarted on the ledger, the dead process's calls stay
``in_flight``: only a sweep marks them ``effect_unknown`` (contract §7), and a sweep runs
in a process that writes. ``reconcile`` writes, so it is one: when a call in flight has
an owner that will not finish it, the command registers as a worker, sweeps once as a
``serve`` start would, and stops. With no such call it writes nothing of its own.

A call taken over because its owner's lease ran out is not decided in the same command:
that owner may be alive (paused, overloaded, on another host) and still receive the
provider's answer, kept then as evidence (operations.md, step 3). Deciding at once would
ignore the answer by construction, and a "not applied" it contradicts frees the key for
a second effect.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
from collections.abc import Iterable, Iterator
from typing import Final

from effectguard.callpath.liveness import gone_owners
from effectguard.callpath.recovery import WorkerRuntime, lock_dir_for
from effectguard.errors import ReconcileError
from effectguard.ledger import Ledger
from effectguard.rules.guidance import show_command
from effectguard.rules.liveness import LEASE_EXPIRED, may_still_answer
from effectguard.rules.workstate import WorkState

#: Calls in flight looked at (far more than are ever in flight at once).
IN_FLIGHT_READ: Final = 100_000


async def gone_owners_here(
    ledger: Ledger, ledger_url: str, calls: Iterable[WorkState]
) -> dict[str, str]:
    """:func:`~effectguard.callpath.liveness.gone_owners` as a process on this host judges
    them, for the ledger at ``ledger_url``: call id -> why its owner will not finish it."""
    return await gone_owners(ledger, calls, lock_dir_for(ledger_url), socket.gethostname())


async def take_over_gone(ledger: Ledger, ledger_url: str) -> dict[str, str]:
    """Sweep once if a call in flight has an owner that is gone; returns the calls the
    sweep marked effect unknown, each with why its owner was given up."""
    in_flight = await ledger.calls(stage="in_flight", limit=IN_FLIGHT_READ)
    gone = await gone_owners_here(ledger, ledger_url, in_flight)
    if not gone:
        return {}
    worker = WorkerRuntime(ledger, lock_dir=lock_dir_for(ledger_url))
    await worker.register()
    try:
        with _sweep_lines_left_out():
            marked = await worker.sweep()
    finally:
        await worker.stop()
    # A call not judged above had an owner that was live a moment ago: its lease ran out
    # between that look and the sweep (a paused worker). Said so, it is not decided in
    # this command (refuse_deciding_at_once), as an owner given up by lease never is.
    return {call_id: gone.get(call_id, LEASE_EXPIRED) for call_id in marked}


class _LeaveOutSweepLines(logging.Filter):
    """Drops the sweep's line for each call it marked (``event=sweep``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(record, "event", None) != "sweep"


@contextlib.contextmanager
def _sweep_lines_left_out() -> Iterator[None]:
    """While the command sweeps: a server's log line per marked call would reach the
    terminal raw (the CLI configures no logging), beside :func:`say_taken_over`'s line for
    the same call. Other warnings of the sweep still show."""
    recovery_log = logging.getLogger("effectguard.callpath.recovery")
    left_out = _LeaveOutSweepLines()
    recovery_log.addFilter(left_out)
    try:
        yield
    finally:
        recovery_log.removeFilter(left_out)


def say_taken_over(marked: dict[str, str]) -> None:
    """One line on stderr per call the sweep marked (stdout stays the command's answer)."""
    for call_id, why in marked.items():
        print(
            f"effectguard: call {call_id} was in flight on a worker that is gone ({why}); "
            "taken over, it is effect_unknown now",
            file=sys.stderr,
        )


def refuse_deciding_at_once(marked: dict[str, str], call_id: str) -> None:
    """A :class:`ReconcileError` if ``call_id`` was just taken over from an owner that may
    still be running: the person looks for its late answer before deciding."""
    why = marked.get(call_id)
    if not may_still_answer(why):
        return
    raise ReconcileError(
        f"call {call_id} was taken over just now ({why}) and nothing was decided: its "
        "worker may still be running (paused, overloaded, or on another host) and receive "
        "the provider's answer, which is then kept as evidence. Check at the provider and "
        f"look for a late answer with `{show_command(call_id)}`, then run this command again",
        call_id=call_id,
    )
