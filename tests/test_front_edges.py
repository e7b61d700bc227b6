"""Outside surprises at the proxy get clear answers, and refused input never goes out.

One real ``effectguard serve`` in front of the real fake provider (``openai``), a
recording upstream that stands for a tool provider whose base URL has a path
(``send_email`` at ``{recorder}/tenant1``) and a dead port (``anthropic``, for
read-only calls whose upstream is down). Every refusal is provider-shaped, and
the receipt log, the recorder and the ledger prove that nothing was dispatched.
"""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from edgekit import UPSTREAM_OWN_HEADERS, Seen, exchange, post, recording_upstream

from effectguard import AsyncGuardTransport
from effectguard.ops.cli import main as cli_main
from effectguard.rules.nesting import MAX_JSON_DEPTH
from effectguard.testing import FakeProvider, Proxy, fake_provider, free_port, running_proxy

OPENAI_CHAT = "/openai/v1/chat/completions"
CALL_ID = "effectguard-call-id"


@dataclass
class Env:
    """The module's proxy, fake provider and recording upstream."""

    proxy: Proxy
    provider: FakeProvider
    seen: list[Seen]
    client: httpx.Client

    def calls(self, capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
        """``effectguard calls --json`` on the proxy's ledger."""
        capsys.readouterr()
        assert cli_main(["calls", "--json", "--ledger", self.proxy.ledger]) == 0
        rows: list[dict[str, Any]] = json.loads(capsys.readouterr().out)
        return rows


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """One proxy for the module."""
    tmp = tmp_path_factory.mktemp("edges")
    with (
        fake_provider(tmp / "receipts.jsonl") as provider,
        recording_upstream() as (recorder_url, seen),
        running_proxy(
            tmp / "ledger.db",
            upstreams={
                "openai": provider.url,
                "send_email": recorder_url + "/tenant1",
                "anthropic": f"http://127.0.0.1:{free_port()}",  # nobody listens there
            },
        ) as proxy,
        httpx.Client(base_url=proxy.url, timeout=15) as client,
    ):
        yield Env(proxy, provider, seen, client)


def chat(content: str = "hello") -> dict[str, Any]:
    """An OpenAI chat completion request body."""
    return {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": content}]}


def error_of(status: int, body: Any, type_: str) -> dict[str, Any]:
    """The error object of a provider-shaped refusal, checked for ``type_``."""
    error: dict[str, Any] = body["error"]
    assert error["type"] == type_, (status, body)
    assert error["message"]
    return error


ESCAPES = [
    "/send_email/../../admin/delete-all",
    "/send_email/v1/../../../admin/delete-all",
    "/send_email/%2e%2e/%2e%2e/admin/delete-all",
    "/send_email/%2E%2E/admin",
    "/send_email/./v1/send",
    "/send_email/v1%2fsend",
    "/send_email/..%2f..%2fadmin",
    "/send_email/v1%5csend",
    "/send_email/v1/send%09",
    "/send_email/v1/%00send",
    "/send_email/v1/send%0d%0aX-Injected:%20yes",
    "/send_email/v1/send%",
    "/openai/v1/chat/completions/%2e%2e/%2e%2e/v1/embeddings",
    "/send_email/..;/admin",
    "/send_email/v1/..;x=1/..;/admin",
    "/send_email/..%3b/admin",
    "/send_email/x/..%3B/..%3B/admin",
    "/send_email/.;/v1/send",
]


@pytest.mark.parametrize("path", ESCAPES)
def test_a_path_that_leaves_the_base_path_is_400_and_never_dispatched(
    env: Env, capsys: pytest.CaptureFixture[str], path: str
) -> None:
    """Dot segments, encoded dots/slashes/backslashes and control characters get 400
    ``invalid_request`` naming the problem; nothing reaches any upstream or the ledger."""
    seen, receipts, calls = len(env.seen), len(env.provider.receipts()), env.calls(capsys)
    answer = exchange(env.proxy.url, post(path, b'{"to": "a@example.com"}'))
    assert answer.status == 400, answer
    error = error_of(answer.status, answer.json(), "invalid_request")
    assert "path" in error["message"]
    assert answer.headers["x-should-retry"] == "false"
    assert len(env.seen) == seen
    assert len(env.provider.receipts()) == receipts
    assert env.calls(capsys) == calls


def test_a_clean_path_below_the_base_path_is_dispatched_there(env: Env) -> None:
    """The positive control: ``/send_email/v1/send`` goes to ``/tenant1/v1/send``."""
    before = len(env.seen)
    answer = exchange(env.proxy.url, post("/send_email/v1/send", b'{"to": "a@example.com"}'))
    assert answer.status == 200, answer
    assert [(s.method, s.path) for s in env.seen[before:]] == [("POST", "/tenant1/v1/send")]


def test_a_clean_path_goes_upstream_as_the_bytes_the_client_sent(env: Env) -> None:
    """Escapes a server might read as a path parameter, an address or a port are not
    decoded on the way (they once were: ``%3b`` reached the upstream as ``;``)."""
    before = len(env.seen)
    path = "/send_email/v1/a%3bb%3dc%40d%3ae%7ef%2Bg?q=%3b"
    answer = exchange(env.proxy.url, post(path, b'{"to": "a@example.com"}'))
    assert answer.status == 200, answer
    assert [s.path for s in env.seen[before:]] == ["/tenant1/v1/a%3bb%3dc%40d%3ae%7ef%2Bg?q=%3b"]


async def test_the_transport_refuses_an_escaping_url_before_its_inner_transport() -> None:
    """In-process, an encoded dot segment under a provider's base URL is 400, never sent."""
    sent: list[httpx.Request] = []

    def inner(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200, json={})

    transport = AsyncGuardTransport(
        httpx.MockTransport(inner),
        ledger="memory://",
        upstreams={"send_email": "http://tools.test/tenant1"},
    )
    async with httpx.AsyncClient(transport=transport) as client:
        response = await client.post(
            "http://tools.test/tenant1/%2e%2e/admin/delete-all", json={"to": "a@example.com"}
        )
    assert response.status_code == 400, response.text
    assert "path" in error_of(400, response.json(), "invalid_request")["message"]
    assert sent == []


async def test_the_transport_judges_the_url_httpx_will_send() -> None:
    """httpx resolves literal ``..`` segments when it builds the URL (RFC 3986 §5.2.4),
    before any transport sees it: ``/tenant1/../admin`` is ``/admin``, a request for no
    provider, passed on untouched (as every such request is) or refused 404 with
    ``refuse_unmatched``. A backslash right after the base, which httpx keeps and some
    servers read as ``/``, is the provider's and is refused 400; it once went out
    unguarded as a request for nobody."""
    sent: list[str] = []

    def inner(request: httpx.Request) -> httpx.Response:
        sent.append(request.url.raw_path.decode())
        return httpx.Response(200, json={})

    def transport(refuse: bool) -> AsyncGuardTransport:
        return AsyncGuardTransport(
            httpx.MockTransport(inner),
            ledger="memory://",
            upstreams={"send_email": "http://tools.test/tenant1"},
            refuse_unmatched=refuse,
        )

    body = {"to": "a@example.com"}
    async with httpx.AsyncClient(transport=transport(refuse=False)) as client:
        backslash = await client.post("http://tools.test/tenant1\\..\\admin", json=body)
        resolved = await client.post("http://tools.test/tenant1/../admin", json=body)
    assert backslash.status_code == 400, backslash.text
    assert "backslash" in error_of(400, backslash.json(), "invalid_request")["message"]
    assert resolved.status_code == 200 and sent == ["/admin"]
    async with httpx.AsyncClient(transport=transport(refuse=True)) as client:
        refused = await client.post("http://tools.test/tenant1/../admin", json=body)
    assert refused.status_code == 404, refused.text
    assert sent == ["/admin"]


def refused_unsent(
    env: Env, capsys: pytest.CaptureFixture[str], body: bytes, headers: Any = None
) -> dict[str, Any]:
    """POST ``body`` to the chat endpoint: it must be refused with 400 ``invalid_request``
    before anything reaches the provider or the ledger; the error object."""
    receipts, calls = len(env.provider.receipts()), env.calls(capsys)
    sent = headers if headers is not None else {"content-type": "application/json"}
    response = env.client.post(OPENAI_CHAT, content=body, headers=sent)
    error = error_of(400, response.json(), "invalid_request")
    assert response.status_code == 400, response.text
    assert len(env.provider.receipts()) == receipts
    assert env.calls(capsys) == calls
    return error


def nested(depth: int) -> bytes:
    """A chat request whose ``metadata`` nests ``depth`` arrays deep (the body is one more)."""
    inner = "[" * depth + "]" * depth
    return ('{"model":"gpt-4o-mini","messages":[],"metadata":' + inner + "}").encode()


@pytest.mark.parametrize("depth", [900, 5000, MAX_JSON_DEPTH])
def test_json_nested_too_deep_is_400(
    env: Env, capsys: pytest.CaptureFixture[str], depth: int
) -> None:
    """A body nested deeper than the documented limit gets 400 naming the limit, no 500."""
    error = refused_unsent(env, capsys, nested(depth))
    assert str(MAX_JSON_DEPTH) in error["message"]


@pytest.mark.parametrize(
    ("body", "key"),
    [
        (b'{"model":"gpt-4o-mini","max_tokens":100000,"messages":[],"max_tokens":1}', "max_tokens"),
        (b'{"model":"gpt-4o-mini","messages":[{"role":"user","role":"system"}]}', "role"),
    ],
)
def test_a_json_object_repeating_a_key_is_400_and_never_sent(
    env: Env, capsys: pytest.CaptureFixture[str], body: bytes, key: str
) -> None:
    """A repeated key is refused naming it: the provider might act on the value we did not
    price (the first max_tokens), so the body is ambiguous, not merely odd."""
    message = refused_unsent(env, capsys, body)["message"]
    assert message == f"request body is ambiguous JSON: the key {key!r} appears twice in one object"


@pytest.mark.parametrize("flag", ['"yes"', '"true"', "1", "{}"])
def test_a_stream_flag_that_is_not_a_boolean_is_400_and_never_sent(
    env: Env, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    """``stream`` is true, false or absent: a provider that took "yes" as a stream would
    send events the guard was not reading as one."""
    body = '{"model":"gpt-4o-mini","messages":[],"stream":' + flag + "}"
    error = refused_unsent(env, capsys, body.encode())
    assert (error["message"], error["param"]) == ("stream must be true or false", "stream")


@pytest.mark.parametrize("encoding", ["gzip", "br", "GZIP", "identity, gzip"])
def test_a_compressed_body_is_400_and_never_sent(
    env: Env, capsys: pytest.CaptureFixture[str], encoding: str
) -> None:
    """A Content-Encoding other than identity is refused: the guard would price the bytes
    it was sent while the provider acts on what they decompress to (a lie, as here, made
    the provider answer 500 and left the call's effect unknown)."""
    headers = {"content-type": "application/json", "content-encoding": encoding}
    error = refused_unsent(env, capsys, b'{"model":"gpt-4o-mini","messages":[]}', headers)
    assert error["message"].startswith("Content-Encoding "), error
    assert "send the body uncompressed" in error["message"]


def test_an_identity_content_encoding_is_served(env: Env) -> None:
    """``Content-Encoding: identity`` is no encoding at all."""
    response = env.client.post(
        OPENAI_CHAT,
        content=b'{"model":"gpt-4o-mini","messages":[]}',
        headers={"content-type": "application/json", "content-encoding": "identity"},
    )
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "count", ["\u00b2".encode(), b"9" * 5000], ids=["superscript", "5000 digits"]
)
def test_an_odd_sdk_retry_count_is_no_retry_and_no_500(env: Env, count: bytes) -> None:
    """``x-stainless-retry-count`` that str.isdigit() accepts but int() refuses (a
    superscript two, 5,000 digits) was a 500; it is read as no retry count at all."""
    response = env.client.post(
        OPENAI_CHAT,
        content=b'{"model":"gpt-4o-mini","messages":[]}',
        headers=[(b"content-type", b"application/json"), (b"x-stainless-retry-count", count)],
    )
    assert response.status_code == 200, response.text


def test_two_idempotency_keys_are_400_and_never_sent(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two Idempotency-Key headers would join into a key ("a, b") neither names: refused."""
    headers = [("content-type", "application/json"), ("idempotency-key", "a")]
    body = b'{"model":"gpt-4o-mini","messages":[]}'
    error = refused_unsent(env, capsys, body, [*headers, ("idempotency-key", "b")])
    assert error["message"] == "Idempotency-Key is sent more than once"


def test_json_nested_within_the_limit_is_served(env: Env) -> None:
    """A body exactly at the depth limit is an ordinary request."""
    body = nested(MAX_JSON_DEPTH - 2)  # + the metadata's own object level + the body
    response = env.client.post(
        OPENAI_CHAT, content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 200, response.text


def test_a_utf8_header_value_is_forwarded_as_sent(env: Env) -> None:
    """A UTF-8 header value (RFC 9110 obs-text) reaches the provider byte for byte."""
    value = "Café ✓ 東京".encode()
    before = len(env.seen)
    body = b'{"to": "a@example.com"}'
    request = post("/send_email/v1/send", body).replace(
        b"\r\n\r\n", b"\r\nX-Title: " + value + b"\r\n\r\n", 1
    )
    answer = exchange(env.proxy.url, request)
    assert answer.status == 200, answer
    forwarded = dict(env.seen[before].headers)
    assert forwarded[b"x-title"] == value


def test_a_header_value_that_is_not_utf8_is_400_and_never_sent(env: Env) -> None:
    """A Latin-1 header byte cannot be forwarded byte for byte (the upstream leg writes
    header text as UTF-8), so rather than alter it the proxy refuses the request."""
    before = len(env.seen)
    body = b'{"to": "a@example.com"}'
    request = post("/send_email/v1/send", body).replace(
        b"\r\n\r\n", b"\r\nX-Title: caf\xe9\r\n\r\n", 1
    )
    answer = exchange(env.proxy.url, request)
    assert answer.status == 400, answer
    assert b"x-title" in answer.body.lower() and b"UTF-8" in answer.body
    assert len(env.seen) == before


def test_a_read_only_call_to_a_dead_upstream_is_502_upstream_unreachable(env: Env) -> None:
    """A read-only endpoint whose upstream is down answers 502 in the provider's shape."""
    response = env.client.get("/anthropic/v1/models")
    assert response.status_code == 502, response.text
    body = response.json()
    assert body["type"] == "error"  # the anthropic dialect
    error_of(502, body, "upstream_unreachable")
    assert response.headers["x-should-retry"] == "true"  # a read may always be retried


def send_email(env: Env, headers: dict[str, str]) -> tuple[httpx.Response, dict[bytes, bytes]]:
    """POST a send_email request with ``headers``; its answer (a 200) and the headers the
    recording upstream received."""
    before = len(env.seen)
    response = env.client.post("/send_email/v1/send", json={"to": "a@example.com"}, headers=headers)
    assert response.status_code == 200, response.text
    return response, dict(env.seen[before].headers)


def test_effectguard_headers_never_cross_the_proxy(env: Env) -> None:
    """Client ``effectguard-*`` headers never go upstream; upstream ones never reach the
    client, whose only call id is the proxy's own."""
    response, sent = send_email(
        env,
        {
            "Effectguard-Call-Id": "client-forged",
            "Effectguard-Replayed": "true",
            "Effectguard-Budget": "team-x",
            "Effectguard-Anything": "x",
        },
    )
    forwarded = list(sent)
    assert not [k for k in forwarded if k.startswith(b"effectguard-")], forwarded
    assert "effectguard-replayed" not in response.headers
    call_ids = response.headers.get_list(CALL_ID)
    assert len(call_ids) == 1 and call_ids[0] not in UPSTREAM_OWN_HEADERS.values()


def test_headers_that_reroute_a_request_never_go_upstream(env: Env) -> None:
    """``X-Original-URL`` and its kin make some servers serve another path or method than
    the request line's, the one the guard checked and recorded: they are dropped, the
    rest of the client's headers are not."""
    _, forwarded = send_email(
        env,
        {
            "X-Original-URL": "/admin/delete-all",
            "X-Rewrite-URL": "/admin/delete-all",
            "X-HTTP-Method-Override": "DELETE",
            "X-HTTP-Method": "DELETE",
            "X-Method-Override": "DELETE",
            "X-Client-Tag": "kept",
        },
    )
    assert forwarded.get(b"x-client-tag") == b"kept", forwarded
    assert not {k for k in forwarded if b"original" in k or b"rewrite" in k or b"method" in k}


def test_a_replay_carries_no_upstream_effectguard_header(env: Env) -> None:
    """The stored response of a keyed call is replayed without the upstream's forged headers."""
    headers = {"Idempotency-Key": "edge-replay-1"}
    first = env.client.post("/send_email/v1/send", json={"to": "b@example.com"}, headers=headers)
    again = env.client.post("/send_email/v1/send", json={"to": "b@example.com"}, headers=headers)
    assert first.status_code == again.status_code == 200, again.text
    assert again.headers.get_list("effectguard-replayed") == ["true"]
    assert again.headers.get_list(CALL_ID) == [first.headers[CALL_ID]]


def test_ledger_files_are_owner_only(env: Env) -> None:
    """The ledger, its -wal/-shm files and the worker lock directory are not group/other
    readable (they hold prompts and responses)."""
    ledger = Path(env.proxy.ledger)
    files = [ledger, Path(f"{ledger}-wal"), Path(f"{ledger}-shm")]
    lock_dir = Path(f"{ledger}.workers")
    locks = list(lock_dir.iterdir())
    assert locks
    for path in [*files, *locks]:
        assert path.stat().st_mode & 0o077 == 0, f"{path}: {oct(path.stat().st_mode)}"
    assert lock_dir.stat().st_mode & 0o077 == 0, oct(lock_dir.stat().st_mode)


async def test_an_unexpected_exception_is_a_provider_shaped_500_with_the_call_id(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A fault inside the call path answers 500 ``internal_error`` with the call id and
    ``x-should-retry: false``, logs one short line, counts it, and leaves the call
    ``effect_unknown`` rather than in flight."""
    from effectguard.config.settings import load_settings
    from effectguard.ingress.server import create_app
    from effectguard.telemetry.metrics import Metrics

    def broken(request: httpx.Request) -> httpx.Response:
        raise RuntimeError("a bug " + "x" * 5000)

    settings = load_settings(ledger=str(tmp_path / "l.db"), upstreams={"openai": "http://up"})
    metrics = Metrics()
    app = create_app(settings, inner=httpx.MockTransport(broken), metrics=metrics)
    await app.startup()
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://proxy"
        ) as client:
            with caplog.at_level(logging.INFO):
                response = await client.post(OPENAI_CHAT, json=chat("boom"))
        assert app.guard is not None
        await app.guard.recorder.drain(10)  # the marking runs in the background
        stages = {c.call_id: c.stage for c in await app.runtime.ledger.calls()}
    finally:
        await app.shutdown()
    assert response.status_code == 500, response.text
    error = error_of(500, response.json(), "internal_error")
    call_id = response.headers[CALL_ID]
    assert error["call_id"] == call_id
    assert response.headers["x-should-retry"] == "false"
    records = [r for r in caplog.records if r.name.startswith("effectguard")]
    assert len([r for r in records if r.levelno >= logging.ERROR]) == 1
    assert all(r.exc_info is None for r in records if r.levelno > logging.DEBUG)
    assert all(len(r.getMessage()) < 1000 for r in records)
    assert metrics.registry.get_sample_value("effectguard_internal_errors_total") == 1
    assert stages == {call_id: "effect_unknown"}


async def test_an_internal_errors_traceback_stays_on_its_text_log_line(tmp_path: Path) -> None:
    """``serve --log-format text --log-level debug``: the traceback logged for a 500
    ``internal_error`` is a field of its record's one line (docs/logs-and-traces.md: a
    record is always one line), not lines of its own that no reader can tell apart."""
    from effectguard.config.settings import load_settings
    from effectguard.ingress.server import create_app
    from effectguard.telemetry.logs import configure_logging

    def broken(request: httpx.Request) -> httpx.Response:
        raise RuntimeError("a bug\nsecond line of its text")

    root = logging.getLogger()
    kept = (list(root.handlers), root.level, logging.getLogger("effectguard").level)
    out = io.StringIO()
    configure_logging("text", "debug", stream=out)
    settings = load_settings(ledger=str(tmp_path / "l.db"), upstreams={"openai": "http://up"})
    app = create_app(settings, inner=httpx.MockTransport(broken))
    await app.startup()
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://proxy"
        ) as client:
            response = await client.post(OPENAI_CHAT, json=chat("boom"))
    finally:
        await app.shutdown()
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in kept[0]:
            root.addHandler(handler)
        root.setLevel(kept[1])
        logging.getLogger("effectguard").setLevel(kept[2])
    assert response.status_code == 500, response.text
    lines = out.getvalue().splitlines()
    record = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (DEBUG|INFO|WARNING|ERROR) ")
    assert all(record.match(line) for line in lines), [ln for ln in lines if not record.match(ln)]
    (traceback,) = [ln for ln in lines if "internal error traceback" in ln]
    assert "Traceback (most recent call last)" in traceback
    assert "RuntimeError: a bug\\nsecond line of its text" in traceback


async def test_an_unexpected_exception_on_a_tool_route_is_in_the_tools_shape(
    tmp_path: Path,
) -> None:
    """The 500 ``internal_error`` on Postmark's and Stripe's routes comes in their shapes
    (docs/contract.md §9): postmarker raises its ClientError, not a KeyError, and
    stripe-python is told not to retry by the header it reads."""
    from effectguard.config.settings import load_settings
    from effectguard.ingress.server import create_app

    def broken(request: httpx.Request) -> httpx.Response:
        raise RuntimeError("a bug")

    upstreams = {"postmark": "http://pm", "stripe": "http://st"}
    settings = load_settings(ledger=str(tmp_path / "l.db"), upstreams=upstreams)
    app = create_app(settings, inner=httpx.MockTransport(broken))
    await app.startup()
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://proxy"
        ) as client:
            email = {"From": "a@example.com", "To": "b@example.com", "TextBody": "t"}
            postmark = await client.post("/postmark/email", json=email,
                                         headers={"X-Postmark-Server-Token": "pm"})  # fmt: skip
            stripe = await client.post("/stripe/v1/customers", data={"email": "b@example.com"})
    finally:
        await app.shutdown()
    assert (postmark.status_code, postmark.json()["ErrorCode"]) == (500, 9500)
    assert postmark.json()["effectguard"]["call_id"] == postmark.headers[CALL_ID]
    assert postmark.json()["Message"].startswith("internal_error: ")
    assert stripe.status_code == 500
    assert error_of(500, stripe.json(), "internal_error")["call_id"] == stripe.headers[CALL_ID]
    assert stripe.headers["stripe-should-retry"] == stripe.headers["x-should-retry"] == "false"


BROWSER_REQUESTS = {
    # fetch(url, {method: "POST", mode: "no-cors", body}) from any site: no preflight.
    "cross-site form": {
        "origin": "https://evil.example",
        "sec-fetch-site": "cross-site",
        "content-type": "text/plain",
    },
    # After a DNS rebinding the page is "same-origin" with a Host of its own choosing.
    "rebound page": {
        "host": "attacker.example",
        "origin": "http://attacker.example",
        "sec-fetch-site": "same-origin",
    },
    "an older browser": {"origin": "null"},
    "a navigation": {"sec-fetch-mode": "navigate"},
}


@pytest.mark.parametrize("headers", BROWSER_REQUESTS.values(), ids=list(BROWSER_REQUESTS))
def test_a_web_browsers_request_is_refused_while_no_keys_are_configured(
    env: Env, headers: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Without proxy keys the proxy spends freely, with the provider keys it holds: a web
    page the operator visits must not be able to spend through it, nor read its metrics."""
    before = (len(env.provider.effects()), len(env.calls(capsys)))
    content = json.dumps(chat("from a web page")).encode()
    response = env.client.post(OPENAI_CHAT, content=content, headers=headers)
    assert response.status_code == 403, response.text
    error_of(403, response.json(), "browser_forbidden")
    assert response.headers.get(CALL_ID) is None
    metrics = env.client.get("/metrics", headers=headers)
    assert metrics.status_code == 403
    error_of(403, metrics.json(), "browser_forbidden")
    assert (len(env.provider.effects()), len(env.calls(capsys))) == before
    # The same request from an agent, which sends none of those headers, is served.
    assert env.client.post(OPENAI_CHAT, content=content).status_code == 200
