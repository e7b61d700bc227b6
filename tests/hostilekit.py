"""A lookup endpoint that misbehaves on purpose, on a raw socket in a thread of its own.

The fake provider's ``/v1/search`` answers like a well-behaved search (or, with
``--search-answer``, like two broken ones); this one answers whatever bytes a test
scripts, HTTP framing included: a status line that lies, headers too long for any
client, a body sent one byte a second, a connection reset halfway through, nothing at
all. It runs in a thread, so a test can point the in-process transport at it and a proxy
subprocess alike, and change the script between lookups. Every request it receives is
counted by its target, so a test can tell that a redirect was never followed.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

from edgekit import read_request

Ending = Literal["close", "reset", "hang"]


@dataclass(frozen=True)
class Script:
    """What the endpoint sends: ``chunks``, ``pause_s`` apart, then how it ends."""

    chunks: tuple[bytes, ...]
    pause_s: float = 0.0
    ending: Ending = "close"


def answer(
    status: int,
    body: bytes,
    *,
    content_type: str | None = "application/json",
    headers: tuple[tuple[str, str], ...] = (),
    reason: str = "Whatever",
) -> bytes:
    """One whole HTTP/1.1 answer, framed by Content-Length."""
    lines = [f"HTTP/1.1 {status} {reason}", f"Content-Length: {len(body)}", "Connection: close"]
    if content_type is not None:
        lines.append(f"Content-Type: {content_type}")
    lines += [f"{name}: {value}" for name, value in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def whole(status: int, body: bytes, **kwargs: object) -> Script:
    """A script that sends one whole answer and closes."""
    return Script((answer(status, body, **kwargs),))  # type: ignore[arg-type]


#: The head of a close-delimited event stream (no length, no chunking).
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
    b"Cache-Control: no-cache\r\nConnection: close\r\n\r\n"
)
#: The usage :func:`slow_chat_stream` reports.
SLOW_USAGE = {"prompt_tokens": 11, "completion_tokens": 8, "total_tokens": 19}


def _chunk(**fields: object) -> bytes:
    doc = {"id": "chatcmpl-slow", "object": "chat.completion.chunk", "model": "gpt-4o-mini"}
    return b"data: " + json.dumps(doc | fields).encode() + b"\n\n"


def slow_chat_stream(events: int, pause_s: float) -> Script:
    """An OpenAI chat stream sent an event at a time, ``pause_s`` apart, as a model
    generating slowly sends it: ``events`` content events, its usage, ``[DONE]``."""
    delta = _chunk(choices=[{"index": 0, "delta": {"content": "word "}, "finish_reason": None}])
    ending = (_chunk(choices=[], usage=SLOW_USAGE), b"data: [DONE]\n\n")
    return Script((STREAM_HEAD, *(delta,) * events, *ending), pause_s=pause_s)


@dataclass
class HostileSearch:
    """The running endpoint: its base URL, the script it follows, the targets it saw."""

    url: str
    script: Script = field(default_factory=lambda: whole(503, b"{}"))
    seen: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def follow(self, script: Script) -> None:
        """Answer every later request with ``script``."""
        with self._lock:
            self.script = script

    def hits(self, path: str) -> int:
        """How many requests reached ``path`` (query string ignored)."""
        with self._lock:
            return sum(1 for target in self.seen if target.partition("?")[0] == path)

    def serve_one(self, conn: socket.socket, stop: threading.Event) -> None:
        """Read one request, record its target, then play the current script."""
        with conn:
            request = read_request(conn)
            target = None if request is None else request.target
            if target is None:
                return
            with self._lock:
                self.seen.append(target)
                script = self.script
            try:
                for n, chunk in enumerate(script.chunks):
                    if n and script.pause_s:
                        time.sleep(script.pause_s)
                    conn.sendall(chunk)
                if script.ending == "reset":
                    # SO_LINGER 0: close sends an RST, not a FIN.
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                elif script.ending == "hang":
                    stop.wait(60)
            except OSError:
                return  # the client went away first (its timeout): nothing to do


@contextmanager
def hostile_search() -> Iterator[HostileSearch]:
    """Run a :class:`HostileSearch` on a free loopback port until the block ends."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    endpoint = HostileSearch(url=f"http://127.0.0.1:{listener.getsockname()[1]}")
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=endpoint.serve_one, args=(conn, stop), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield endpoint
    finally:
        stop.set()
        thread.join(5)
        listener.close()
