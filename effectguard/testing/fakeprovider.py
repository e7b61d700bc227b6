"""A synthetic OpenAI- and Anthropic-compatible provider that counts its effects.

``effectguard fake-provider --port N --receipts FILE`` (or ``python -m
effectguard.testing.fakeprovider ...``) serves the chat, completions, embeddings,
Responses and Anthropic Messages APIs plus a flat tool (``POST /v1/send``).
Every POST it receives appends one JSON line to the receipt log and fsyncs it
*before* the first response byte goes out, so the log is the ground truth of
how many effects reached the provider, whatever the ledger says.

Switches are CLI defaults that a request can override with a header, so one
process can serve many test cases:

===================  ======================  ==========================================
flag                 header                  effect
===================  ======================  ==========================================
``--delay S``        ``x-fake-delay``        sleep S seconds after the receipt is durable
``--error-status N`` ``x-fake-status``       answer N with a provider-shaped error body
``--break-after K``  ``x-fake-break-after``  send K body chunks (SSE events), then drop
                                             the connection without the terminal event
``--idempotent``     --                      Stripe-like dedup on ``Idempotency-Key``
--                   ``x-fake-usage``        ``missing`` omits usage from the answer
===================  ======================  ==========================================

A receipt line is ``{"seq", "ts", "method", "path", "idempotency_key",
"body_sha256", "deduped", "model", "status"}``. With ``--idempotent`` a repeated
key with the same path and body replays the first answer byte for byte (a
``deduped`` receipt); with another body it is refused with 422. A non-stream
answer is one chunk, so ``break-after 0`` sends only its headers.

Per request, ``x-fake-behaviour`` chooses delay, status and how the answer
ends (whole, no answer at all, a clean cut, a reset) in one header; see
:mod:`effectguard.testing.fakebehaviour`. Its receipts add ``"behaviour"`` (what
was applied, ``""`` for a plain answer) and ``"tag"`` (the ``x-fake-tag`` header).

``GET /ops/{key}`` is a lookup read path: ``applied`` is true iff a request with
that ``Idempotency-Key`` was received and not deduplicated (whatever its status).
``GET /v1/models`` is read-only. This module imports nothing from effectguard but
its sibling ``fakebehaviour``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import os
import signal
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from effectguard.testing.fakebehaviour import (
    BEHAVIOUR_HEADER,
    TAG_HEADER,
    Behaviour,
    UseCounter,
    parse,
    send_answer,
)
from effectguard.testing.fakebehaviour import Answer as _Reply

__all__ = ["FakeSettings", "ReceiptLog", "add_arguments", "create_app", "main", "run"]

_OUTPUT_TOKENS = 16
_EMBEDDING_DIM = 8
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    529: "overloaded_error",
}


@dataclass(frozen=True, slots=True)
class FakeSettings:
    """The process-wide defaults; per-request ``x-fake-*`` headers override them."""

    receipts: Path | None = None
    delay: float = 0.0
    idempotent: bool = False
    error_status: int | None = None
    break_after: int | None = None


class ReceiptLog:
    """An append-only JSON-lines file; :meth:`append` returns once the line is fsync'd.

    Lines are written as they come and made durable by one inline fsync that
    covers every line written so far, so requests that arrive together share it.
    (Measured: faster here than an fsync in a worker thread, whose hand-off
    costs more than the fsync it moves off the loop.)
    """

    def __init__(self, path: Path) -> None:
        try:
            with path.open("rb") as existing:
                self._seq = sum(1 for _ in existing)
        except FileNotFoundError:
            self._seq = 0
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._written = self._durable = self._seq

    def next_seq(self) -> int:
        """Reserve the next sequence number (numbers continue an existing file)."""
        self._seq += 1
        return self._seq

    async def append(self, seq: int, record: dict[str, Any]) -> None:
        """Write ``record`` as line ``seq`` and return once it is on disk."""
        os.write(self._fd, json.dumps(record, separators=(",", ":")).encode() + b"\n")
        self._written = max(self._written, seq)
        # One loop turn lets the requests that are ready now add their lines,
        # so that one fsync covers them all.
        await asyncio.sleep(0)
        if self._durable < seq:
            target = self._written
            os.fsync(self._fd)
            self._durable = target

    def close(self) -> None:
        """Close the file descriptor."""
        os.close(self._fd)


class _Provider:
    """The handlers and their state: dedup store, applied keys, the receipt log."""

    def __init__(self, settings: FakeSettings) -> None:
        self.settings = settings
        self.log = ReceiptLog(settings.receipts) if settings.receipts else None
        self._seq = 0
        self._stored: dict[str, tuple[str, _Reply]] = {}
        self._applied: set[str] = set()
        self._uses = UseCounter()

    def _next_seq(self) -> int:
        if self.log is not None:
            return self.log.next_seq()
        self._seq += 1
        return self._seq

    async def effect(self, request: web.Request) -> web.StreamResponse:
        """Handle every POST route: receipt, dedup, switches, answer."""
        raw = await request.read()
        body = _parse(raw)
        headers = request.headers
        path = request.path
        digest = hashlib.sha256(raw).hexdigest()
        key = headers.get("idempotency-key")
        behaviour = _behaviour(headers, self.settings)
        if not self._uses.applies(behaviour):
            behaviour = Behaviour()
        seq = self._next_seq()
        # From here to the receipt write there is no await: the dedup check and
        # the store of the first answer are atomic with respect to other requests.
        deduped = False
        stored = self._stored.get(key) if key is not None and self.settings.idempotent else None
        if stored is not None:
            fingerprint, reply = stored
            if fingerprint == f"{path} {digest}":
                deduped = True
            else:
                reply = _error(path, 422, "idempotency_key_reused", _REUSED)
        else:
            status = behaviour.status
            if status is not None and status >= 400:
                reply = _error(path, status, "fake_error", f"fake provider answered {status}")
            else:
                reply = _ROUTES[path](seq, body, len(raw), headers.get("x-fake-usage") != "missing")
            if key is not None:
                self._applied.add(key)
                if self.settings.idempotent:
                    self._stored[key] = (f"{path} {digest}", reply)
        if self.log is not None:
            record = {
                "seq": seq,
                "ts": time.time(),
                "method": request.method,
                "path": path,
                "idempotency_key": key,
                "body_sha256": digest,
                "deduped": deduped,
                "model": body.get("model"),
                "status": reply.status,
                "behaviour": behaviour.render(),
                "tag": headers.get(TAG_HEADER),
            }
            await self.log.append(seq, record)
        if behaviour.delay:
            await asyncio.sleep(behaviour.delay)
        return await send_answer(
            request,
            reply,
            behaviour.ending,
            behaviour.after,
        )

    async def lookup(self, request: web.Request) -> web.Response:
        """``GET /ops/{key}``: was an operation with this idempotency key applied?"""
        key = request.match_info["key"]
        return web.json_response({"key": key, "applied": key in self._applied})

    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``: one model, in a shape both SDKs can parse."""
        model = {"id": "fake-model", "object": "model", "created": 0, "owned_by": "effectguard"}
        model |= {"type": "model", "display_name": "Fake", "created_at": "1970-01-01T00:00:00Z"}
        page = {"object": "list", "data": [model], "has_more": False}
        return web.json_response(page | {"first_id": "fake-model", "last_id": "fake-model"})


