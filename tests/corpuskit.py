"""How the bad-input corpus sends its inputs, and the stream of good calls beside it.

Each sender is a small factory returning ``send(url, tag) -> Outcome``: one input
sent to the proxy at ``url`` carrying ``x-fake-tag: TAG``, so that whatever reaches
a provider can be tied back to the corpus row that sent it. Senders speak either
httpx (ordinary requests, streams, a keyed resend) or raw socket bytes (framing
and connection-level abuse that no HTTP client will produce).
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from edgekit import address, parse_answer

CALL_ID = "effectguard-call-id"
TAG = "x-fake-tag"
#: How long any one exchange may take before the sender gives up on it.
PATIENCE_S = 20.0


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the client saw: status (None: closed with no answer) and the error's ``type``."""

    status: int | None
    error_type: str | None = None
    error_param: str | None = None
    call_id: str | None = None
    should_retry: str | None = None
    replayed: bool = False
    #: Raw sends: the proxy closed the connection after at most one answer.
    closed: bool = True
    #: Streams: the client's stream ended with an error rather than a clean finish.
    stream_broke: bool = False
    text: str = ""


Send = Callable[[str, str], Outcome]


def error_field(body: Any, name: str) -> str | None:
    """A field (``type``, ``param``) of effectguard's own account of a refusal: nested in
    ``error`` (the OpenAI, Anthropic and Stripe shapes) or in ``effectguard`` (Postmark's
    and GitHub's; docs/contract.md §9)."""
    for key in ("effectguard", "error"):
        if isinstance(body, dict) and isinstance(body.get(key), dict):
            value = body[key].get(name)
            return value if isinstance(value, str) else None
    return None


def from_response(response: httpx.Response, **extra: Any) -> Outcome:
    """An :class:`Outcome` read off an httpx response."""
    try:
        body = response.json()
    except ValueError:
        body = None
    return Outcome(
        status=response.status_code,
        error_type=error_field(body, "type"),
        error_param=error_field(body, "param"),
        call_id=response.headers.get(CALL_ID),
        should_retry=response.headers.get("x-should-retry"),
        replayed=response.headers.get("effectguard-replayed") == "true",
        text=response.text[:300],
        **extra,
    )


# -- httpx senders ----------------------------------------------------------------------------


def http(
    method: str,
    path: str,
    *,
    json_body: Any = None,
    content: bytes | None = None,
    headers: dict[str, str | bytes] | None = None,
) -> Send:
    """One ordinary request (``content`` is sent as given, ``json_body`` encoded)."""

    def send(url: str, tag: str) -> Outcome:
        sent = {"content-type": "application/json", **(headers or {}), TAG: tag}
        raw = content if content is not None or json_body is None else json.dumps(json_body)
        response = httpx.request(method, url + path, content=raw, headers=sent, timeout=PATIENCE_S)
        return from_response(response)

    return send


def chunked(path: str, body: bytes) -> Send:
    """A POST whose body is sent chunked (no Content-Length), 256 bytes at a time."""

    def send(url: str, tag: str) -> Outcome:
        pieces = (body[i : i + 256] for i in range(0, len(body), 256))
        headers = {"content-type": "application/json", TAG: tag}
        with httpx.Client(timeout=PATIENCE_S) as client:
            request = client.build_request("POST", url + path, content=pieces, headers=headers)
            return from_response(client.send(request))

    return send


def stream(path: str, body: dict[str, Any], headers: dict[str, str]) -> Send:
    """A streamed POST read to its end; notes whether the client's stream broke."""

    def send(url: str, tag: str) -> Outcome:
        with (
            httpx.Client(timeout=PATIENCE_S) as client,
            client.stream("POST", url + path, json=body, headers={**headers, TAG: tag}) as r,
        ):
            try:
                for _ in r.iter_raw():
                    pass
            except httpx.TransportError:
                return from_response_head(r, stream_broke=True)
            return from_response_head(r, stream_broke=False)

    return send


def from_response_head(response: httpx.Response, *, stream_broke: bool) -> Outcome:
    """An :class:`Outcome` from a streamed response's status line and headers only."""
    return Outcome(
        status=response.status_code,
        call_id=response.headers.get(CALL_ID),
        should_retry=response.headers.get("x-should-retry"),
        replayed=response.headers.get("effectguard-replayed") == "true",
        stream_broke=stream_broke,
    )


def resend(path: str, body: dict[str, Any], key: str, behaviour: str) -> Send:
    """A keyed call the provider answers as ``behaviour`` says, then the same call again.

    The outcome is the resend's; both carry the tag, so the receipts count both sends.
    """

    def send(url: str, tag: str) -> Outcome:
        headers = {"Idempotency-Key": key, "x-fake-behaviour": behaviour, TAG: tag}
        with httpx.Client(base_url=url, timeout=PATIENCE_S) as client:
            first = client.post(path, json=body, headers=headers)
            assert first.status_code >= 500, first.text  # the provider's error reached us
            return from_response(client.post(path, json=body, headers=headers))

    return send


# -- raw socket senders -------------------------------------------------------------------------


