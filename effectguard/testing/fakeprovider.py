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
``--cut-stream-clean K``  (``close=K``)      send streams close-delimited (no length, no
                                             chunking), K events, then close cleanly (a
                                             FIN) without the terminal event
``--idempotent``     --                      Stripe-like dedup on ``Idempotency-Key``
``--search-lag S``   --                      ``GET /v1/search`` finds an operation only
                                             S seconds after it was applied
``--lookup-key K``   --                      ``GET /v1/search`` needs ``Bearer K`` (else 401)
``--search-jitter S`` --                     ``GET /v1/search`` waits a random 0..S seconds
                                             before it looks (some searches are slow)
``--search-answer M`` --                     ``GET /v1/search`` misbehaves: ``html`` answers
                                             200 with an HTML error page, ``no-data`` 200
                                             with JSON lacking ``data`` (as a broken search
                                             or a proxy in the way might)
--                   ``x-fake-usage``        ``missing`` omits usage from the answer
===================  ======================  ==========================================

A receipt line is ``{"seq", "ts", "method", "path", "idempotency_key",
"body_sha256", "deduped", "model", "status"}``. With ``--idempotent`` a repeated
key with the same path and body replays the first answer byte for byte (a
``deduped`` receipt); with another body it is refused with 422. A 409 or 429 answer is
not saved under its key (Stripe's rate limiter answers before its idempotency layer, and
a 409 for a key still executing is not saved either), so a repeat is worked on. A non-stream
answer is one chunk, so ``break-after 0`` sends only its headers.

