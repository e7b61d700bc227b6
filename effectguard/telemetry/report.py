"""One request's story, as the call path learns it: :class:`CallReport`.

The guard opens a report when a request reaches it, fills it in as the request becomes
a call, is dispatched and settles, and hands it to its observer once, when the
outcome is known (for a stream: at the stream's end). Observers read it to write an
access-log line or end a trace span; none of them sees a body or a credential, because
the report holds neither.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from effectguard.errors import Refusal


@dataclass(slots=True)
class CallReport:
    """What one request through the guard did: filled in by the guard, read by observers.

    ``headers`` holds only the incoming trace-context headers (``traceparent`` and
    ``tracestate``), never credentials. ``trace`` is a slot an observer may use for its
    own per-request state (the tracing observer keeps its span there).
    """

    provider: str
    endpoint: str
    budget: str
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    call_id: str | None = None
    model: str = ""
    status: int = 0
    stage: str = ""
    outcome: str = ""
    attempts: int = 0
    cost_nanos: int | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    upstream_s: float = 0.0
    overhead_s: float = 0.0
    error: str | None = None
    message: str | None = None
    #: The proxy key's name (``[[keys]]`` or ``effectguard key new``), if one was presented.
    key: str | None = None
    finished: bool = False
    trace: Any = field(default=None, repr=False)

    def refused(self, refusal: Refusal) -> None:
        """Take the outcome from a refusal (its status, type, stage and call id)."""
        self.status = refusal.status
        self.error = refusal.type
        self.message = refusal.message
        self.outcome = outcome_of(refusal)
        # "refused" only for a request answered before anything was sent: a refusal about
        # a call that was sent names the call's stage, or none when the ledger could not
        # tell it (an observation it failed to record), never "refused".
        refused = self.outcome == "refused"
        self.stage = refusal.stage or self.stage or ("refused" if refused else "")
        self.call_id = refusal.call_id or self.call_id

    def close(self) -> bool:
        """Mark the report finished; False if it already was (report each request once)."""
        if self.finished:
            return False
        self.finished = True
        self.overhead_s = max(0.0, time.perf_counter() - self.started - self.upstream_s)
        return True


#: Error answers the guard gives about a call it sent (or tried to): the request's
#: outcome, not a refusal of it. Everything else it answers on its own is ``refused``.
_SENT_OUTCOMES = {
    "upstream_unreachable": "not_sent",
    "observe_failed": "observe_failed",
    "observe_refused": "fenced",
}


def outcome_of(refusal: Refusal) -> str:
    """The ``outcome`` of a request the guard answered with ``refusal``: a 502 or 504
    ``effect_unknown`` was sent and not observed (a 409 one refuses a resend)."""
    if refusal.type == "effect_unknown" and refusal.status != 409:
        return "effect_unknown"
    return _SENT_OUTCOMES.get(refusal.type, "refused")


#: The incoming headers a report keeps: W3C trace context, nothing else.
TRACE_HEADERS = ("traceparent", "tracestate")
