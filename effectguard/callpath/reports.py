"""The guard's per-request :class:`~effectguard.telemetry.report.CallReport`: opening one
for a request, and filling one from a call answered out of the ledger."""

from __future__ import annotations

from effectguard.callpath.exchange import Outbound
from effectguard.providers import Provider
from effectguard.rules.workstate import WorkState
from effectguard.telemetry.report import TRACE_HEADERS, CallReport


def open_report(provider: Provider, request: Outbound, budget: str) -> CallReport:
    """A fresh report for ``request`` (keeping only its trace-context headers)."""
    headers = {}
    for name in TRACE_HEADERS:
        value = request.header(name)
        if value is not None:
            headers[name] = value
    return CallReport(
        provider=provider.name,
        endpoint=request.path,
        budget=budget,
        method=request.method,
        headers=headers,
    )


def from_state(report: CallReport, state: WorkState | None, outcome: str) -> None:
    """Fill ``report`` from a call that is answered from the ledger (replayed or joined)."""
    report.outcome = outcome
    if state is not None:
        report.stage, report.attempts, report.cost_nanos = state.stage, state.attempts, state.cost
