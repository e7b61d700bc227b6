"""Before ``effectguard reconcile`` decides: take over the workers whose process is gone.

The takeover itself is :mod:`effectguard.callpath.takeover`, which the operator page's
decisions share; here is what the command adds: the ledger named by its URL, the sweep's
log lines left out of the terminal, a line per call taken over, and the refusal to
decide at once a call whose owner may still be running.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterable, Iterator

from effectguard.callpath import takeover
from effectguard.callpath.recovery import lock_dir_for, lock_required
from effectguard.errors import ReconcileError
from effectguard.ledger import Ledger
from effectguard.rules.guidance import show_command, taken_over_not_decided
from effectguard.rules.liveness import may_still_answer
from effectguard.rules.workstate import WorkState


async def gone_owners_here(
    ledger: Ledger, ledger_url: str, calls: Iterable[WorkState]
) -> dict[str, str]:
    """:func:`effectguard.callpath.takeover.gone_owners_here` for the ledger at
    ``ledger_url``: call id -> why its owner will not finish it."""
    return await takeover.gone_owners_here(ledger, lock_dir_for(ledger_url), calls)


async def take_over_gone(ledger: Ledger, ledger_url: str) -> dict[str, str]:
    """:func:`effectguard.callpath.takeover.take_over_gone` for every call in flight of
    the ledger at ``ledger_url``, the sweep's lines left out (:func:`say_taken_over`
    says what it did)."""
    with _sweep_lines_left_out():
        return await takeover.take_over_gone(
            ledger, lock_dir_for(ledger_url), lock_required=lock_required(ledger_url)
        )


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
    then = f"look for a late answer with `{show_command(call_id)}`, then run this command again"
    raise ReconcileError(taken_over_not_decided(call_id, str(why), then), call_id=call_id)
