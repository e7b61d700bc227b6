"""OpenTelemetry traces (``effectguard[otel]``): one span per call with the call's
attributes, parented on the incoming trace context and propagated to the upstream."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from effectguard import AsyncGuardTransport
from effectguard.testing import fake_provider, running_proxy

OPENAI = "https://api.openai.com"
CHAT = OPENAI + "/v1/chat/completions"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN}-01"
MakeTransport = Callable[..., AsyncGuardTransport]


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    """An in-memory span exporter."""
    return InMemorySpanExporter()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> TracerProvider:
    """A tracer provider exporting each span to ``exporter`` as it ends."""
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    return tracer_provider


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], **extra}


def _answer() -> dict[str, Any]:
    return {
        "id": "c",
        "object": "chat.completion",
        "model": "gpt-4o-mini",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
    }


def _only_span(exporter: InMemorySpanExporter) -> ReadableSpan:
    spans = exporter.get_finished_spans()
    assert len(spans) == 1, spans
    return spans[0]


async def test_a_call_is_one_span_under_the_callers_trace(
    make_transport: MakeTransport, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """A completed call ends one span parented on the incoming traceparent, with the call
    id, stage, budget, cost and GenAI token counts; the upstream sees the span's context."""
    transport = make_transport(otel=provider, budget="team-a")
    with respx.mock() as mock:
        route = mock.post(CHAT).respond(200, json=_answer())
        async with httpx.AsyncClient(transport=transport) as client:
            response = await client.post(CHAT, json=_chat(), headers={"traceparent": TRACEPARENT})
    assert response.status_code == 200
    span = _only_span(exporter)
    attributes = dict(span.attributes or {})
    assert span.context is not None and span.parent is not None
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert format(span.parent.span_id, "016x") == PARENT_SPAN
    assert attributes["effectguard.call_id"] == response.headers["effectguard-call-id"]
    assert attributes["effectguard.stage"] == "completed"
    assert attributes["effectguard.budget"] == "team-a"
    assert attributes["effectguard.cost_usd"]
    assert attributes["gen_ai.system"] == "openai"
    assert attributes["gen_ai.request.model"] == "gpt-4o-mini"
    assert (attributes["gen_ai.usage.input_tokens"], attributes["gen_ai.usage.output_tokens"]) == (
        7,
        3,
    )
    sent = route.calls.last.request.headers["traceparent"]
    assert sent == f"00-{TRACE_ID}-{format(span.context.span_id, '016x')}-01"


async def test_a_stream_span_ends_when_the_stream_settles(
    make_transport: MakeTransport, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """A streamed call's span is still open after the headers and ends, with its tokens,
    once the stream is read to its end."""

    async def events() -> AsyncIterator[bytes]:
        yield b'data: {"choices":[{"index":0,"delta":{"content":"ok"}}]}\n\n'
        yield b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}\n\n'
        yield b"data: [DONE]\n\n"

    transport = make_transport(otel=provider)
    with respx.mock() as mock:
        sse = {"content-type": "text/event-stream"}
        mock.post(CHAT).mock(return_value=httpx.Response(200, headers=sse, stream=_Stream(events)))
        async with (
            httpx.AsyncClient(transport=transport) as client,
            client.stream("POST", CHAT, json=_chat(stream=True)) as response,
        ):
            assert exporter.get_finished_spans() == ()
            await response.aread()
    span = _only_span(exporter)
    assert span.parent is None  # no incoming context: a root span
    attributes = dict(span.attributes or {})
    assert attributes["effectguard.stage"] == "completed"
    assert attributes["gen_ai.usage.output_tokens"] == 2


async def test_a_refusal_is_a_span_with_an_error(
    make_transport: MakeTransport, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """A refused call's span carries the refusal's type and an error status."""
    transport = make_transport(otel=provider)
    await transport.guard()
    await transport.ledger.set_limit("default", 1)
    async with httpx.AsyncClient(transport=transport) as client:
        response = await client.post(CHAT, json=_chat())
    assert response.status_code == 402
    span = _only_span(exporter)
    assert dict(span.attributes or {})["error.type"] == "budget_exceeded"
    assert span.status.status_code.name == "ERROR"


def test_serve_otel_exports_a_span_per_call(tmp_path: Path) -> None:
    """``effectguard serve --otel`` with the console exporter prints the call's span,
    in the caller's trace."""
    env = {"OTEL_TRACES_EXPORTER": "console"}
    with (
        fake_provider(tmp_path / "receipts.jsonl") as fake,
        running_proxy(
            tmp_path / "l.db", upstreams={"openai": fake.url}, args=["--otel"], env=env
        ) as proxy,
    ):
        response = httpx.post(
            proxy.url + "/openai/v1/chat/completions",
            json=_chat(max_tokens=8),
            headers={"traceparent": TRACEPARENT},
            timeout=10,
        )
    assert response.status_code == 200
    log = proxy.log()
    assert f'"effectguard.call_id": "{response.headers["effectguard-call-id"]}"' in log
    assert f'"trace_id": "0x{TRACE_ID}"' in log


def test_opentelemetry_is_not_imported_unless_enabled(tmp_path: Path) -> None:
    """A transport (and the proxy's app) without ``otel`` never imports opentelemetry."""
    code = (
        "import sys, effectguard\n"
        "from effectguard.ingress.server import create_app\n"
        "from effectguard.config.settings import ServeSettings\n"
        "effectguard.AsyncGuardTransport(ledger='x.db'); create_app(ServeSettings())\n"
        "print('opentelemetry' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    assert out.stdout.strip() == "False"


class _Stream(httpx.AsyncByteStream):
    def __init__(self, chunks: Callable[[], AsyncIterator[bytes]]) -> None:
        self._chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._chunks():
            yield chunk
