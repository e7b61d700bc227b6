"""What the guard tells the caller of a request as soon as it knows it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from effectguard.callpath.exchange import Reply
from effectguard.callpath.orphans import RetryKey
from effectguard.telemetry.report import CallReport


@dataclass
class Ticket:
    """What the guard tells the caller of :meth:`Guard.handle` as soon as it knows it.

    ``call_id`` is set once the request is a call (admitted, replayed or joined);
    ``dispatch`` once this request dispatches it. The proxy names the call id in any
    answer it must give on its own (an internal error, the end of a shutdown drain).
    """

    call_id: str | None = None
    dispatch: asyncio.Future[Reply] | None = field(default=None, repr=False)
    #: How a key-less request's retry would match it (callpath/orphans); None if keyed.
    retry_key: RetryKey | None = None
    #: With ``report_later`` (the proxy asks for it), the request's report, left for the
    #: caller to hand on once it has written the answer and knows whether the client left
    #: (a guarded stream still reports itself at its end).
    report: CallReport | None = None
    report_later: bool = False
