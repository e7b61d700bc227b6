"""Bad input at the proxy: a clear error in the provider's shape, and nothing changes.

One real ``effectguard serve`` (``max_body_bytes = 1024``) in front of the real
fake provider (``openai`` and ``anthropic`` routes) and a small header-recording
upstream (an ``echo`` provider declared with ``--providers``). Every refusal
leaves ``effectguard budgets --json`` and the provider's receipt log unchanged
and carries ``x-should-retry: false`` (docs/contract.md §9).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from effectguard.ops.cli import main as cli_main
from effectguard.testing import FakeProvider, Proxy, fake_provider, running_proxy

MAX_BODY = 1024
OPENAI_CHAT = "/openai/v1/chat/completions"
ANTHROPIC_MESSAGES = "/anthropic/v1/messages"
ECHO_CHAT = "/echo/v1/chat/completions"
CALL_ID = "effectguard-call-id"

ECHO_PROVIDER_KEY = "sk-echo-provider-key"
ECHO_DECLARATION = """
name = "echo"
base_url = "http://127.0.0.1:9"
dialect = "openai"
api_key_env = "EFFECTGUARD_TEST_ECHO_KEY_NEVER_SET"
key_header = "authorization"
prices_taken = "2026-01-01"
not_processed = [400]

[[endpoints]]
path = "/v1/chat/completions"
effect = "billable"

[models."echo-model"]
input = "1.00"
output = "2.00"
max_output_tokens = 100
"""


class _Recorder(BaseHTTPRequestHandler):
    """An upstream that answers an OpenAI chat completion and records request headers."""

    seen: list[list[tuple[str, str]]]

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length", "0"))
        self.rfile.read(length)
        type(self).seen.append(list(self.headers.items()))
        body = json.dumps(
            {
                "id": "chatcmpl-echo",
                "object": "chat.completion",
                "created": 1,
                "model": "echo-model",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "ok"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            }
        ).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""


@contextlib.contextmanager
def recording_upstream() -> Iterator[tuple[str, list[list[tuple[str, str]]]]]:
    """A threaded HTTP server on 127.0.0.1 recording every request's headers."""
    seen: list[list[tuple[str, str]]] = []
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


class Env:
    """The module's proxy, fake provider, recording upstream and ledger."""

    def __init__(
        self, proxy: Proxy, provider: FakeProvider, seen: list[list[tuple[str, str]]]
    ) -> None:
        self.proxy = proxy
        self.provider = provider
        self.seen = seen
        self.client = httpx.Client(base_url=proxy.url, timeout=10)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """One proxy for the module, in front of the fake provider and the recording upstream."""
    tmp = tmp_path_factory.mktemp("input")
    declarations = tmp / "providers"
    declarations.mkdir()
    (declarations / "echo.toml").write_text(ECHO_DECLARATION)
    keyed = ECHO_DECLARATION.replace('name = "echo"', 'name = "echokeyed"')
    keyed = keyed.replace("EFFECTGUARD_TEST_ECHO_KEY_NEVER_SET", "EFFECTGUARD_TEST_ECHO_KEY")
    (declarations / "echokeyed.toml").write_text(keyed)
    config = tmp / "config.toml"
    config.write_text(f"[server]\nmax_body_bytes = {MAX_BODY}\n")
    with (
        fake_provider(tmp / "receipts.jsonl") as provider,
        recording_upstream() as (echo_url, seen),
        running_proxy(
            tmp / "ledger.db",
            upstreams={
                "openai": provider.url,
                "anthropic": provider.url,
                "echo": echo_url,
                "echokeyed": echo_url,
            },
            args=["--config", str(config), "--providers", str(declarations)],
            env={"EFFECTGUARD_TEST_ECHO_KEY": ECHO_PROVIDER_KEY},
        ) as proxy,
    ):
        environment = Env(proxy, provider, seen)
        try:
            yield environment
        finally:
            environment.client.close()


def budgets_json(env: Env, capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    """``effectguard budgets --json`` on the module's ledger (the CLI, run in-process)."""
    capsys.readouterr()
    assert cli_main(["budgets", "--json", "--ledger", env.proxy.ledger]) == 0
    rows: list[dict[str, Any]] = json.loads(capsys.readouterr().out)
    return rows


@contextlib.contextmanager
def nothing_changes(env: Env, capsys: pytest.CaptureFixture[str]) -> Iterator[None]:
    """Assert the block reserves nothing and dispatches nothing."""
    budgets_before = budgets_json(env, capsys)
    receipts_before = len(env.provider.receipts())
    echo_before = len(env.seen)
    yield
    assert budgets_json(env, capsys) == budgets_before
    assert len(env.provider.receipts()) == receipts_before
    assert len(env.seen) == echo_before


def chat(content: str = "hello", model: str = "gpt-4o-mini") -> dict[str, Any]:
    """An OpenAI chat completion request body."""
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 5}