``GET /ops/{key}`` is a lookup read path: ``applied`` is true iff a request with
that ``Idempotency-Key`` was received and not deduplicated (whatever its status).
``GET /v1/search?op=ID`` (or ``POST /v1/search`` with the form field ``op=ID``: a
missing field is 400) is a Stripe-like search by operation id: a request that carried
``x-effectguard-op: ID`` (or ``metadata.effectguard_op`` in its JSON body) and was answered
with a success is found, as ``{"data": [<the answer's JSON object>]}``, once it is older
than the search lag; until then, and for unknown ids, ``{"data": []}``. Receipts add
``"op"``. ``GET /v1/models`` is read-only (it honours ``trickle`` alone). The answers
themselves are built in :mod:`effectguard.testing.fakeanswers`, and sent (whole, cut,
reset or not at all) by :mod:`effectguard.testing.fakebehaviour`. Per request, ``x-fake-behaviour``
chooses delay, status and how the answer ends in one header; its receipts add
``"behaviour"`` (what was applied, ``""`` for a plain answer) and ``"tag"`` (the
``x-fake-tag`` header). None of these modules imports anything else from effectguard.
"""

from __future__ import annotations

import argparse
import asyncio
import email.policy
import hashlib
import json
import os
import random
import signal
import time
from dataclasses import dataclass
from email.parser import BytesParser
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from aiohttp import web

from effectguard.testing.fakeanswers import REUSED, ROUTES, Reply, error_reply, moved_reply
from effectguard.testing.fakebehaviour import (
    BEHAVIOUR_HEADER,
    TAG_HEADER,
    Behaviour,
    UseCounter,
    parse,
    send_answer,
)

__all__ = ["FakeSettings", "ReceiptLog", "add_arguments", "create_app", "main", "run"]

#: Answers a Stripe-like idempotency layer does not save under the key: a 429 (its rate
#: limiters run first) and a 409 (a request with the key still executing), both
#: https://docs.stripe.com/error-low-level and /idempotency (read 2026-12-01). Saved, a
#: 429 was replayed to every retry under the key, which then never went through.
UNSAVED = frozenset({409, 429})


@dataclass(frozen=True, slots=True)
class FakeSettings:
    """The process-wide defaults; per-request ``x-fake-*`` headers override them."""

    receipts: Path | None = None
    delay: float = 0.0
    idempotent: bool = False
    error_status: int | None = None
    break_after: int | None = None
    cut_stream_clean: int | None = None
    search_lag: float = 0.0
    #: Each search waits a random 0..search_jitter seconds before it looks.
    search_jitter: float = 0.0
    lookup_key: str | None = None
    #: ``html`` or ``no-data``: a 200 search answer that is not a well-formed result.
    search_answer: str | None = None


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
        self._stored: dict[str, tuple[str, Reply]] = {}
        self._applied: set[str] = set()
        #: Operation id -> (when it was applied, monotonic; the answer's JSON object).
        self._ops: dict[str, tuple[float, Any]] = {}
        self._uses = UseCounter()

    def _next_seq(self) -> int:
        if self.log is not None:
            return self.log.next_seq()
        self._seq += 1
        return self._seq

    async def effect(self, request: web.Request) -> web.StreamResponse:
        """Handle every POST route: receipt, dedup, switches, answer."""
        raw = await request.read()
        body = _parse(raw, headers=request.headers)
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
                reply = error_reply(path, 422, "idempotency_key_reused", REUSED)
        else:
            status = behaviour.status
            if behaviour.moved is not None:
                target = behaviour.moved
                if target.startswith("/"):
                    target = f"{request.scheme}://{request.host}{target}"
                reply = moved_reply(status or 307, target)
            elif status is not None and status >= 400:
                reply = error_reply(path, status, "fake_error", f"fake provider answered {status}")
            else:
                reply = ROUTES[path](seq, body, len(raw), headers.get("x-fake-usage") != "missing")
            op = _op_id(headers, body)
            if op is not None and reply.status < 400 and not reply.stream:
                self._ops[op] = (time.monotonic(), json.loads(b"".join(reply.chunks)))
            if key is not None:
                self._applied.add(key)
                if self.settings.idempotent and reply.status not in UNSAVED:
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
                "op": _op_id(headers, body),
            }
            await self.log.append(seq, record)
        if behaviour.delay:
            await asyncio.sleep(behaviour.delay)
        return await send_answer(request, reply, behaviour)

    async def lookup(self, request: web.Request) -> web.Response:
        """``GET /ops/{key}``: was an operation with this idempotency key applied?"""
        key = request.match_info["key"]
        return web.json_response({"key": key, "applied": key in self._applied})

    async def search(self, request: web.Request) -> web.Response:
        """``GET /v1/search?op=ID`` (or ``POST`` with a form ``op=ID``): the operation's
        object, once the search has caught up."""
        wanted = self.settings.lookup_key
        if wanted is not None and request.headers.get("authorization") != f"Bearer {wanted}":
            error = {"type": "invalid_request_error", "message": "no valid API key"}
            return web.json_response({"error": error}, status=401)
        if self.settings.search_answer == "html":
            page = "<html><body><h1>502 Bad Gateway</h1></body></html>"
            return web.Response(text=page, content_type="text/html")
        if self.settings.search_answer == "no-data":
            return web.json_response({"object": "error_page", "message": "try again later"})
        wanted_op = request.query.get("op", "")
        if request.method == "POST":
            form_type = "application/x-www-form-urlencoded"
            form = await request.post() if request.content_type == form_type else {}
            if "op" not in form:
                error = {"type": "invalid_request_error", "message": "missing form field op"}
                return web.json_response({"error": error}, status=400)
            wanted_op = str(form["op"])
        if self.settings.search_jitter:
            await asyncio.sleep(random.uniform(0, self.settings.search_jitter))
        found = self._ops.get(wanted_op)
        if found is None or time.monotonic() - found[0] < self.settings.search_lag:
            return web.json_response({"object": "search_result", "data": []})
        return web.json_response({"object": "search_result", "data": [found[1]]})

    async def models(self, request: web.Request) -> web.StreamResponse:
        """``GET /v1/models``: one model, in a shape both SDKs can parse. Only ``trickle``
        of ``x-fake-behaviour`` applies (a read has no receipt); with ``?stream=true`` the
        page is sent as an event stream (one event, then ``[DONE]``)."""
        model = {"id": "fake-model", "object": "model", "created": 0, "owned_by": "effectguard"}
        model |= {"type": "model", "display_name": "Fake", "created_at": "1970-01-01T00:00:00Z"}
        page = {"object": "list", "data": [model], "has_more": False}
        page |= {"first_id": "fake-model", "last_id": "fake-model"}
        trickle = _behaviour(request.headers, self.settings).trickle
        if trickle is None:
            return web.json_response(page)
        body = json.dumps(page).encode()
        if request.query.get("stream") == "true":
            reply = Reply(200, "text/event-stream", (b"data: " + body + b"\n\n",), True)
        else:
            reply = Reply(200, "application/json", (body,), False)
        return await send_answer(request, reply, Behaviour(trickle=trickle))


def _parse(raw: bytes, headers: Any) -> dict[str, Any]:
    """The request's fields (JSON, form or multipart), or ``{}``: the fake answers, it does
    not validate. Parsed with the stdlib alone, apart from the parser effectguard uses, so
    the fake stays an independent witness; a multipart file is ``{"filename", "bytes"}``."""
    content_type = headers.get("content-type", "")
    media = content_type.split(";", 1)[0].strip().lower()
    if media == "application/x-www-form-urlencoded":
        return dict(parse_qsl(raw.decode("utf-8", "replace"), keep_blank_values=True))
    if media == "multipart/form-data":
        return _multipart(raw, content_type)
    try:
        body = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _multipart(raw: bytes, content_type: str) -> dict[str, Any]:
    """A multipart body's fields, read by the ``email`` package's MIME parser."""
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode()
    message = BytesParser(policy=email.policy.HTTP).parsebytes(head + raw)
    fields: dict[str, Any] = {}
    for part in message.iter_parts() if message.is_multipart() else ():
        name = part.get_param("name", header="content-disposition")
        payload = part.get_payload(decode=True)
        content = payload if isinstance(payload, bytes) else b""
        filename = part.get_filename()
        if not isinstance(name, str):
            continue
        if filename is not None:
            fields[name] = {"filename": filename, "bytes": len(content)}
        else:
            fields[name] = content.decode("utf-8", "replace")
    return fields


def _op_id(headers: Any, body: dict[str, Any]) -> str | None:
    """The effectguard operation id a request carried: its header, or its metadata field."""
    op = headers.get("x-effectguard-op")
    metadata = body.get("metadata")
    if op is None and isinstance(metadata, dict):
        op = metadata.get("effectguard_op")
    if op is None:  # a form body spells the field as Stripe does
        op = body.get("metadata[effectguard_op]")
    return op if isinstance(op, str) else None


def _int_header(headers: Any, name: str, default: int | None) -> int | None:
    value = headers.get(name)
    return int(value) if value is not None else default


def _float_header(headers: Any, name: str, default: float) -> float:
    value = headers.get(name)
    return float(value) if value is not None else default


def _behaviour(headers: Any, settings: FakeSettings) -> Behaviour:
    """The request's behaviour: ``x-fake-behaviour``, else the older one-switch headers."""
    spec = headers.get(BEHAVIOUR_HEADER)
    if spec is not None:
        return parse(spec)
    status = _int_header(headers, "x-fake-status", settings.error_status)
    delay = _float_header(headers, "x-fake-delay", settings.delay)
    after = _int_header(headers, "x-fake-break-after", settings.break_after)
    if after is None and settings.cut_stream_clean is not None:
        return Behaviour(
            delay=delay or None, status=status, ending="close", after=settings.cut_stream_clean
        )
    return Behaviour(
        delay=delay or None,
        status=status,
        ending="whole" if after is None else "break",
        after=after or 0,
    )


# -- the process -----------------------------------------------------------


def create_app(settings: FakeSettings) -> web.Application:
    """Build the fake provider's aiohttp application (the receipt log opens here)."""
    provider = _Provider(settings)
    app = web.Application()
    for path in ROUTES:
        app.router.add_post(path, provider.effect)
    app.router.add_get("/v1/models", provider.models)
    app.router.add_get("/ops/{key}", provider.lookup)
    app.router.add_get("/v1/search", provider.search)
    app.router.add_post("/v1/search", provider.search)  # a POST search: no effect, no receipt

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
    parser.add_argument(
        "--cut-stream-clean",
        type=int,
        metavar="K",
        help="send streams without length or chunking and close cleanly after K events",
    )
    parser.add_argument(
        "--search-lag", type=float, default=0.0, help="seconds before /v1/search finds an op"
    )
    parser.add_argument(
        "--search-jitter",
        type=float,
        default=0.0,
        help="each /v1/search waits a random 0..S seconds first",
    )
    parser.add_argument("--lookup-key", help="the API key /v1/search requires (Bearer)")
    parser.add_argument(
        "--search-answer",
        choices=("html", "no-data"),
        help="/v1/search answers 200 with an HTML page, or JSON without data",
    )


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT; print the listening URL first. Returns the exit code."""
    settings = FakeSettings(
        receipts=args.receipts,
        delay=args.delay,
        idempotent=args.idempotent,
        error_status=args.error_status,
        break_after=args.break_after,
        cut_stream_clean=args.cut_stream_clean,
        search_lag=args.search_lag,
        search_jitter=args.search_jitter,
        lookup_key=args.lookup_key,
        search_answer=args.search_answer,
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
