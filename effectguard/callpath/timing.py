"""What the call path times (docs/metrics.md, "What a duration covers").

* Every attempt sent upstream is timed once, from the send to its ending, whatever that
  ending is: ``answered`` (the answer read whole, whatever its status; a stream, at its
  terminal event), ``timeout`` (effectguard stopped waiting: a connect or read timeout,
  or a shutdown's drain timeout that cut the call off) or ``error`` (anything else: a
  refused or reset connection, a stream broken part-way, an answer it cannot read).
  Timing only the answered ones hid exactly the upstream that is slow or failing.
* A dispatched request's own time (its total minus its attempts' waits) is timed once,
  when its outcome is known: for a stream, at its end.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import Literal

from effectguard.callpath.exchange import Reply
from effectguard.callpath.wire import timed_out
from effectguard.telemetry.observer import Observer
from effectguard.telemetry.report import CallReport

#: How an attempt ended, as the ``outcome`` label of the upstream histogram.
Ending = Literal["answered", "timeout", "error"]


def failed(exc: BaseException) -> Ending:
    """How an attempt that the transport error ``exc`` ended, ended."""
    return "timeout" if timed_out(exc) else "error"


def waited(
    observer: Observer, provider: str, report: CallReport, sent_at: float, ending: Ending
) -> None:
    """Time one attempt sent at ``sent_at`` (``perf_counter``) that has just ended."""
    seconds = time.perf_counter() - sent_at
    report.upstream_s += seconds
    observer.upstream_seconds(provider, seconds, ending)


def own_time(observer: Observer, report: CallReport) -> None:
    """Time the request's own part, now that its outcome is known."""
    observer.overhead_seconds(max(0.0, time.perf_counter() - report.started - report.upstream_s))


async def own_time_of(dispatch: Awaitable[Reply], observer: Observer, report: CallReport) -> Reply:
    """``dispatch``'s reply, the request's own time taken when it ends, however it ends;
    a streamed reply's is taken at the stream's end (:mod:`effectguard.callpath.stream`)."""
    try:
        reply = await dispatch
    except BaseException:
        own_time(observer, report)
        raise
    if reply.stream is None:
        own_time(observer, report)
    return reply
