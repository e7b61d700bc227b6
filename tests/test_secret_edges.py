"""Secrets and hostile text at the proxy's edges, through a real ``effectguard serve``.

A provider whose credential header is its own (``x-echo-token``, as Postmark's
``x-postmark-server-token``), an upstream that answers with a broken status line, proxy
keys, and text or JSON logs. No proxy key or client credential goes upstream where
effectguard holds the provider key; a URL's query string (where a credential may ride)
reaches no log line, ledger row or answer; and a client's control characters or long
values never make a log line into more than one line, or a long one.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import shlex
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from observing import wait_for
from test_proxy_input import recording_upstream

from effectguard.config.keysettings import hash_key
from effectguard.ops.cli import main as cli_main
from effectguard.testing import Proxy, running_proxy

pytestmark = pytest.mark.slow

PROVIDER_KEY = "sk-canary-token-provider"
DECLARATION = """
name = "NAME"
base_url = "http://127.0.0.1:9"
dialect = "openai"
api_key_env = "EFFECTGUARD_TEST_TOKEN_KEY"
key_header = "x-echo-token"
key_format = "{key}"
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
OPENAI = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
CHAT = {"model": "echo-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


@contextlib.contextmanager
def broken_status_line(line: bytes = b"HTTP/1.1 2x0 WHAT") -> Iterator[str]:
    """An upstream that reads a request and answers with a status line no client can parse
    (aiohttp's error then quotes the request's whole URL, query included, and the line)."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5)
                seen = b""
                while b"\r\n\r\n" not in seen:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    seen += chunk
                conn.sendall(line + b"\r\n\r\n")

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        server.close()


class Edge:
    """The module's proxy (text logs, one proxy key) and what its echo upstream saw."""

    def __init__(self, proxy: Proxy, seen: list[list[tuple[str, str]]], key: str) -> None:
        self.proxy = proxy
        self.seen = seen
        self.key = key
        self.client = httpx.Client(base_url=proxy.url, timeout=10)


def _declarations(tmp: Path) -> Path:
    folder = tmp / "providers"
    folder.mkdir()
    for name in ("tokenecho", "badline"):
        (folder / f"{name}.toml").write_text(DECLARATION.replace("NAME", name))
    return folder


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    """A proxy with a proxy key for root ``edge``, text logs at debug."""
    tmp = tmp_path_factory.mktemp("edge")
    key = "eg-canary-" + secrets.token_urlsafe(16)
    config = tmp / "config.toml"
    config.write_text(
        f'[[keys]]\nname = "edge"\nsha256 = "{hash_key(key)}"\nbudget_root = "edge"\n'
    )
    args = ["--config", str(config), "--providers", str(_declarations(tmp))]
    args += ["--log-format", "text", "--log-level", "debug"]
    with (
        recording_upstream() as (echo_url, seen),
        broken_status_line() as broken_url,
        running_proxy(
            tmp / "ledger.db",
            upstreams={"tokenecho": echo_url, "badline": broken_url},
            args=args,
            env={"EFFECTGUARD_TEST_TOKEN_KEY": PROVIDER_KEY},
        ) as proxy,
    ):
        environment = Edge(proxy, seen, key)
        try:
            yield environment
        finally:
            environment.client.close()


def _ledger_bytes(proxy: Proxy) -> bytes:
    ledger = Path(proxy.ledger)
    return b"".join(p.read_bytes() for p in (ledger, Path(f"{ledger}-wal")) if p.exists())


def test_a_proxy_key_in_the_providers_own_key_header_never_goes_upstream(edge: Edge) -> None:
    """A tenant's SDK sends its proxy key in the provider's credential header: it admits the
    call, and upstream gets that header once, with the provider key effectguard holds. A
    client's own credential there is replaced the same way."""
    for headers in (
        {"x-echo-token": edge.key},
        {"Effectguard-Key": edge.key, "x-echo-token": "sk-canary-client-own-token"},
    ):
        before = len(edge.seen)
        answer = edge.client.post("/tokenecho/v1/chat/completions", json=CHAT, headers=headers)
        assert answer.status_code == 200, answer.text
        assert len(edge.seen) == before + 1
        forwarded = [(k.lower(), v) for k, v in edge.seen[-1]]
        assert [v for k, v in forwarded if k == "x-echo-token"] == [PROVIDER_KEY]
        sent = repr(forwarded)
        assert edge.key not in sent and "sk-canary-client-own-token" not in sent


def test_a_query_string_in_an_upstream_error_reaches_no_log_ledger_or_answer(
    edge: Edge, capsys: pytest.CaptureFixture[str]
) -> None:
    """An upstream error whose text quotes the request URL (a bad status line) is recorded
    and answered without the URL's query, where a credential may ride (``?key=``)."""
    canary = "canary-query-" + secrets.token_hex(6)
    answer = edge.client.post(
        f"/badline/v1/chat/completions?key={canary}",
        json=CHAT,
        headers={"Effectguard-Key": edge.key},
    )
    assert answer.status_code == 502, answer.text
    error = answer.json()["error"]
    assert error["type"] == "effect_unknown" and "Bad status line" in error["message"]
    call_id = answer.headers["effectguard-call-id"]
    capsys.readouterr()
    assert cli_main(["show", call_id, "--ledger", edge.proxy.ledger]) == 0
    shown = capsys.readouterr().out
    for where in (answer.text, shown, edge.proxy.log()):
        assert canary not in where
    assert canary.encode() not in _ledger_bytes(edge.proxy)
    # The error is still told, by the parser's own words; the URL (query and all) is no
    # longer part of it (since d8d5a48: aiohttp's message named a status 400 never sent).
    assert "interrupted" in shown and "BadStatusLine: Bad status line" in shown
    assert "?key" not in shown and "?…" not in shown


def _logged(edge: Edge, needle: str) -> str:
    """The proxy's log once it holds ``needle``, else the empty string."""
    log = edge.proxy.log()
    return log if needle in log else ""


def test_text_log_lines_stay_one_short_printable_line(edge: Edge) -> None:
    """A path with a C1 control (a terminal's CSI) and a direction override, and a long
    budget holding a line separator, are logged escaped and cut: every line of the log is
    printable (str.splitlines splits at U+2028 and U+0085 too) and none is long."""
    key = {"Effectguard-Key": edge.key}
    hostile = "/tokenecho/v1/chat/x%C2%9B31m%E2%80%AEevil%C2%85"
    assert edge.client.post(hostile, json=CHAT, headers=key).status_code == 200
    budget = ("edge/" + "x" * 2000 + "\u2028").encode()
    refused = edge.client.post(
        "/tokenecho/v1/chat/completions", json=CHAT, headers={**key, "Effectguard-Budget": budget}
    )
    assert refused.status_code == 400, refused.text
    # The access line is written once the answer is sent: the client can read first.
    log = wait_for(lambda: _logged(edge, "error=invalid_budget"), 10, "the refusal's line")
    lines = log.splitlines()
    assert all(line.isprintable() for line in lines), [ln for ln in lines if not ln.isprintable()]
    access = [line for line in lines if "event=access" in line]
    assert any("\\u009b31m\\u202eevil\\u0085" in line for line in access), access
    assert max(len(line) for line in lines) < 1500
    assert any("error=invalid_budget" in line for line in access), access


def test_a_path_cannot_add_fields_to_a_text_access_line(edge: Edge) -> None:
    """A path with encoded spaces that spell ``key=value`` pairs (a forged call id and
    status) is one quoted word in the text access line: read as ``key=value`` words, the
    line holds only the fields effectguard wrote, the real call id among them."""
    forged = "/tokenecho/v1/chat/x%20200%20event=access%20call_id=call_forged%20status=200"
    answer = edge.client.post(forged, json=CHAT, headers={"Effectguard-Key": edge.key})
    assert answer.status_code == 200, answer.text
    log = wait_for(lambda: _logged(edge, "call_forged"), 10, "the forged path's access line")
    lines = [ln for ln in log.splitlines() if "call_forged" in ln]
    assert len(lines) == 1, lines
    words = shlex.split(lines[0])
    assert [w for w in words if w.startswith("call_id=")] == [
        f"call_id={answer.headers['effectguard-call-id']}"
    ]
    assert [w for w in words if w.startswith("status=")] == ["status=200"]
    assert "/tokenecho/v1/chat/x 200 event=access call_id=call_forged status=200" in words


#: A text line's words, as a logfmt reader takes them: ``key="..."`` and ``"..."`` (JSON
#: strings, escapes and all) are one word each, anything else runs to the next space.
_WORD = re.compile(r'\w+="(?:[^"\\]|\\.)*"|"(?:[^"\\]|\\.)*"|\S+')


def test_an_upstreams_text_cannot_add_fields_to_a_text_incident_line(tmp_path: Path) -> None:
    """An upstream's broken status line, quoted in the error an interrupt records, carries
    a ``"`` and ``key=value`` words: in the text incident line it stays inside one quoted
    word, so the only ``call_id`` a logfmt reader finds is the call's own."""
    line = b'HTTP/1.1 2x0 x" call_id=call_forged status="200'
    with (
        broken_status_line(line) as url,
        running_proxy(
            tmp_path / "ledger.db", upstreams={"openai": url}, args=["--log-format", "text"]
        ) as proxy,
    ):
        answer = httpx.post(proxy.url + "/openai/v1/chat/completions", json=OPENAI, timeout=10)
    assert answer.status_code == 502, answer.text
    call_id = answer.headers["effectguard-call-id"]
    incidents = [ln for ln in proxy.log().splitlines() if "event=interrupted" in ln]
    assert len(incidents) == 1 and "call_forged" in incidents[0], incidents
    for text in proxy.log().splitlines():
        fields = [w for w in _WORD.findall(text) if w.startswith(("call_id=", "status="))]
        assert "call_id=call_forged" not in fields, text
        assert all(f == f"call_id={call_id}" for f in fields if f.startswith("call_id=")), text


def test_json_log_lines_stay_one_object_per_line_for_any_splitter(tmp_path: Path) -> None:
    """With JSON logs, a client's C1 control, line separator or direction override is written
    as a JSON escape: each line of the log, however split, is one JSON object."""
    config = tmp_path / "config.toml"
    config.write_text("")
    args = ["--providers", str(_declarations(tmp_path)), "--log-format", "json"]
    with (
        recording_upstream() as (echo_url, _),
        running_proxy(
            tmp_path / "ledger.db",
            upstreams={"tokenecho": echo_url},
            args=args,
            env={"EFFECTGUARD_TEST_TOKEN_KEY": PROVIDER_KEY},
        ) as proxy,
    ):
        path = "/tokenecho/v1/chat/x%C2%9B31m%E2%80%A8%E2%80%AEz%C3%A9"
        assert httpx.post(proxy.url + path, json=CHAT, timeout=10).status_code == 200
    objects = [json.loads(line) for line in proxy.log().splitlines() if line.startswith("{")]
    access = [o for o in objects if o.get("event") == "access"]
    assert [o["endpoint"] for o in access] == ["/v1/chat/x\u009b31m\u2028\u202ez\u00e9"]
