"""A provider error that quotes the provider key: the key reaches no client, ledger,
``show`` or log (docs/contract.md, "Secrets").

Some APIs echo a bad key in their 401 message ("Incorrect API key provided: sk-...").
effectguard holds that key for its tenants, who must never learn it; before the mask, the
error body went whole into the ledger, ``show`` and the tenant's answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import secrets
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx

from effectguard import AsyncGuardTransport
from effectguard.ops.cli import main as cli_main
from effectguard.testing import running_proxy

URL = "https://api.openai.com/v1/chat/completions"
CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
MASK = "[provider key masked]"


def _refusal(key: str) -> bytes:
    """OpenAI's 401 for a bad key, quoting it whole (twice, once JSON-escaped alike)."""
    message = f"Incorrect API key provided: {key}. You passed {key}."
    return json.dumps({"error": {"message": message, "type": "invalid_request_error"}}).encode()


def _escaping_refusal(key: str) -> bytes:
    """The same 401 written as PHP's ``json_encode`` writes JSON: ``"`` as ``\\"`` and ``/``
    as ``\\/`` both, so a key holding both is quoted in neither single-escape form."""
    return _refusal(key).replace(b"/", b"\\/")


def _shown(call_id: str, ledger: str, capsys: pytest.CaptureFixture[str]) -> str:
    """``show --json`` (the answer's body included) of ``call_id``."""
    capsys.readouterr()
    assert cli_main(["show", call_id, "--json", "--ledger", ledger]) == 0
    return capsys.readouterr().out


def _ledger_bytes(ledger: str) -> bytes:
    files = (Path(ledger), Path(f"{ledger}-wal"))
    return b"".join(p.read_bytes() for p in files if p.exists())


