"""Answers an upstream should not give, through a real ``effectguard serve``.

A raw-socket upstream writes, per request, the answer its ``x-answer`` header names and
closes the connection. Each case checks what the client sees, the call's stage in the
ledger, that the provider got the request once, that ``verify`` passes, and that a
provider's fault is not counted as effectguard's own (``effectguard_internal_errors``).

* an event stream whose media type is spelled in capitals (media types are
  case-insensitive) is a stream: cut before its terminal event it is broken, never a
  completed call; whole, its usage is read;
* a 2xx answer without a content type to a stream request is read as that stream;
* a final status outside 200-599 (999, or 101 to a POST) is not an HTTP answer, nor is
  one coded with a transfer coding nobody asked for (``gzip, chunked``: its body
  arrives still coded): the effect is unknown, and a keyed resend is refused, not
  replayed;
* an answer the leg cannot parse (a NUL in a header, 4,097 headers, a bad chunk size, a
  body short of its length or past it) is told by what could not be read, never as a 400;
* chunked framing that breaks after the answer began ends the call at once;
* a usage event behind the terminal event is not charged.
"""

from __future__ import annotations

import gzip
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from edgekit import RawRequest, SocketUpstream

from effectguard.ops.cli import main as cli_main
from effectguard.testing import running_proxy

pytestmark = pytest.mark.slow

CHAT = "/openai/v1/chat/completions"
CALL_ID = "effectguard-call-id"

_EVENT = (
    b'data: {"id":"c1","object":"chat.completion.chunk",'
    b'"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
)
_USAGE = (
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[],'
    b'"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}\n\n'
)
_DONE = b"data: [DONE]\n\n"
_GZIPPED = gzip.compress(
    b'{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}'
)

_BODY = b'{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}'


def _whole(fields: bytes, body: bytes = _BODY, media: bytes = b"application/json") -> bytes:
    """A 200 answer of ``body`` with the extra header ``fields`` (CRLF-ended lines)."""
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: " + media + b"\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n" % len(body) + fields + b"\r\n" + body
    )


_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_HINTS = b"HTTP/1.1 103 Early Hints\r\nLink: </x>; rel=preload\r\n\r\n"

