"""The observers a way in hands its guard: metrics, access logs, traces.

Built once at the edge from settings (the proxy) or arguments (the transports). The
tracing observer's module, and with it OpenTelemetry, is imported only when asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from effectguard.telemetry.logs import LogObserver
from effectguard.telemetry.observer import Observer, combine

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider


def tracing(otel: bool | TracerProvider | None) -> Observer | None:
    """The tracing observer for ``otel`` (None when tracing is off)."""
    if otel is None or otel is False:
        return None
    from effectguard.telemetry.tracing import TracingObserver

    return TracingObserver(None if otel is True else otel)


def proxy_observer(metrics: Any, otel: bool) -> Observer | None:
    """The proxy's observer: its metrics (if any), its access log, and traces if enabled
    (the proxy owns its process, so it installs the SDK's tracer provider itself)."""
    traces = None
    if otel:
        from effectguard.telemetry.tracing import install_provider

        traces = tracing(install_provider())
    return combine(metrics.observer if metrics is not None else None, LogObserver(), traces)
