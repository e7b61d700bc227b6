"""What the fake provider answers, per API: bodies, event streams and errors.

Pure functions of the request (its sequence number, parsed body, size and
whether usage is withheld): the same request gets the same answer, with
deterministic usage (a token per 4 request bytes in, at most 16 out). Used by
:mod:`effectguard.testing.fakeprovider`; imports nothing from effectguard.
"""

from __future__ import annotations

import base64
import json
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["REUSED", "ROUTES", "Reply", "error_reply"]

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
class Reply:
    """A fully computed answer: a stream is a list of SSE events, a body is one chunk."""

    status: int
    content_type: str
    chunks: tuple[bytes, ...]
    stream: bool
    headers: tuple[tuple[str, str], ...] = ()


REUSED = "Keys for idempotent requests can only be used with the same parameters."


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _body(obj: dict[str, Any], usage: dict[str, Any] | None = None) -> Reply:
    """A 200 JSON answer; ``usage`` is added unless it is withheld (None)."""
    if usage is not None:
        obj = obj | {"usage": usage}
    return Reply(200, "application/json", (_json(obj),), False)


def _sse(events: list[tuple[str | None, Any]], done: bool = False) -> Reply:
    chunks = [
        (f"event: {name}\n".encode() if name else b"") + b"data: " + _json(data) + b"\n\n"
        for name, data in events
    ]
    if done:
        chunks.append(b"data: [DONE]\n\n")
    return Reply(200, "text/event-stream", tuple(chunks), True)


def error_reply(path: str, status: int, code: str, message: str) -> Reply:
    """An error in the dialect of ``path`` (Anthropic's for Messages, else OpenAI's)."""
    kind = _ERROR_TYPES.get(status, "api_error")
    if path == "/v1/messages":
        obj: dict[str, Any] = {"type": "error", "error": {"type": kind, "message": message}}
    else:
        obj = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return Reply(status, "application/json", (_json(obj),), False)


def moved_reply(status: int, location: str) -> Reply:
    """A redirect (``status``, a 3xx) to ``location``, as a provider moving an endpoint
    sends it."""
    body = _json({"moved_to": location})
    return Reply(status, "application/json", (body,), False, (("Location", location),))


def _counts(body: dict[str, Any], size: int, *fields: str) -> tuple[int, int]:
    """Deterministic usage: a token per 4 request bytes in, at most 16 out."""
    limit = next((body[f] for f in fields if isinstance(body.get(f), int)), _OUTPUT_TOKENS)
    return max(1, size // 4), max(1, min(limit, _OUTPUT_TOKENS))


def _openai_usage(tokens_in: int, tokens_out: int) -> dict[str, Any]:
    usage = {"prompt_tokens": tokens_in, "completion_tokens": tokens_out}
    return usage | {"total_tokens": tokens_in + tokens_out}


def _chat(seq: int, body: dict[str, Any], size: int, usage: bool) -> Reply:
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


def _completion(seq: int, body: dict[str, Any], size: int, usage: bool) -> Reply:
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
) -> Reply:
    """One SSE chunk per choice, the usage chunk only if asked for, then ``[DONE]``."""
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    if include_usage:
        head = head | {"usage": None}  # as OpenAI does: every chunk carries the key
    chunks = [head | {"choices": [choice]} for choice in choices]
    if include_usage and usage is not None:
        chunks.append(head | {"choices": [], "usage": usage})
    return _sse([(None, chunk) for chunk in chunks], done=True)


def _embeddings(seq: int, body: dict[str, Any], size: int, usage: bool) -> Reply:
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


def _responses(seq: int, body: dict[str, Any], size: int, usage: bool) -> Reply:
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


def _messages(seq: int, body: dict[str, Any], size: int, usage: bool) -> Reply:
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


def _send_tool(seq: int, body: dict[str, Any], size: int, usage: bool) -> Reply:
    return _body({"id": f"send_fake{seq}", "status": "sent"})


def _upload(body: dict[str, Any]) -> dict[str, Any]:
    """The ``file`` part of a multipart body as the fake provider parsed it."""
    upload = body.get("file")
    return upload if isinstance(upload, dict) else {}


def _file(seq: int, body: dict[str, Any], size: int, usage: bool) -> Reply:
    """``POST /v1/files`` (multipart): the FileObject OpenAI answers an upload with."""
    upload = _upload(body)
    return _body(
        {
            "id": f"file-fake{seq}",
            "object": "file",
            "bytes": upload.get("bytes", 0),
            "created_at": int(time.time()),
            "filename": upload.get("filename", "upload"),
            "purpose": body.get("purpose", "batch"),
            "status": "processed",
        }
    )


def _transcription(seq: int, body: dict[str, Any], size: int, usage: bool) -> Reply:
    """``POST /v1/audio/transcriptions`` (multipart): whisper-1's JSON answer has no usage;
    the gpt-4o(-mini)-transcribe models' answer reports token usage, as OpenAI's does
    (``{"type": "tokens", "input_tokens", "input_token_details", "output_tokens",
    "total_tokens"}``): one audio token per 16 bytes of the upload, one output token per
    word of the transcript."""
    upload = _upload(body)
    text = f"fake transcript {seq} of {upload.get('bytes', 0)} bytes"
    if not str(body.get("model", "")).endswith("transcribe"):
        return _body({"text": text})
    audio, words = max(1, int(upload.get("bytes", 0)) // 16), len(text.split())
    details = {"audio_tokens": audio, "text_tokens": 0}
    tokens = {"type": "tokens", "input_tokens": audio, "input_token_details": details}
    tokens |= {"output_tokens": words, "total_tokens": audio + words}
    return _body({"text": text}, tokens if usage else None)


def _batch(seq: int, body: dict[str, Any], size: int, usage: bool) -> Reply:
    """``POST /v1/batches``: a batch is created now; its cost is billed when it runs."""
    return _body(
        {
            "id": f"batch_fake{seq}",
            "object": "batch",
            "endpoint": body.get("endpoint", "/v1/chat/completions"),
            "input_file_id": body.get("input_file_id", ""),
            "completion_window": body.get("completion_window", "24h"),
            "status": "validating",
            "created_at": int(time.time()),
        }
    )


def _charge(seq: int, body: dict[str, Any], size: int, usage: bool) -> Reply:
    """``POST /v1/charges`` (form-encoded, Stripe's shape): the charge, metadata echoed."""
    metadata = {k[9:-1]: v for k, v in body.items() if k.startswith("metadata[") and k[-1] == "]"}
    amount = body.get("amount", "0")
    return _body(
        {
            "id": f"ch_fake{seq}",
            "object": "charge",
            "amount": int(amount) if str(amount).isdigit() else 0,
            "currency": body.get("currency", "usd"),
            "metadata": metadata,
        }
    )


def _model(body: dict[str, Any]) -> Any:
    return body.get("model") or "fake-model"


ROUTES: dict[str, Callable[[int, dict[str, Any], int, bool], Reply]] = {
    "/v1/chat/completions": _chat,
    "/v1/completions": _completion,
    "/v1/embeddings": _embeddings,
    "/v1/responses": _responses,
    "/v1/messages": _messages,
    "/v1/send": _send_tool,
    "/v1/files": _file,
    "/v1/audio/transcriptions": _transcription,
    "/v1/batches": _batch,
    "/v1/charges": _charge,
}