#: What the upstream writes for each ``x-answer`` (then it closes the connection).
ANSWERS: dict[str, bytes] = {
    "good": _whole(b""),
    "16-interim": _CONTINUE * 8 + _HINTS * 8 + _whole(b""),
    "17-interim": _CONTINUE * 8 + _HINTS * 9 + _whole(b""),
    "control-byte-header": _whole(b"X-Odd: a\x01b\r\nX-Del: a\x7fb\r\nX-Fine: ok\r\n"),
    "cr-stream": _whole(b"", (_EVENT + _USAGE + _DONE).replace(b"\n", b"\r"), b"text/event-stream"),
    "cookies": _whole(b"Set-Cookie: s=SECRET-COOKIE; Path=/\r\nSet-Cookie2: a=SECRET-COOKIE2\r\n"),
    "control-byte-header-stream": _whole(
        b"X-Odd: a\x01b\r\n", _EVENT + _USAGE + _DONE, b"text/event-stream"
    ),
    "capital-stream-cut": b"HTTP/1.1 200 OK\r\nContent-Type: Text/Event-Stream; charset=utf-8\r\n"
    b"Connection: close\r\n\r\n" + _EVENT + _EVENT,
    "capital-stream-whole": b"HTTP/1.1 200 OK\r\nContent-Type: TEXT/EVENT-STREAM\r\n"
    b"Connection: close\r\n\r\n" + _EVENT + _USAGE + _DONE,
    "untyped-stream-cut": b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + _EVENT,
    "repeated-header": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
    b"X-Dup: one\r\nX-Dup: two\r\nConnection: close\r\n"
    b"Content-Length: 81\r\n\r\n"
    b'{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}',
    "status-999": b"HTTP/1.1 999 Odd\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
    b"Connection: close\r\n\r\n{}",
    "status-101": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: odd\r\nConnection: upgrade\r\n\r\n"
    b"{}",
    "body-past-its-length": _whole(b"", _BODY, b"application/json").replace(
        b"Content-Length: %d" % len(_BODY), b"Content-Length: %d" % (len(_BODY) - 20)
    ),
    "usage-after-done": _whole(b"", _EVENT + _DONE + _USAGE, b"text/event-stream"),
    "event-after-done": _whole(b"", _EVENT + _USAGE + _DONE + _EVENT, b"text/event-stream"),
    "usage-choices-null": _whole(
        b"",
        _EVENT + _USAGE.replace(b'"choices":[]', b'"choices":null') + _DONE,
        b"text/event-stream",
    ),
    "usage-empty": _whole(
        b"", _EVENT + b'data: {"id":"c1","choices":[],"usage":{}}\n\n' + _DONE, b"text/event-stream"
    ),
    "usage-no-choices": _whole(
        b"", _EVENT + _USAGE.replace(b'"choices":[],', b"") + _DONE, b"text/event-stream"
    ),
    "usage-not-json": _whole(b"", _EVENT + _USAGE[:60] + b"\n\n" + _DONE, b"text/event-stream"),
    "nul-header": _whole(b"X-Odd: a\x00b\r\n"),
    "4097-headers": _whole(b"".join(b"X-H%d: v\r\n" % n for n in range(4097))),
    "bad-chunk-size": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
    b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n10\r\n" + _BODY[:16] + b"\r\nzz\r\n",
    "body-short-of-length": _whole(b"", _BODY, b"application/json").replace(
        b"Content-Length: %d" % len(_BODY), b"Content-Length: %d" % (len(_BODY) + 50)
    ),
    "gzip-transfer-coded": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
    b"Transfer-Encoding: gzip, chunked\r\nConnection: close\r\n\r\n"
    + f"{len(_GZIPPED):x}\r\n".encode()
    + _GZIPPED
    + b"\r\n0\r\n\r\n",
}


class ScriptedUpstream(SocketUpstream):
    """Reads each whole request, counts it by its ``x-answer``, writes that answer, closes."""

    def __init__(self) -> None:
        super().__init__()
        self.received: list[str] = []

    def answer(self, conn: socket.socket, request: RawRequest) -> None:
        name = request.fields[b"x-answer"].decode()
        self.received.append(name)
        conn.sendall(ANSWERS[name])


class InterimUpstream(ScriptedUpstream):
    """A :class:`ScriptedUpstream` serving each connection in its own thread, which also
    floods interim answers (``interim-flood``: 20,000 ``103``, as fast as they go, then
    the answer) or drips them (``interim-drip``: a ``100 Continue`` every 0.25 s, twelve
    of them, then the answer), until the answer or until the proxy hangs up; or breaks
    its chunked framing after the first chunk, in a later write (``bad-chunk-later``,
    ``bad-chunk-later-stream``), and closes."""

    concurrent = True

    def answer(self, conn: socket.socket, request: RawRequest) -> None:
        name = request.fields[b"x-answer"].decode()
        try:
            if name == "interim-flood":
                self.received.append(name)
                for _ in range(100):
                    conn.sendall(_HINTS * 200)
                conn.sendall(_whole(b""))
            elif name == "interim-drip":
                self.received.append(name)
                for _ in range(12):
                    conn.sendall(_CONTINUE)
                    time.sleep(0.25)
                conn.sendall(_whole(b""))
            elif name.startswith("bad-chunk-later"):
                self.received.append(name)
                media, first = (
                    (b"text/event-stream", _EVENT)
                    if name.endswith("stream")
                    else (b"application/json", _BODY[:16])
                )
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: " + media + b"\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % len(first) + first + b"\r\n"
                )
                time.sleep(0.2)  # so the bad chunk size comes in a read of its own
                conn.sendall(b"zz\r\n" + _EVENT + b"\r\n")
            else:
                super().answer(conn, request)
        except OSError:
            pass  # the proxy hung up on it: what the bounds are for