def _parse(raw: bytes) -> dict[str, Any]:
    """The request's JSON object, or ``{}``: the fake answers, it does not validate."""
    try:
        body = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _behaviour(headers: Any, settings: FakeSettings) -> Behaviour:
    """The request's behaviour: ``x-fake-behaviour``, else the older one-switch headers."""
    spec = headers.get(BEHAVIOUR_HEADER)
    if spec is not None:
        return parse(spec)
    status = _int_header(headers, "x-fake-status", settings.error_status)
    delay = _float_header(headers, "x-fake-delay", settings.delay)
    after = _int_header(headers, "x-fake-break-after", settings.break_after)
    return Behaviour(
        delay=delay or None,
        status=status,
        ending="whole" if after is None else "break",
        after=after or 0,
    )


def _int_header(headers: Any, name: str, default: int | None) -> int | None:
    value = headers.get(name)
    return int(value) if value is not None else default


def _float_header(headers: Any, name: str, default: float) -> float:
    value = headers.get(name)
    return float(value) if value is not None else default


# -- response bodies -------------------------------------------------------

_REUSED = "Keys for idempotent requests can only be used with the same parameters."


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _body(obj: dict[str, Any], usage: dict[str, Any] | None = None) -> _Reply:
    """A 200 JSON answer; ``usage`` is added unless it is withheld (None)."""
    if usage is not None:
        obj = obj | {"usage": usage}
    return _Reply(200, "application/json", (_json(obj),), False)


def _sse(events: list[tuple[str | None, Any]], done: bool = False) -> _Reply:
    chunks = [
        (f"event: {name}\n".encode() if name else b"") + b"data: " + _json(data) + b"\n\n"
        for name, data in events
    ]
    if done:
        chunks.append(b"data: [DONE]\n\n")
    return _Reply(200, "text/event-stream", tuple(chunks), True)


def _error(path: str, status: int, code: str, message: str) -> _Reply:
    kind = _ERROR_TYPES.get(status, "api_error")
    if path == "/v1/messages":
        obj: dict[str, Any] = {"type": "error", "error": {"type": kind, "message": message}}
    else:
        obj = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return _Reply(status, "application/json", (_json(obj),), False)