def raw_post(
    path: str, body: bytes, headers: list[tuple[str, str]] | None = None, *, close: bool = True
) -> Callable[[str], bytes]:
    """A raw HTTP/1.1 POST builder; the path and headers go out exactly as given.

    The tag is added by :func:`raw`. ``close=False`` omits ``Connection: close``, so
    that a proxy which closes the connection does so of its own accord.
    """
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    lines += ["Connection: close"] if close else []
    has_length = any(
        name.lower() in ("content-length", "transfer-encoding") for name, _ in headers or []
    )
    lines += [] if has_length else [f"Content-Length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in headers or []]

    def build(tag: str) -> bytes:
        return ("\r\n".join([*lines, f"{TAG}: {tag}"]) + "\r\n\r\n").encode("utf-8") + body

    return build


def raw(build: Callable[[str], bytes], *, extra_header: bytes = b"") -> Send:
    """Send the bytes ``build(tag)`` makes (plus ``extra_header``, a raw header line)."""

    def send(url: str, tag: str) -> Outcome:
        data = build(tag)
        if extra_header:
            data = data.replace(b"\r\n\r\n", b"\r\n" + extra_header + b"\r\n\r\n", 1)
        with socket.create_connection(address(url), timeout=PATIENCE_S) as sock:
            sock.sendall(data)
            received, closed = read_answer(sock, PATIENCE_S)
        return raw_outcome(received, closed)

    return send


def read_answer(sock: socket.socket, timeout: float) -> tuple[bytes, bool]:
    """What the peer sends until it closes (True) or ``timeout`` passes (False)."""
    received = b""
    deadline = time.monotonic() + timeout
    while (remaining := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([sock], [], [], remaining)
        if not ready:
            return received, False
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return received, True
        if not chunk:
            return received, True
        received += chunk
    return received, False


def raw_outcome(received: bytes, closed: bool) -> Outcome:
    """An :class:`Outcome` from raw bytes; more than one answer counts as not closed."""
    if not received:
        return Outcome(status=None, closed=closed)
    answers = received.count(b"HTTP/1.1 ")
    answer = parse_answer(received)
    try:
        body = answer.json()
    except ValueError:
        body = None
    return Outcome(
        status=answer.status,
        error_type=error_field(body, "type"),
        error_param=error_field(body, "param"),
        call_id=answer.headers.get(CALL_ID),
        should_retry=answer.headers.get("x-should-retry"),
        closed=closed and answers == 1,
        text=received[:300].decode("latin-1"),
    )


def slowloris(path: str, pause_s: float) -> Send:
    """Trickle header lines, one every ``pause_s``, until the proxy answers or hangs up."""

    def send(url: str, tag: str) -> Outcome:
        lines = [f"POST {path} HTTP/1.1\r\n".encode(), f"{TAG}: {tag}\r\n".encode()]
        lines += [b"X-Slow-%d: y\r\n" % i for i in range(200)]
        with socket.create_connection(address(url), timeout=PATIENCE_S) as sock:
            for line in lines:
                try:
                    sock.sendall(line)
                except OSError:
                    break
                ready, _, _ = select.select([sock], [], [], pause_s)
                if ready:  # an answer or a close: the proxy is done with us
                    break
            received, closed = read_answer(sock, PATIENCE_S)
        return raw_outcome(received, closed)

    return send


def huge_header(path: str, megabytes: int) -> Send:
    """A header value of ``megabytes`` MB, sent until the proxy answers or hangs up."""

    def send(url: str, tag: str) -> Outcome:
        piece = b"a" * 65536
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\n{TAG}: {tag}\r\nX-Huge: ".encode()
        with socket.create_connection(address(url), timeout=PATIENCE_S) as sock:
            sock.sendall(head)
            for _ in range(megabytes * 16):
                _, writable, _ = select.select([], [sock], [], PATIENCE_S)
                ready, _, _ = select.select([sock], [], [], 0)
                if ready or not writable:
                    break
                try:
                    sock.sendall(piece)
                except OSError:
                    break
            else:
                raise AssertionError(f"the whole {megabytes} MB header was read")
            received, closed = read_answer(sock, PATIENCE_S)
        return raw_outcome(received, closed)

    return send


def unfinished_body(path: str) -> Send:
    """Headers promising 1000 bytes of body, then only a few, then silence."""

    def send(url: str, tag: str) -> Outcome:
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\n{TAG}: {tag}\r\n"
        head += "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
        with socket.create_connection(address(url), timeout=PATIENCE_S) as sock:
            sock.sendall(head.encode() + b'{"model"')
            received, closed = read_answer(sock, PATIENCE_S)
        return raw_outcome(received, closed)

    return send


# -- the good calls running beside the corpus ---------------------------------------------------


@dataclass
class GoodStream:
    """Threads sending ordinary keyed chat calls in a loop until stopped, keeping every answer."""

    url: str
    path: str
    body: Callable[[str], dict[str, Any]]
    headers: dict[str, str]
    threads: int = 4
    pause_s: float = 0.02
    answers: list[tuple[str, httpx.Response]] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _workers: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        """Start the threads."""
        for n in range(self.threads):
            worker = threading.Thread(target=self._run, args=(n,), daemon=True)
            worker.start()
            self._workers.append(worker)

    def stop(self) -> None:
        """Stop the threads and wait for their calls in progress to be answered."""
        self._stop.set()
        for worker in self._workers:
            worker.join(PATIENCE_S * 3)

    def _run(self, n: int) -> None:
        with httpx.Client(base_url=self.url, timeout=PATIENCE_S * 3) as client:
            i = 0
            while not self._stop.is_set():
                key = f"good-{n}-{i}"
                i += 1
                try:
                    headers = {**self.headers, "Idempotency-Key": key}
                    response = client.post(self.path, json=self.body(key), headers=headers)
                except httpx.HTTPError as exc:
                    self.errors.append(exc)
                    continue
                self.answers.append((key, response))
                self._stop.wait(self.pause_s)  # pacing on a shared machine, not a timing claim