@pytest.fixture(scope="module")
def upstream() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream() as scripted:
        yield scripted


def _chat(stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
    }
    if stream:
        body["stream"] = True
    return body


def _cli_json(capsys: pytest.CaptureFixture[str], ledger: Path, *args: str) -> Any:
    capsys.readouterr()
    assert cli_main([*args, "--json", "--ledger", str(ledger)]) == 0
    return json.loads(capsys.readouterr().out)


def _call(capsys: pytest.CaptureFixture[str], ledger: Path, call_id: str) -> dict[str, Any]:
    return {row["call_id"]: row for row in _cli_json(capsys, ledger, "calls")}[call_id]


def _internal_errors(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    line = next(s for s in text.splitlines() if s.startswith("effectguard_internal_errors_total"))
    return float(line.split()[-1])


def _verified(capsys: pytest.CaptureFixture[str], ledger: Path) -> bool:
    capsys.readouterr()
    return cli_main(["verify", "--ledger", str(ledger)]) == 0


@pytest.mark.parametrize("answer", ["capital-stream-cut", "untyped-stream-cut"])
def test_a_stream_cut_before_its_end_is_broken_however_its_type_is_spelled(
    answer: str, upstream: ScriptedUpstream, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ledger = tmp_path / "ledger.db"
    with running_proxy(ledger, upstreams={"openai": upstream.url}) as proxy:
        client = httpx.Client(base_url=proxy.url, timeout=30)
        headers = {"x-answer": answer, "idempotency-key": f"k-{answer}"}
        seen = b""
        with (
            pytest.raises(httpx.RemoteProtocolError),
            client.stream("POST", CHAT, json=_chat(True), headers=headers) as response,
        ):
            call_id = response.headers[CALL_ID]
            for chunk in response.iter_raw():
                seen += chunk
        resend = client.post(CHAT, json=_chat(True), headers=headers)
        errors = _internal_errors(proxy.url)
        client.close()
        log = proxy.log()
    assert seen == _EVENT * seen.count(b"data: ") and seen  # forwarded as it came
    assert upstream.received.count(answer) == 1
    call = _call(capsys, ledger, call_id)
    assert (call["stage"], call["effect"]) == ("effect_unknown", "unknown")
    assert call["held_usd"] == call["reserved_usd"]
    assert resend.status_code == 409  # never replayed as if it had finished
    assert resend.headers.get("effectguard-replayed") is None
    assert errors == 0, log
    assert "internal error" not in log
    assert _verified(capsys, ledger)


def test_a_whole_stream_with_a_capitalised_type_is_streamed_and_its_usage_read(
    upstream: ScriptedUpstream, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ledger = tmp_path / "ledger.db"
    headers = {"x-answer": "capital-stream-whole"}
    with running_proxy(ledger, upstreams={"openai": upstream.url}) as proxy:
        response = httpx.post(proxy.url + CHAT, json=_chat(True), headers=headers, timeout=30)
    assert response.status_code == 200
    # The usage event effectguard asked for is read, not shown (the client did not ask).
    assert response.content == _EVENT + _DONE
    call = _call(capsys, ledger, response.headers[CALL_ID])
    assert call["stage"] == "completed"
    # Settled from the stream's usage (5 in, 1 out), far below the reservation.
    assert call["cost_usd"] != call["reserved_usd"]
    assert _verified(capsys, ledger)


@pytest.mark.parametrize(
    ("answer", "told"),
    [
        ("status-999", "not a final HTTP answer"),
        ("status-101", "not a final HTTP answer"),
        ("gzip-transfer-coded", "Transfer-Encoding 'gzip', which was not asked for"),
    ],
)
def test_an_answer_that_cannot_be_read_as_http_is_effect_unknown(
    answer: str,
    told: str,
    upstream: ScriptedUpstream,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    ledger = tmp_path / "ledger.db"
    headers = {"x-answer": answer, "idempotency-key": f"k-{answer}"}
    with running_proxy(ledger, upstreams={"openai": upstream.url}) as proxy:
        client = httpx.Client(base_url=proxy.url, timeout=30)
        first = client.post(CHAT, json=_chat(False), headers=headers)
        resend = client.post(CHAT, json=_chat(False), headers=headers)
        errors = _internal_errors(proxy.url)
        client.close()
        log = proxy.log()
    assert first.status_code == 502, first.text
    assert first.json()["error"]["type"] == "effect_unknown"
    assert told in first.json()["error"]["message"]
    assert resend.status_code == 409
    assert resend.json()["error"]["type"] == "effect_unknown"
    assert upstream.received.count(answer) == 1
    call = _call(capsys, ledger, first.headers[CALL_ID])
    assert (call["stage"], call["effect"]) == ("effect_unknown", "unknown")
    assert errors == 0, log
    assert _verified(capsys, ledger)


def test_a_usage_event_behind_the_terminal_event_is_not_charged(
    upstream: ScriptedUpstream, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A usage event after ``[DONE]``, in the same write: the call completes at its
    reservation, flagged, as one whose usage never came. It was read and charged when the
    network delivered it with ``[DONE]``, and not when one read later: the same answer had
    two costs."""
    ledger = tmp_path / "ledger.db"
    headers = {"x-answer": "usage-after-done"}
    with running_proxy(ledger, upstreams={"openai": upstream.url}) as proxy:
        response = httpx.post(proxy.url + CHAT, json=_chat(True), headers=headers, timeout=30)
    assert response.status_code == 200
    assert response.content.startswith(_EVENT + _DONE)
    call_id = response.headers[CALL_ID]
    call = _call(capsys, ledger, call_id)
    assert (call["stage"], call["cost_usd"]) == ("completed", call["reserved_usd"])
    settled = [
        e["data"]
        for e in _cli_json(capsys, ledger, "show", call_id)["events"]
        if e["kind"] == "budget.settled"
    ]
    assert "usage missing" in json.dumps(settled), settled
    assert upstream.received.count("usage-after-done") == 1
    assert _verified(capsys, ledger)


def test_bytes_behind_the_terminal_event_are_neither_forwarded_nor_stored(
    upstream: ScriptedUpstream, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An event after ``[DONE]`` in the same write as it. The stream ends at its terminal
    event: what follows is not the client's, live or replayed, nor the ledger's. It was
    forwarded and stored when the network delivered it in the same read as ``[DONE]``, and
    not when one read later (the upstream is closed at the terminal event): an SDK that
    yields every event (Anthropic's, a second ``message_delta`` after ``message_stop``)
    showed its caller an answer that depended on where the network cut it."""
    ledger = tmp_path / "ledger.db"
    headers = {"x-answer": "event-after-done", "idempotency-key": "k-event-after-done"}
    with running_proxy(ledger, upstreams={"openai": upstream.url}) as proxy:
        client = httpx.Client(base_url=proxy.url, timeout=30)
        live = client.post(CHAT, json=_chat(True), headers=headers)
        replay = client.post(CHAT, json=_chat(True), headers=headers)
        client.close()
    assert live.status_code == replay.status_code == 200
    assert replay.headers.get("effectguard-replayed") == "true"
    assert live.content == _EVENT + _DONE  # the usage event is effectguard's, not shown
    assert replay.content == live.content  # the replay is the stored answer: stored so
    call = _call(capsys, ledger, live.headers[CALL_ID])
    assert call["stage"] == "completed" and call["cost_usd"] != call["reserved_usd"]
    assert upstream.received.count("event-after-done") == 1
    assert _verified(capsys, ledger)


@pytest.mark.parametrize(
    ("answer", "read"),
    [
        ("usage-choices-null", True),
        ("usage-empty", False),
        ("usage-no-choices", True),
        ("usage-not-json", False),
    ],
)
def test_a_misshapen_usage_event_effectguard_asked_for_is_not_shown_to_a_client_that_did_not(
    answer: str,
    read: bool,
    upstream: ScriptedUpstream,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The usage event effectguard asked for, as an OpenAI-compatible server may shape it
    (``choices`` null rather than empty, or no ``choices`` key at all, ``usage`` an empty
    object, or data that is not JSON), is kept from a client that never asked for usage,
    live and replayed, as the well-formed one is: the SDK's loop (``chunk.choices[0]`` of
    every chunk) runs to the end. It was shown, and the loop raised (``TypeError`` on null
    or absent choices, ``IndexError`` on empty ones, the SDK's JSON error on data that is
    not JSON) at the end of a call that was answered and paid for. The call is
    settled from the usage where it can be read, else at its reservation."""
    ledger = tmp_path / "ledger.db"
    headers = {"x-answer": answer, "idempotency-key": f"k-{answer}"}
    with running_proxy(ledger, upstreams={"openai": upstream.url}) as proxy:
        oa = openai.OpenAI(base_url=proxy.url + "/openai/v1", api_key="sk-client", max_retries=0)
        texts, ids = [], []
        for _ in range(2):  # the answer, then its replay
            stream = oa.chat.completions.with_raw_response.create(
                **_chat(True), extra_headers=headers
            )
            texts.append("".join(chunk.choices[0].delta.content or "" for chunk in stream.parse()))
            ids.append(stream.headers[CALL_ID])
        oa.close()
    assert texts == ["hi", "hi"]
    assert ids[0] == ids[1]
    call = _call(capsys, ledger, ids[0])
    assert call["stage"] == "completed"
    assert (call["cost_usd"] != call["reserved_usd"]) is read, call
    assert upstream.received.count(answer) == 1
    assert _verified(capsys, ledger)


@pytest.mark.parametrize(
    ("answer", "told"),
    [
        ("nul-header", "Invalid HTTP header"),
        ("4097-headers", "Too many headers received"),
        ("bad-chunk-size", "Invalid character in chunk size"),
        ("body-short-of-length", "Not enough data to satisfy content length header"),
        ("body-past-its-length", "Data after `Connection: close`"),
    ],
)
def test_an_answer_the_leg_cannot_parse_is_not_told_as_a_status_the_provider_sent(
    answer: str,
    told: str,
    upstream: ScriptedUpstream,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An answer aiohttp cannot parse is ``effect_unknown``, and its text names what could not
    be read. aiohttp puts the status 400 on every such answer (``ClientResponseError: 400,
    message=...``, ``<ContentLengthError: 400, ...>``), a status the provider never sent; in
    the client's message and the interrupt's reason it read as the provider's 400, which
    proves nothing was done: an operator reconciling by it would free the key of a call the
    provider may have made. The upstream's address was quoted too."""
    ledger = tmp_path / "ledger.db"
    with running_proxy(ledger, upstreams={"openai": upstream.url}) as proxy:
        first = httpx.post(proxy.url + CHAT, json=_chat(False), headers={"x-answer": answer})
    assert first.status_code == 502, first.text
    message = first.json()["error"]["message"]
    assert first.json()["error"]["type"] == "effect_unknown"
    assert upstream.received.count(answer) == 1
    call_id = first.headers[CALL_ID]
    events = _cli_json(capsys, ledger, "show", call_id)["events"]
    reason = next(e["data"]["reason"] for e in events if e["kind"] == "attempt.interrupted")
    for text in (message, reason):
        assert told in text, text
        assert "400" not in text.replace(call_id, ""), text
        assert upstream.url.removeprefix("http://") not in text, text
    assert _call(capsys, ledger, call_id)["stage"] == "effect_unknown"
    assert _verified(capsys, ledger)


def test_a_header_sent_twice_is_replayed_with_both_values(
    upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    """The stored answer keeps every value of a repeated header (joined, RFC 9110 §5.3):
    a replay once carried only the last."""
    ledger = tmp_path / "ledger.db"
    headers = {"x-answer": "repeated-header", "idempotency-key": "k-repeated"}
    with running_proxy(ledger, upstreams={"openai": upstream.url}) as proxy:
        client = httpx.Client(base_url=proxy.url, timeout=30)
        first = client.post(CHAT, json=_chat(False), headers=headers)
        replay = client.post(CHAT, json=_chat(False), headers=headers)
        client.close()
    assert first.status_code == 200, first.text
    assert first.headers.get_list("x-dup") == ["one", "two"]
    assert replay.headers["effectguard-replayed"] == "true"
    assert replay.headers["x-dup"] == "one, two"
    assert replay.content == first.content
    assert upstream.received.count("repeated-header") == 1


def _observed_headers(
    capsys: pytest.CaptureFixture[str], ledger: Path, call_id: str
) -> dict[str, str]:
    """The answer headers the ledger stored for ``call_id`` (its ``attempt.observed``)."""
    events = _cli_json(capsys, ledger, "show", call_id)["events"]
    observed = [e["data"] for e in events if e["kind"] == "attempt.observed"]
    assert len(observed) == 1, events
    headers: dict[str, str] = observed[0]["headers"]
    return headers


@pytest.mark.parametrize(
    ("answer", "stream"), [("control-byte-header", False), ("control-byte-header-stream", True)]
)
def test_a_header_the_server_cannot_write_is_left_out_and_the_answer_arrives(
    answer: str,
    stream: bool,
    upstream: ScriptedUpstream,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An upstream header value with a control byte (``a\\x01b``, ``a\\x7fb``) is dropped
    from what the client is sent, fresh and replayed, so the answer and its call id arrive;
    the ledger keeps it as sent. The server once raised on it after the response had
    started: the client got nothing for a charged call, and a keyed resend failed the same
    way."""
    ledger = tmp_path / "ledger.db"
    headers = {"x-answer": answer, "idempotency-key": f"k-{answer}"}
    with running_proxy(ledger, upstreams={"openai": upstream.url}) as proxy:
        client = httpx.Client(base_url=proxy.url, timeout=30)
        first = client.post(CHAT, json=_chat(stream), headers=headers)
        replay = client.post(CHAT, json=_chat(stream), headers=headers)
        errors = _internal_errors(proxy.url)
        client.close()
        log = proxy.log()
    assert first.status_code == 200, first.text
    call_id = first.headers[CALL_ID]
    assert first.headers.get("x-odd") is None and first.headers.get("x-del") is None
    assert replay.status_code == 200, replay.text
    assert replay.headers["effectguard-replayed"] == "true"
    assert replay.headers[CALL_ID] == call_id
    assert replay.headers.get("x-odd") is None
    assert replay.content == first.content
    assert upstream.received.count(answer) == 1
    assert _call(capsys, ledger, call_id)["stage"] == "completed"
    stored = _observed_headers(capsys, ledger, call_id)
    assert stored["x-odd"] == "a\x01b"
    if not stream:
        assert (stored["x-del"], first.headers["x-fine"]) == ("a\x7fb", "ok")
    assert errors == 0, log
    assert _verified(capsys, ledger)


def test_no_cookie_an_upstream_sets_is_stored_in_either_spelling(
    upstream: ScriptedUpstream, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``Set-Cookie`` and RFC 2965's ``Set-Cookie2`` are credentials (contract §3.9): the
    client gets them, the ledger never stores them (``Set-Cookie2`` once was)."""
    ledger = tmp_path / "ledger.db"
    with running_proxy(ledger, upstreams={"openai": upstream.url}) as proxy:
        answer = httpx.post(
            proxy.url + CHAT, json=_chat(False), headers={"x-answer": "cookies"}, timeout=30
        )
    assert answer.status_code == 200, answer.text
    assert answer.headers["set-cookie2"] == "a=SECRET-COOKIE2"
    call_id = answer.headers[CALL_ID]
    stored = _observed_headers(capsys, ledger, call_id)
    assert "set-cookie" not in stored and "set-cookie2" not in stored
    assert "SECRET-COOKIE" not in json.dumps(_cli_json(capsys, ledger, "show", call_id))


def test_a_stream_whose_lines_end_in_a_lone_cr_is_whole_and_its_usage_read(
    upstream: ScriptedUpstream, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An event stream with lone-CR line ends (the SSE standard allows CRLF, LF or CR) is
    forwarded whole (but the usage event effectguard asked for) and settled from its
    usage; it was once booked as a broken stream (effect unknown) and the client's stream
    cut off."""
    ledger = tmp_path / "ledger.db"
    headers = {"x-answer": "cr-stream"}
    with running_proxy(ledger, upstreams={"openai": upstream.url}) as proxy:
        response = httpx.post(proxy.url + CHAT, json=_chat(True), headers=headers, timeout=30)
    assert response.status_code == 200
    assert response.content == (_EVENT + _DONE).replace(b"\n", b"\r")  # usage read, not shown
    call = _call(capsys, ledger, response.headers[CALL_ID])
    assert call["stage"] == "completed"
    assert call["cost_usd"] != call["reserved_usd"]  # from the stream's usage
    assert _verified(capsys, ledger)


@pytest.fixture(scope="module")
def interim_upstream() -> Iterator[InterimUpstream]:
    with InterimUpstream() as scripted:
        yield scripted


def test_a_flood_of_interim_answers_is_cut_off_and_other_calls_go_on(
    interim_upstream: InterimUpstream, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An upstream that floods ``103 Early Hints`` gets its call cut off at the bound (16
    interim answers): 502 ``effect_unknown``, reservation held, while every call beside it
    is answered, including one with a few interim answers. The flood once went on to its
    final answer (recorded completed) while it held the proxy's event loop from the rest."""
    ledger = tmp_path / "ledger.db"
    flooded: dict[str, httpx.Response] = {}
    with running_proxy(ledger, upstreams={"openai": interim_upstream.url}) as proxy:
        client = httpx.Client(base_url=proxy.url, timeout=60)

        def flood() -> None:
            headers = {"x-answer": "interim-flood", "idempotency-key": "k-flood"}
            flooded["answer"] = client.post(CHAT, json=_chat(False), headers=headers)

        thread = threading.Thread(target=flood)
        thread.start()
        names = ["good", "16-interim"] * 4
        beside = [client.post(CHAT, json=_chat(False), headers={"x-answer": n}) for n in names]
        thread.join(60)
        errors = _internal_errors(proxy.url)
        client.close()
        log = proxy.log()
    answer = flooded["answer"]
    assert answer.status_code == 502, answer.text
    assert answer.json()["error"]["type"] == "effect_unknown"
    assert "interim (1xx) answers" in answer.json()["error"]["message"]
    call = _call(capsys, ledger, answer.headers[CALL_ID])
    assert (call["stage"], call["effect"]) == ("effect_unknown", "unknown")
    assert call["held_usd"] == call["reserved_usd"]
    assert [r.status_code for r in beside] == [200] * len(names)
    stages = {_call(capsys, ledger, r.headers[CALL_ID])["stage"] for r in beside}
    assert stages == {"completed"}
    assert errors == 0, log
    assert _verified(capsys, ledger)


def test_at_most_16_interim_answers_come_before_an_answer(
    interim_upstream: InterimUpstream, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Sixteen interim answers, then the answer: a completed call. Seventeen: the answer
    is refused as one that is not HTTP, and the call's effect is unknown."""
    ledger = tmp_path / "ledger.db"
    with running_proxy(ledger, upstreams={"openai": interim_upstream.url}) as proxy:
        client = httpx.Client(base_url=proxy.url, timeout=30)
        within, past = (
            client.post(CHAT, json=_chat(False), headers={"x-answer": name})
            for name in ("16-interim", "17-interim")
        )
        client.close()
    assert within.status_code == 200, within.text
    assert _call(capsys, ledger, within.headers[CALL_ID])["stage"] == "completed"
    assert past.status_code == 502, past.text
    assert past.json()["error"]["type"] == "effect_unknown"
    assert _call(capsys, ledger, past.headers[CALL_ID])["stage"] == "effect_unknown"
    assert _verified(capsys, ledger)


def test_interim_answers_do_not_restart_the_read_timeout(
    interim_upstream: InterimUpstream, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ``100 Continue`` every 0.25 s, under a 1 s read timeout: the call times out (504
    ``effect_unknown``) instead of each interim answer starting the timeout again, which
    once kept such a call in flight for as long as the upstream kept dripping."""
    ledger = tmp_path / "ledger.db"
    config = tmp_path / "config.toml"
    config.write_text("[upstream]\nread_timeout_s = 1\n")
    with running_proxy(
        ledger, upstreams={"openai": interim_upstream.url}, args=["--config", str(config)]
    ) as proxy:
        answer = httpx.post(
            proxy.url + CHAT, json=_chat(False), headers={"x-answer": "interim-drip"}, timeout=30
        )
    assert answer.status_code == 504, answer.text
    assert answer.json()["error"]["type"] == "effect_unknown"
    call = _call(capsys, ledger, answer.headers[CALL_ID])
    assert (call["stage"], call["effect"]) == ("effect_unknown", "unknown")
    assert _verified(capsys, ledger)


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
def test_chunked_framing_broken_mid_body_ends_the_call_and_others_go_on(
    stream: bool,
    interim_upstream: InterimUpstream,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A chunk size that is not hex (``zz``), in a read after the answer began: the call is
    ``effect_unknown`` (502, or a stream cut off with an error), its reservation held, and
    calls beside it complete. aiohttp's C parser put that failure on the connection but
    not on the body being read, and stopped the read timeout: the call stayed ``in_flight``,
    its client waiting and its key answering 409, for as long as the proxy ran."""
    name = "bad-chunk-later-stream" if stream else "bad-chunk-later"
    ledger = tmp_path / "ledger.db"
    with running_proxy(ledger, upstreams={"openai": interim_upstream.url}) as proxy:
        client = httpx.Client(base_url=proxy.url, timeout=10)
        headers = {"x-answer": name, "idempotency-key": f"k-{name}"}
        with client.stream("POST", CHAT, json=_chat(stream), headers=headers) as response:
            call_id = response.headers[CALL_ID]
            if stream:
                with pytest.raises(httpx.RemoteProtocolError):
                    response.read()
            else:
                assert response.status_code == 502, response.read()
                error = json.loads(response.read())["error"]
                assert error["type"] == "effect_unknown"
                assert "Invalid character in chunk size" in error["message"]
        beside = client.post(CHAT, json=_chat(False), headers={"x-answer": "good"})
        resend = client.post(CHAT, json=_chat(stream), headers=headers)
        errors = _internal_errors(proxy.url)
        client.close()
        log = proxy.log()
    assert beside.status_code == 200
    assert resend.status_code == 409 and resend.json()["error"]["type"] == "effect_unknown"
    assert interim_upstream.received.count(name) == 1
    call = _call(capsys, ledger, call_id)
    assert (call["stage"], call["effect"]) == ("effect_unknown", "unknown")
    assert call["held_usd"] == call["reserved_usd"]
    assert errors == 0, log
    assert _verified(capsys, ledger)