def message(content: str = "hello", model: str = "claude-haiku-4-5") -> dict[str, Any]:
    """An Anthropic Messages request body."""
    return {"model": model, "max_tokens": 5, "messages": [{"role": "user", "content": content}]}


def openai_error(response: httpx.Response, status: int, type_: str) -> dict[str, Any]:
    """Check ``response`` is an OpenAI-shaped refusal and return its error object."""
    assert response.status_code == status, response.text
    assert response.headers["x-should-retry"] == "false"
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    error: dict[str, Any] = body["error"]
    assert error["type"] == type_
    assert error["code"] == type_
    assert isinstance(error["message"], str) and error["message"]
    return error


def anthropic_error(response: httpx.Response, status: int, type_: str) -> dict[str, Any]:
    """Check ``response`` is an Anthropic-shaped refusal and return its error object."""
    assert response.status_code == status, response.text
    assert response.headers["x-should-retry"] == "false"
    body = response.json()
    assert body["type"] == "error"
    assert set(body) == {"type", "error"}
    error: dict[str, Any] = body["error"]
    assert error["type"] == type_
    assert isinstance(error["message"], str) and error["message"]
    return error


def test_malformed_json_is_400_and_changes_nothing(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    """A body that is not JSON is refused 400 invalid_request before any reservation."""
    with nothing_changes(env, capsys):
        response = env.client.post(
            OPENAI_CHAT,
            content=b'{"model": "gpt-4o-mini", "messages": [',
            headers={"content-type": "application/json"},
        )
    openai_error(response, 400, "invalid_request")
    assert CALL_ID not in response.headers


def test_json_that_is_not_an_object_is_400(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """A JSON array body is refused 400 invalid_request and changes nothing."""
    with nothing_changes(env, capsys):
        response = env.client.post(OPENAI_CHAT, json=[chat()])
    openai_error(response, 400, "invalid_request")


def test_malformed_json_on_anthropic_route_uses_anthropic_shape(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    """On /anthropic routes a refusal is {"type": "error", "error": {...}}."""
    with nothing_changes(env, capsys):
        response = env.client.post(ANTHROPIC_MESSAGES, content=b"not json")
    error = anthropic_error(response, 400, "invalid_request")
    assert "code" not in error


def test_body_over_limit_with_content_length_is_413(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    """A declared Content-Length above max_body_bytes is refused 413."""
    body = json.dumps(chat("x" * (MAX_BODY * 2))).encode()
    with nothing_changes(env, capsys):
        response = env.client.post(OPENAI_CHAT, content=body)
    openai_error(response, 413, "request_too_large")


def test_body_over_limit_without_content_length_is_413(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    """A chunked body that grows past max_body_bytes is refused 413 while being read."""
    payload = json.dumps(chat("y" * (MAX_BODY * 3))).encode()

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(payload), 256):
            yield payload[i : i + 256]

    with nothing_changes(env, capsys):
        request = env.client.build_request("POST", OPENAI_CHAT, content=chunks())
        assert "content-length" not in request.headers
        assert request.headers["transfer-encoding"] == "chunked"
        response = env.client.send(request)
    openai_error(response, 413, "request_too_large")


def test_body_at_the_limit_is_accepted(env: Env) -> None:
    """A body of exactly max_body_bytes is not refused for its size (the limit is inclusive)."""
    base = json.dumps(chat("")).encode()
    body = json.dumps(chat("z" * (MAX_BODY - len(base)))).encode()
    assert len(body) == MAX_BODY
    before = len(env.provider.receipts())
    response = env.client.post(OPENAI_CHAT, content=body)
    assert response.status_code == 200, response.text
    assert len(env.provider.receipts()) == before + 1


def test_anthropic_body_over_limit_uses_anthropic_shape(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 413 on an /anthropic route is Anthropic-shaped."""
    with nothing_changes(env, capsys):
        response = env.client.post(ANTHROPIC_MESSAGES, json=message("q" * (MAX_BODY * 2)))
    anthropic_error(response, 413, "request_too_large")


def test_unknown_provider_is_404(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """A route naming no declared provider is refused 404 unknown_provider."""
    with nothing_changes(env, capsys):
        response = env.client.post("/nosuchprovider/v1/chat/completions", json=chat())
    openai_error(response, 404, "unknown_provider")


def test_unpriced_model_is_400(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """A model without a declared price is refused 400 model_not_priced."""
    with nothing_changes(env, capsys):
        response = env.client.post(OPENAI_CHAT, json=chat(model="gpt-unpriced-9000"))
    error = openai_error(response, 400, "model_not_priced")
    assert "gpt-unpriced-9000" in error["message"]


def test_unpriced_model_on_anthropic_route_uses_anthropic_shape(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    """model_not_priced on an /anthropic route is Anthropic-shaped."""
    with nothing_changes(env, capsys):
        response = env.client.post(ANTHROPIC_MESSAGES, json=message(model="claude-unpriced"))
    anthropic_error(response, 400, "model_not_priced")


@pytest.mark.parametrize(
    "path", ["a//b", "../etc", "/abs", "a/", "has space", "d/" * 8 + "d", "x" * 65, "-lead"]
)
def test_invalid_budget_path_is_400(
    env: Env, capsys: pytest.CaptureFixture[str], path: str
) -> None:
    """An Effectguard-Budget header that is not a valid budget path is refused 400."""
    with nothing_changes(env, capsys):
        response = env.client.post(
            OPENAI_CHAT,
            content=json.dumps(chat()).encode(),
            headers=[("content-type", "application/json"), ("effectguard-budget", path)],
        )
    openai_error(response, 400, "invalid_budget")


def test_idempotency_key_too_long_is_400(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """An Idempotency-Key over 255 characters is refused 400 before admission."""
    with nothing_changes(env, capsys):
        response = env.client.post(OPENAI_CHAT, json=chat(), headers={"Idempotency-Key": "k" * 256})
    openai_error(response, 400, "invalid_request")


def test_idempotency_key_of_255_characters_is_accepted(env: Env) -> None:
    """The longest allowed Idempotency-Key (255) is admitted and dispatched once."""
    before = len(env.provider.receipts())
    response = env.client.post(
        OPENAI_CHAT, json=chat("long key"), headers={"Idempotency-Key": "L" * 255}
    )
    assert response.status_code == 200, response.text
    assert response.headers[CALL_ID].startswith("call_")
    assert len(env.provider.receipts()) == before + 1


def test_key_reuse_refusal_names_the_existing_call(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    """A reused key with another body is 422 carrying the first call's id; nothing is sent."""
    key = f"reuse-{time.monotonic_ns()}"
    first = env.client.post(OPENAI_CHAT, json=chat("one"), headers={"Idempotency-Key": key})
    assert first.status_code == 200, first.text
    with nothing_changes(env, capsys):
        second = env.client.post(OPENAI_CHAT, json=chat("two"), headers={"Idempotency-Key": key})
    error = openai_error(second, 422, "idempotency_key_reused")
    assert second.headers[CALL_ID] == first.headers[CALL_ID]
    assert error["call_id"] == first.headers[CALL_ID]


def test_budget_refusal_carries_call_id_and_no_dispatch(env: Env) -> None:
    """A 402 budget_exceeded names a (refused) call and sends nothing upstream."""
    tiny_limit = "0.000000001"
    assert (
        cli_main(
            [
                "budget",
                "set",
                "input-poor",
                "--limit",
                tiny_limit,
                "--ledger",
                env.proxy.ledger,
            ]
        )
        == 0
    )
    before = len(env.provider.receipts())
    response = env.client.post(
        OPENAI_CHAT, json=chat(), headers={"Effectguard-Budget": "input-poor"}
    )
    error = openai_error(response, 402, "budget_exceeded")
    assert response.headers[CALL_ID].startswith("call_")
    assert error["call_id"] == response.headers[CALL_ID]
    assert "input-poor" in error["message"]
    assert len(env.provider.receipts()) == before


def _raw_exchange(env: Env, data: bytes, timeout: float = 5.0) -> bytes:
    """Send ``data`` over one raw TCP connection and read until the server closes or idles."""
    host, port = env.proxy.url.removeprefix("http://").split(":")
    received = b""
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(data)
        deadline = time.monotonic() + timeout
        sock.settimeout(1.0)
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            received += chunk
    return received


def test_content_length_with_transfer_encoding_never_makes_two_upstream_calls(env: Env) -> None:
    """CL + TE over a raw socket: a 400, or one TE-framed request; never a smuggled second call.

    Content-Length covers the whole payload (so a CL-framing server sees one request), while
    the chunked framing ends early and leaves a second request behind it. RFC 9112 §6.3: the
    server may reject such a message or process it by Transfer-Encoding alone, and either way
    MUST close the connection after responding, so the trailing bytes never become a request.
    """
    smuggled = json.dumps(chat("smuggled")).encode()
    inner = (
        b"POST " + OPENAI_CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\nContent-Length: "
        + str(len(smuggled)).encode()
        + b"\r\n\r\n"
        + smuggled
    )
    outer = json.dumps(chat("outer")).encode()
    chunked = hex(len(outer))[2:].encode() + b"\r\n" + outer + b"\r\n0\r\n\r\n"
    body = chunked + inner
    request = (
        b"POST " + OPENAI_CHAT.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" + body
    )
    before = len(env.provider.receipts())
    answer = _raw_exchange(env, request)
    time.sleep(0.3)  # a smuggled request would have reached the provider by now
    receipts = env.provider.receipts()[before:]
    statuses = [
        int(line.split()[1]) for line in answer.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")
    ]
    assert statuses, answer
    assert statuses[0] in (200, 400), answer
    assert len(receipts) <= 1, f"{len(receipts)} upstream requests from one smuggling attempt"
    assert len(statuses) == 1, answer
    if receipts:  # processed by Transfer-Encoding alone: the chunked body, nothing else
        assert receipts[0]["body_sha256"] != hashlib.sha256(smuggled).hexdigest()


def test_hop_by_hop_headers_are_not_forwarded(env: Env) -> None:
    """Connection-named and hop-by-hop headers stop at the proxy; end-to-end headers go on."""
    before = len(env.seen)
    response = env.client.post(
        ECHO_CHAT,
        json=chat(model="echo-model"),
        headers={
            "Connection": "x-foo, x-bar",
            "x-foo": "bar",
            "x-bar": "baz",
            "Proxy-Authorization": "Basic c2VjcmV0",
            "Upgrade": "websocket",
            "x-end-to-end": "kept",
            "Authorization": "Bearer sk-client-passthrough",
        },
    )
    assert response.status_code == 200, response.text
    assert len(env.seen) == before + 1
    forwarded = {k.lower(): v for k, v in env.seen[-1]}
    for name in ("x-foo", "x-bar", "proxy-authorization", "upgrade"):
        assert name not in forwarded, forwarded
    assert forwarded.get("connection", "").lower() in ("", "keep-alive", "close")
    assert forwarded["x-end-to-end"] == "kept"
    # Without a provider key in the environment, the client's credential passes through...
    assert forwarded["authorization"] == "Bearer sk-client-passthrough"
    # ...and effectguard's own headers never leave.
    assert not any(k.startswith("effectguard-") for k in forwarded)


def test_hop_by_hop_headers_on_fake_provider_route_dispatch_once(env: Env) -> None:
    """A request with Connection-named headers succeeds and makes exactly one receipt."""
    before = len(env.provider.receipts())
    response = env.client.post(
        OPENAI_CHAT, json=chat("hop"), headers={"Connection": "x-foo", "x-foo": "bar"}
    )
    assert response.status_code == 200, response.text
    assert len(env.provider.receipts()) == before + 1


def test_client_credential_passed_through_is_never_stored(env: Env) -> None:
    """The client's own credential (no provider key in env) is not written to the ledger."""
    response = env.client.post(
        ECHO_CHAT,
        json=chat("cred", model="echo-model"),
        headers={"Authorization": "Bearer sk-canary-passthrough", "x-api-key": "sk-canary-xkey"},
    )
    assert response.status_code == 200, response.text
    ledger = Path(env.proxy.ledger)
    blob = b"".join(p.read_bytes() for p in (ledger, Path(str(ledger) + "-wal")) if p.exists())
    assert b"sk-canary-passthrough" not in blob
    assert b"sk-canary-xkey" not in blob


def test_provider_key_from_environment_replaces_client_credentials(env: Env) -> None:
    """Where effectguard holds the provider key, the client's credentials never go upstream."""
    before = len(env.seen)
    response = env.client.post(
        "/echokeyed/v1/chat/completions",
        json=chat("keyed", model="echo-model"),
        headers={"Authorization": "Bearer sk-client-own", "x-api-key": "sk-client-x"},
    )
    assert response.status_code == 200, response.text
    assert len(env.seen) == before + 1
    forwarded = [(k.lower(), v) for k, v in env.seen[-1]]
    assert [v for k, v in forwarded if k == "authorization"] == [f"Bearer {ECHO_PROVIDER_KEY}"]
    assert "x-api-key" not in dict(forwarded)
    ledger = Path(env.proxy.ledger)
    blob = b"".join(p.read_bytes() for p in (ledger, Path(str(ledger) + "-wal")) if p.exists())
    assert ECHO_PROVIDER_KEY.encode() not in blob
    assert b"sk-client-own" not in blob
