"""Shared pieces of the front-edge tests: a recording upstream and raw HTTP exchanges.

The recording upstream answers every method on every path with an OpenAI chat
completion (or a flat tool answer) and records the method, the path and the raw
header bytes, so a test can prove that nothing arrived, or exactly what did.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

#: Headers the recording upstream adds to its answers, as a misbehaving provider might.
UPSTREAM_OWN_HEADERS = {"effectguard-replayed": "true", "effectguard-call-id": "upstream-lie"}


@dataclass
class Seen:
    """What one request to the recording upstream looked like."""

    method: str
    path: str
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)


class _Recorder(BaseHTTPRequestHandler):
    seen: list[Seen]

    def _answer(self) -> None:
        length = int(self.headers.get("content-length", "0"))
        self.rfile.read(length)
        # http.server decodes header bytes as latin-1: encoding back gives the wire bytes.
        raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()]
        type(self).seen.append(Seen(self.command, self.path, raw))
        body = json.dumps(
            {
                "id": "chatcmpl-rec",
                "object": "chat.completion",
                "model": "gpt-4o-mini",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            }
        ).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        for name, value in UPSTREAM_OWN_HEADERS.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_DELETE = _answer

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""


@contextlib.contextmanager
def recording_upstream() -> Iterator[tuple[str, list[Seen]]]:
    """A threaded HTTP server on 127.0.0.1 recording every request it receives."""
    seen: list[Seen] = []
    handler = type("Recorder", (_Recorder,), {"seen": seen})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def address(url: str) -> tuple[str, int]:
    """``http://host:port`` as a socket address."""
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


@dataclass
class RawAnswer:
    """One HTTP/1.1 response read off a raw socket."""

    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        """The body as JSON."""
        return json.loads(self.body)


def parse_answer(data: bytes) -> RawAnswer:
    """Parse the first response in ``data``."""
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = headers.get("content-length")
    return RawAnswer(status, headers, body[: int(length)] if length else body)


def exchange(url: str, request: bytes, timeout: float = 15.0) -> RawAnswer:
    """Send ``request`` (with ``Connection: close``) on a fresh connection; read the answer."""
    with socket.create_connection(address(url), timeout=timeout) as sock:
        sock.sendall(request)
        return parse_answer(read_until_closed(sock, timeout))


def read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    """Everything the peer sends until it closes the connection (or ``timeout`` passes)."""
    received = b""
    deadline = time.monotonic() + timeout
    while (remaining := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([sock], [], [], remaining)
        if not ready:
            break
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        received += chunk
    return received


def post(path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    """A raw HTTP/1.1 POST, the path sent exactly as given (no client normalization)."""
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close"]
    lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@dataclass
class RawRequest:
    """One HTTP/1.1 request read off a raw socket by an upstream a test plays."""

    line: bytes
    fields: dict[bytes, bytes]  # names lower-cased
    body: bytes

    @property
    def target(self) -> str:
        """The request target (path and query)."""
        return self.line.split(b" ")[1].decode("latin-1")


def read_request(conn: socket.socket, timeout: float = 10.0) -> RawRequest | None:
    """One whole request (head, and a Content-Length body) from ``conn``; None if the
    client went away or fell silent first."""
    conn.settimeout(timeout)
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        line, *rest = head.split(b"\r\n")
        fields = {
            name.strip().lower(): value.strip()
            for name, _, value in (field.partition(b":") for field in rest)
        }
        while len(body) < int(fields.get(b"content-length", b"0")):
            chunk = conn.recv(65536)
            if not chunk:
                return None
            body += chunk
    except OSError:
        return None
    return RawRequest(line, fields, body)


class LoopbackServer:
    """A listener on a loopback port that accepts from a thread of its own while it is
    entered, handing each connection to :meth:`accepted`."""

    def __init__(self) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        # shutdown wakes the thread blocked in accept(); close alone does not (Linux).
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()
        self._thread.join(timeout=5)

    def accepted(self, conn: socket.socket) -> None:
        """Serve ``conn``, just accepted (on the accepting thread)."""
        raise NotImplementedError

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed by __exit__
            self.accepted(conn)


class SocketUpstream(LoopbackServer):
    """An upstream a test plays on a raw loopback socket: each connection's one request
    is read whole and handed to :meth:`answer`; the connection is closed after it.
    Connections are served one after another, or each in a thread of its own when
    ``concurrent`` (so one answer that takes long holds up no other)."""

    #: Whether each connection is served in a thread of its own.
    concurrent = False

    def answer(self, conn: socket.socket, request: RawRequest) -> None:
        """Write what this upstream answers ``request`` with (nothing, by default)."""

    def accepted(self, conn: socket.socket) -> None:
        if self.concurrent:
            threading.Thread(target=self._serve_one, args=(conn,), daemon=True).start()
        else:
            self._serve_one(conn)

    def _serve_one(self, conn: socket.socket) -> None:
        with conn:
            request = read_request(conn)
            if request is not None:
                self.answer(conn, request)