def _counts(body: dict[str, Any], size: int, *fields: str) -> tuple[int, int]:
    """Deterministic usage: a token per 4 request bytes in, at most 16 out."""
    limit = next((body[f] for f in fields if isinstance(body.get(f), int)), _OUTPUT_TOKENS)
    return max(1, size // 4), max(1, min(limit, _OUTPUT_TOKENS))


def _openai_usage(tokens_in: int, tokens_out: int) -> dict[str, Any]:
    usage = {"prompt_tokens": tokens_in, "completion_tokens": tokens_out}
    return usage | {"total_tokens": tokens_in + tokens_out}


def _chat(seq: int, body: dict[str, Any], size: int, usage: bool) -> _Reply:
    tokens_in, tokens_out = _counts(body, size, "max_completion_tokens", "max_tokens")
    head = {"id": f"chatcmpl-fake{seq}", "created": int(time.time()), "model": _model(body)}
    usage_obj = _openai_usage(tokens_in, tokens_out) if usage else None
    if not body.get("stream"):
        message = {"role": "assistant", "content": "ok " * tokens_out, "refusal": None}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}
        return _body(head | {"object": "chat.completion", "choices": [choice]}, usage_obj)
    deltas = [{"role": "assistant", "content": ""}] + [{"content": "ok "}] * tokens_out + [{}]
    choices: list[dict[str, Any]] = [
        {"index": 0, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas
    ]
    choices[-1]["finish_reason"] = "stop"
    return _openai_stream(head | {"object": "chat.completion.chunk"}, choices, body, usage_obj)


def _completion(seq: int, body: dict[str, Any], size: int, usage: bool) -> _Reply:
    tokens_in, tokens_out = _counts(body, size, "max_tokens")
    head = {"id": f"cmpl-fake{seq}", "object": "text_completion", "created": int(time.time())}
    head["model"] = _model(body)
    usage_obj = _openai_usage(tokens_in, tokens_out) if usage else None
    stream = bool(body.get("stream"))
    texts = ["ok "] * tokens_out + [""] if stream else ["ok " * tokens_out]
    choices: list[dict[str, Any]] = [
        {"index": 0, "text": t, "logprobs": None, "finish_reason": None} for t in texts
    ]
    choices[-1]["finish_reason"] = "stop"
    if not stream:
        return _body(head | {"choices": choices}, usage_obj)
    return _openai_stream(head, choices, body, usage_obj)


def _openai_stream(
    head: dict[str, Any], choices: list[Any], body: dict[str, Any], usage: dict[str, Any] | None
) -> _Reply:
    """One SSE chunk per choice, the usage chunk only if asked for, then ``[DONE]``."""
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    if include_usage:
        head = head | {"usage": None}  # as OpenAI does: every chunk carries the key
    chunks = [head | {"choices": [choice]} for choice in choices]
    if include_usage and usage is not None:
        chunks.append(head | {"choices": [], "usage": usage})
    return _sse([(None, chunk) for chunk in chunks], done=True)


def _embeddings(seq: int, body: dict[str, Any], size: int, usage: bool) -> _Reply:
    inputs = body.get("input")
    # A list of strings is a batch; a string or a list of token ids is one input.
    batch = isinstance(inputs, list) and not all(isinstance(item, int) for item in inputs)
    count = len(inputs) if batch and isinstance(inputs, list) else 1
    vector = [round(0.1 * (i + 1), 1) for i in range(_EMBEDDING_DIM)]
    encoded: Any = vector
    if body.get("encoding_format") == "base64":
        encoded = base64.b64encode(struct.pack(f"<{_EMBEDDING_DIM}f", *vector)).decode()
    data = [{"object": "embedding", "index": i, "embedding": encoded} for i in range(count)]
    obj = {"object": "list", "data": data, "model": _model(body)}
    tokens_in = max(1, size // 4)
    return _body(obj, {"prompt_tokens": tokens_in, "total_tokens": tokens_in} if usage else None)


def _responses(seq: int, body: dict[str, Any], size: int, usage: bool) -> _Reply:
    tokens_in, tokens_out = _counts(body, size, "max_output_tokens")
    text, item_id = "ok " * tokens_out, f"msg_fake{seq}"
    part = {"type": "output_text", "text": text, "annotations": []}
    item: dict[str, Any] = {"id": item_id, "type": "message", "status": "completed"}
    item["role"] = "assistant"
    item["content"] = [part]
    response: dict[str, Any] = {"id": f"resp_fake{seq}", "object": "response"}
    response |= {"created_at": int(time.time()), "status": "completed", "model": _model(body)}
    response |= {"output": [item], "error": None, "incomplete_details": None, "tools": []}
    response |= {"parallel_tool_calls": True, "tool_choice": "auto"}
    if usage:
        response["usage"] = {
            "input_tokens": tokens_in,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": tokens_out,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": tokens_in + tokens_out,
        }
    if not body.get("stream"):
        return _body(response)
    started = response | {"status": "in_progress", "output": []}
    started.pop("usage", None)
    at = {"item_id": item_id, "output_index": 0, "content_index": 0}
    events: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"response": started}),
        ("response.output_item.added", {"output_index": 0, "item": item | {"content": []}}),
        ("response.content_part.added", at | {"part": part | {"text": ""}}),
    ]
    events += [("response.output_text.delta", at | {"delta": "ok ", "logprobs": []})] * tokens_out
    events += [
        ("response.output_text.done", at | {"text": text, "logprobs": []}),
        ("response.content_part.done", at | {"part": part}),
        ("response.output_item.done", {"output_index": 0, "item": item}),
        ("response.completed", {"response": response}),
    ]
    return _sse([(n, {"type": n, "sequence_number": i} | d) for i, (n, d) in enumerate(events)])