async def test_an_error_quoting_the_key_is_masked_in_process(
    make_transport: Callable[..., AsyncGuardTransport],
    finish: Callable[[AsyncGuardTransport], Awaitable[None]],
    ledger_path: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """In process, the key is the one the application's request carries: its error answer,
    the ledger and ``show`` hold the mask in its place; the rest of the message stays."""
    key = "sk-canary-" + secrets.token_hex(12)
    transport = make_transport()
    client = httpx.AsyncClient(transport=transport)
    with respx.mock(assert_all_called=True) as mock:
        mock.post(URL).respond(401, content=_refusal(key), content_type="application/json")
        answer = await client.post(URL, json=CHAT, headers={"authorization": f"Bearer {key}"})
    assert answer.status_code == 401
    assert key not in answer.text
    assert answer.json()["error"]["message"] == (
        f"Incorrect API key provided: {MASK}. You passed {MASK}."
    )
    call_id = answer.headers["effectguard-call-id"]
    await finish(transport)
    shown = await asyncio.to_thread(_shown, call_id, ledger_path, capsys)
    assert key not in shown
    assert key.encode() not in _ledger_bytes(ledger_path)


class _ByteByByte(httpx.AsyncByteStream):
    """A body sent one byte per chunk: every occurrence of the key is cut by chunk ends."""

    def __init__(self, body: bytes) -> None:
        self.body = body

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for n in range(len(self.body)):
            yield self.body[n : n + 1]


async def test_a_read_whose_error_comes_in_pieces_has_the_key_masked_in_process(
    make_transport: Callable[..., AsyncGuardTransport],
) -> None:
    """A read is forwarded as it streams in: a key cut across chunks is still masked, and
    every other byte arrives, in order."""
    key = "sk-canary-" + secrets.token_hex(12)
    client = httpx.AsyncClient(transport=make_transport())
    models = "https://api.openai.com/v1/models"
    with respx.mock(assert_all_called=True) as mock:
        mock.get(models).respond(401, stream=_ByteByByte(b"x" + _refusal(key) + b"y"))
        answer = await client.get(models, headers={"authorization": f"Bearer {key}"})
    assert answer.status_code == 401
    masked = _refusal(key).replace(key.encode(), MASK.encode())
    assert answer.content == b"x" + masked + b"y"


@contextlib.contextmanager
def key_quoting_upstream(refusal: Callable[[str], bytes] = _refusal) -> Iterator[str]:
    """An upstream that refuses every request with a 401 quoting its bearer key, the
    body written by ``refusal``."""

    class Refuse(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.do_POST()

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", "0")))
            key = (self.headers.get("authorization") or "").removeprefix("Bearer ")
            body = refusal(key)
            self.send_response(401)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            """Quiet."""

    server = ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.mark.slow
def test_the_proxy_never_tells_its_tenant_the_provider_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through the proxy, which injects ``$OPENAI_API_KEY``: the provider's 401 quoting it
    reaches the tenant, ``show``, the ledger file and the debug log masked."""
    key = "sk-canary-" + secrets.token_hex(12)
    args = ["--log-level", "debug"]
    with (
        key_quoting_upstream() as url,
        running_proxy(
            tmp_path / "ledger.db",
            upstreams={"openai": url},
            args=args,
            env={"OPENAI_API_KEY": key},
        ) as proxy,
    ):
        answer = httpx.post(proxy.url + "/openai/v1/chat/completions", json=CHAT, timeout=10)
        assert answer.status_code == 401, answer.text
        call_id = answer.headers["effectguard-call-id"]
        shown = _shown(call_id, proxy.ledger, capsys)
        ledger_bytes = _ledger_bytes(proxy.ledger)
    assert MASK in answer.text and key not in answer.text
    assert key not in shown
    assert key.encode() not in ledger_bytes
    assert call_id in proxy.log() and key not in proxy.log()


@pytest.mark.slow
def test_a_read_forwarded_untouched_still_has_the_key_masked(tmp_path: Path) -> None:
    """A read (``GET /v1/models``) is forwarded as a stream with nothing recorded: its
    401 quoting the provider key reaches the tenant masked too."""
    key = "sk-canary-" + secrets.token_hex(12)
    with (
        key_quoting_upstream() as url,
        running_proxy(
            tmp_path / "ledger.db", upstreams={"openai": url}, env={"OPENAI_API_KEY": key}
        ) as proxy,
    ):
        answer = httpx.get(proxy.url + "/openai/v1/models", timeout=10)
    assert answer.status_code == 401, answer.text
    assert answer.json()["error"]["message"] == (
        f"Incorrect API key provided: {MASK}. You passed {MASK}."
    )


def _call_and_read(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    refusal: Callable[[str], bytes],
    key: str,
    args: Sequence[str] = (),
) -> tuple[httpx.Response, httpx.Response, str, str, bytes, str]:
    """A call and a read through the proxy holding ``key``, the upstream refusing both
    with ``refusal``: the two answers, the call's id, its ``show``, the ledger's bytes
    and the proxy's log."""
    with (
        key_quoting_upstream(refusal) as url,
        running_proxy(
            tmp_path / "ledger.db",
            upstreams={"openai": url},
            args=args,
            env={"OPENAI_API_KEY": key},
        ) as proxy,
    ):
        answer = httpx.post(proxy.url + "/openai/v1/chat/completions", json=CHAT, timeout=10)
        read = httpx.get(proxy.url + "/openai/v1/models", timeout=10)
        call_id = answer.headers["effectguard-call-id"]
        shown = _shown(call_id, proxy.ledger, capsys)
        return answer, read, call_id, shown, _ledger_bytes(proxy.ledger), proxy.log()


@pytest.mark.slow
def test_a_key_holding_a_slash_and_a_quote_is_masked_when_both_are_escaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A provider that writes JSON as PHP does (``\\"`` and ``\\/`` together) quotes a key
    holding ``/`` and ``"`` in a form that is neither the plain JSON escape nor the ``\\/``
    one: the proxy's tenant, ``show`` and the ledger get the mask there too, for a call and
    for a read forwarded as it streams."""
    key = "sk-canary/" + secrets.token_hex(12) + '"/q'
    combined = json.dumps(key)[1:-1].replace("/", "\\/")
    answer, read, _, shown, ledger_bytes, _ = _call_and_read(
        tmp_path, capsys, _escaping_refusal, key
    )
    expected = f"Incorrect API key provided: {MASK}. You passed {MASK}."
    for response in (answer, read):
        assert response.status_code == 401, response.text
        assert combined not in response.text
        assert response.json()["error"]["message"] == expected
    assert combined not in shown and "canary" not in shown
    assert combined.encode() not in ledger_bytes and b"canary" not in ledger_bytes


def _utf8(key: str) -> str:
    """The key a Latin-1 reading (``http.server``'s, Node's) of its UTF-8 bytes gave."""
    return key.encode("latin-1").decode("utf-8")


def _upper_escapes(body: bytes) -> bytes:
    r"""JSON with ``\u00e9`` escapes written in capitals, as Jackson writes them."""
    return re.sub(rb"\\u([0-9a-f]{4})", lambda m: b"\\u" + m.group(1).upper(), body)


#: How providers quote a key holding non-ASCII characters, sent as UTF-8 bytes: read as
#: Latin-1 (HTTP's old charset) and written as raw UTF-8 text or as ASCII escapes of that
#: reading, or read as UTF-8 and escaped in capitals.
_NON_ASCII_QUOTES: dict[str, Callable[[str], bytes]] = {
    "latin1-read-utf8-written": lambda key: json.dumps(
        {"error": {"message": f"Incorrect API key provided: {key}."}}, ensure_ascii=False
    ).encode(),
    "latin1-read-escaped": lambda key: json.dumps(
        {"error": {"message": f"Incorrect API key provided: {key}."}}
    ).encode(),
    "utf8-read-escaped-in-capitals": lambda key: _upper_escapes(
        json.dumps({"error": {"message": f"Incorrect API key provided: {_utf8(key)}."}}).encode()
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("quote", sorted(_NON_ASCII_QUOTES))
def test_a_key_holding_non_ascii_characters_is_masked_as_providers_quote_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], quote: str
) -> None:
    """A provider key with non-ASCII characters goes upstream as UTF-8 bytes; a provider
    that reads header bytes as Latin-1 quotes it as that reading (``sk-tÃ©st``), which
    gives the key back to whoever reverses it. The tenant, ``show``, the ledger and the
    log get the mask there too."""
    key = "sk-canary-tést-ünï-" + secrets.token_hex(8)
    answer, read, call_id, shown, ledger_bytes, log = _call_and_read(
        tmp_path, capsys, _NON_ASCII_QUOTES[quote], key, ["--log-level", "debug"]
    )
    expected = f"Incorrect API key provided: {MASK}."
    for response in (answer, read):
        assert response.status_code == 401, response.text
        assert response.json()["error"]["message"] == expected, response.text
    assert "canary" not in shown and b"canary" not in ledger_bytes
    assert call_id in log and "canary" not in log
