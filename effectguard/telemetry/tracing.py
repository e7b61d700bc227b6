"""OpenTelemetry traces: one span per request through the guard (``effectguard[otel]``).

:class:`TracingObserver` is an :class:`~effectguard.telemetry.observer.Observer`. When a
request reaches the guard it starts a span whose parent is the trace context the request
carried (``traceparent``/``tracestate``, read with the globally configured propagator);
before each attempt is sent it writes the span's own context into the upstream request,
so the provider's side of the trace hangs under effectguard's span; when the request's
outcome is known (a stream: at its end) it sets the call's attributes and ends the span.

Attribute names follow the OpenTelemetry GenAI semantic conventions where one fits
(``gen_ai.system``, ``gen_ai.request.model``, ``gen_ai.usage.input_tokens``,
``gen_ai.usage.output_tokens``); the rest are ``effectguard.*``.

This module imports ``opentelemetry``; nothing imports it unless tracing is enabled
(``serve --otel``, ``[server] otel = true``, or a transport's ``otel=`` argument).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from effectguard.errors import ConfigError
from effectguard.rules.money import nanos_to_usd
from effectguard.telemetry.observer import NullObserver, Outgoing
from effectguard.telemetry.report import CallReport

__all__ = ["TracingObserver", "install_provider", "operation_name"]

#: The instrumentation scope's name.
SCOPE = "effectguard"

#: GenAI ``gen_ai.operation.name`` by the endpoint's last path segments.
_OPERATIONS = (
    ("/chat/completions", "chat"),
    ("/messages", "chat"),
    ("/responses", "chat"),
    ("/completions", "text_completion"),
    ("/embeddings", "embeddings"),
)


def operation_name(endpoint: str) -> str | None:
    """The GenAI operation an endpoint performs (None: not a model operation we know)."""
    return next((op for suffix, op in _OPERATIONS if endpoint.endswith(suffix)), None)


class TracingObserver(NullObserver):
    """Starts, links and ends one span per request (see the module docstring)."""

    def __init__(self, tracer_provider: trace.TracerProvider | None = None) -> None:
        self._tracer = trace.get_tracer(SCOPE, tracer_provider=tracer_provider)

    def call_started(self, report: CallReport) -> None:
        operation = operation_name(report.endpoint)
        attributes: dict[str, Any] = {
            "gen_ai.system": report.provider,
            "effectguard.budget": report.budget,
            "http.request.method": report.method,
            "url.path": report.endpoint,
        }
        if operation is not None:
            attributes["gen_ai.operation.name"] = operation
        report.trace = self._tracer.start_span(
            f"{operation or report.method} {report.provider}",
            context=propagate.extract(report.headers),
            kind=SpanKind.CLIENT,
            attributes=attributes,
        )

    def dispatching(self, report: CallReport, outgoing: Outgoing) -> None:
        span = report.trace
        if span is None:
            return
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        for name, value in carrier.items():
            outgoing.set_header(name, value)  # replaces the client's own trace context

    def call_finished(self, report: CallReport) -> None:
        span = report.trace
        if span is None:
            return
        report.trace = None
        if report.model:
            span.update_name(f"{operation_name(report.endpoint) or report.method} {report.model}")
        span.set_attributes(_attributes(report))
        if report.error is not None or report.status >= 500:
            span.set_status(Status(StatusCode.ERROR, report.error or str(report.status)))
        span.end()


def _attributes(report: CallReport) -> dict[str, Any]:
    """The finished call's attributes (None values left out: OpenTelemetry refuses them)."""
    cost = None if report.cost_nanos is None else nanos_to_usd(report.cost_nanos)
    values: dict[str, Any] = {
        "effectguard.call_id": report.call_id,
        "effectguard.stage": report.stage or None,
        "effectguard.outcome": report.outcome or None,
        "effectguard.budget": report.budget,
        "effectguard.attempts": report.attempts,
        "effectguard.cost_usd": cost,
        "gen_ai.request.model": report.model or None,
        "gen_ai.usage.input_tokens": report.input_tokens,
        "gen_ai.usage.output_tokens": report.output_tokens,
        "http.response.status_code": report.status or None,
        "error.type": report.error,
    }
    return {k: v for k, v in values.items() if v is not None}


def install_provider(environ: Mapping[str, str] | None = None) -> trace.TracerProvider:
    """The tracer provider of a process effectguard owns (``serve --otel``).

    If the process already has an SDK provider (e.g. under ``opentelemetry-instrument``),
    that one. Otherwise an SDK provider with ``service.name`` from ``OTEL_SERVICE_NAME``
    (default ``effectguard``) exporting in batches to the exporters that
    ``OTEL_TRACES_EXPORTER`` names (default ``otlp``, which needs
    ``opentelemetry-exporter-otlp``; ``console`` prints spans), as the SDK's own
    auto-configuration does. It is installed as the global provider.
    """
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):
        return current
    env = os.environ if environ is None else environ
    names = [n.strip() for n in env.get("OTEL_TRACES_EXPORTER", "otlp").split(",") if n.strip()]
    service = env.get("OTEL_SERVICE_NAME", "effectguard")
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    for name in names:
        if name == "none":
            continue
        found = list(entry_points(group="opentelemetry_traces_exporter", name=name))
        if not found:
            raise ConfigError(
                f"OTEL_TRACES_EXPORTER={name}: no such span exporter is installed "
                "(for otlp: pip install opentelemetry-exporter-otlp)"
            )
        provider.add_span_processor(BatchSpanProcessor(found[0].load()()))
    trace.set_tracer_provider(provider)
    return provider