def _messages(seq: int, body: dict[str, Any], size: int, usage: bool) -> _Reply:
    tokens_in, tokens_out = _counts(body, size, "max_tokens")
    message: dict[str, Any] = {"id": f"msg_fake{seq}", "type": "message", "role": "assistant"}
    message |= {"model": _model(body), "stop_sequence": None}
    full_usage = {
        "input_tokens": tokens_in,
        "output_tokens": tokens_out,
        "cache_read_input_tokens": 0,
        "cache_creation_input_tokens": 0,
    }
    if not body.get("stream"):
        message |= {"content": [{"type": "text", "text": "ok " * tokens_out}]}
        message |= {"stop_reason": "end_turn"}
        return _body(message, full_usage if usage else None)
    start = message | {"content": [], "stop_reason": None}
    if usage:
        start["usage"] = full_usage | {"output_tokens": 1}
    delta = {"type": "text_delta", "text": "ok "}
    stop: dict[str, Any] = {"delta": {"stop_reason": "end_turn", "stop_sequence": None}}
    if usage:
        stop["usage"] = {"output_tokens": tokens_out}
    events: list[tuple[str, dict[str, Any]]] = [
        ("message_start", {"message": start}),
        ("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
        *[("content_block_delta", {"index": 0, "delta": delta})] * tokens_out,
        ("content_block_stop", {"index": 0}),
        ("message_delta", stop),
        ("message_stop", {}),
    ]
    return _sse([(name, {"type": name} | data) for name, data in events])


def _send_tool(seq: int, body: dict[str, Any], size: int, usage: bool) -> _Reply:
    return _body({"id": f"send_fake{seq}", "status": "sent"})


def _model(body: dict[str, Any]) -> Any:
    return body.get("model") or "fake-model"


_ROUTES: dict[str, Callable[[int, dict[str, Any], int, bool], _Reply]] = {
    "/v1/chat/completions": _chat,
    "/v1/completions": _completion,
    "/v1/embeddings": _embeddings,
    "/v1/responses": _responses,
    "/v1/messages": _messages,
    "/v1/send": _send_tool,
}


# -- the process -----------------------------------------------------------


def create_app(settings: FakeSettings) -> web.Application:
    """Build the fake provider's aiohttp application (the receipt log opens here)."""
    provider = _Provider(settings)
    app = web.Application()
    for path in _ROUTES:
        app.router.add_post(path, provider.effect)
    app.router.add_get("/v1/models", provider.models)
    app.router.add_get("/ops/{key}", provider.lookup)

    async def close_log(_: web.Application) -> None:
        if provider.log is not None:
            provider.log.close()

    app.on_cleanup.append(close_log)
    return app


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``fake-provider`` options to ``parser``."""
    parser.add_argument("--port", type=int, required=True, help="TCP port (0 picks a free one)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--receipts", type=Path, help="append one fsync'd line per POST here")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds to wait before answering")
    parser.add_argument(
        "--idempotent", action="store_true", help="dedup repeated Idempotency-Key requests"
    )
    parser.add_argument("--error-status", type=int, help="answer every POST with this status")
    parser.add_argument("--break-after", type=int, help="drop streams after K events")


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT; print the listening URL first. Returns the exit code."""
    settings = FakeSettings(
        receipts=args.receipts,
        delay=args.delay,
        idempotent=args.idempotent,
        error_status=args.error_status,
        break_after=args.break_after,
    )
    asyncio.run(_serve(create_app(settings), args.host, args.port))
    return 0


async def _serve(app: web.Application, host: str, port: int) -> None:
    # No access log (the hot path stays lean); a short grace period for stop.
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        bound = runner.addresses[0][1]
        shown = f"[{host}]" if ":" in host else host
        print(f"fake-provider listening on http://{shown}:{bound}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``python -m effectguard.testing.fakeprovider``."""
    parser = argparse.ArgumentParser(prog="fake-provider", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
