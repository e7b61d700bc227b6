"""The proxy's logs as an operator and a log pipeline read them, from a real
``effectguard serve``: what docs/logs-and-traces.md and docs/configuration.md promise
about access lines holds for each outcome."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from leavekit import leave_with_reset
from observing import wait_for

from effectguard.testing import FakeProvider, fake_provider, running_proxy, start_proxy

pytestmark = pytest.mark.slow

OPENAI_CHAT = "/openai/v1/chat/completions"
CALL_ID = "effectguard-call-id"
TENANT_KEY = "eg-logwalk-tenant-key-0123456789"


@pytest.fixture
def provider(tmp_path: Path) -> Iterator[FakeProvider]:
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        yield fake


def chat(content: str = "hello") -> dict[str, Any]:
    return {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": content}]}


def access_lines(log: str) -> list[dict[str, Any]]:
    """Every JSON access line of a ``--log-format json`` log (each line must parse)."""
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("event") == "access"]


def test_access_lines_name_the_proxy_key(tmp_path: Path, provider: FakeProvider) -> None:
    """configuration.md: a `[[keys]]` entry's `name` is "printed in access lines". Each
    line of a request made with a key names it as the field `key` (JSON and text), a
    refusal's line too; a proxy with no keys writes no `key` field."""
    digest = hashlib.sha256(TENANT_KEY.encode()).hexdigest()
    config = tmp_path / "keys.toml"
    config.write_text(
        f'[budgets]\n"team-a/poor" = "0.000000001"\n'
        f'[[keys]]\nname = "ci-runner"\nsha256 = "{digest}"\nbudget_root = "team-a"\n'
    )
    upstreams = {"openai": provider.url}
    headers = {"Authorization": f"Bearer {TENANT_KEY}"}
    for log_format in ("json", "text"):
        args = ["--config", str(config), "--log-format", log_format]
        ledger = tmp_path / f"{log_format}.db"
        with running_proxy(ledger, upstreams=upstreams, args=args) as proxy:
            done = httpx.post(proxy.url + OPENAI_CHAT, json=chat(), headers=headers, timeout=10)
            poor = httpx.post(
                proxy.url + OPENAI_CHAT,
                json=chat(),
                headers={**headers, "Effectguard-Budget": "team-a/poor"},
                timeout=10,
            )
        assert (done.status_code, poor.status_code) == (200, 402)
        log = proxy.log()
        assert TENANT_KEY not in log
        if log_format == "json":
            access = access_lines(log)
            assert [(line["status"], line.get("key")) for line in access] == [
                (200, "ci-runner"),
                (402, "ci-runner"),
            ], access
        else:
            access = [line for line in log.splitlines() if "effectguard.access" in line]
            assert len(access) == 2 and all(
                "key=ci-runner" in line.split(" ") for line in access
            ), access
    json_args = ["--log-format", "json"]
    with running_proxy(tmp_path / "open.db", upstreams=upstreams, args=json_args) as p:
        assert httpx.post(p.url + OPENAI_CHAT, json=chat(), timeout=10).status_code == 200
    (line,) = access_lines(p.log())
    assert "key" not in line, line


def test_a_client_that_left_before_its_refusal_is_logged_499(
    tmp_path: Path, provider: FakeProvider
) -> None:
    """logs-and-traces.md: `status` is 499 for "a proxy client whose connection was gone
    when its whole answer came to be written". A client whose connection is reset 0.3 s
    into a call answered 504 `effect_unknown` at 1 s got nothing: its line says 499 (with
    the call's stage, outcome and error), as a 200's does. It used to say 504."""
    config = tmp_path / "slow.toml"
    config.write_text("[upstream]\nread_timeout_s = 1\n")
    args = ["--config", str(config), "--log-format", "json"]
    slow = {"x-fake-delay": "3"}
    with running_proxy(tmp_path / "l.db", upstreams={"openai": provider.url}, args=args) as proxy:
        leave_with_reset(proxy.url, OPENAI_CHAT, chat("left"), slow, 0.3)
        stayed = httpx.post(proxy.url + OPENAI_CHAT, json=chat("stayed"), headers=slow, timeout=10)
        assert stayed.status_code == 504

        def both() -> list[dict[str, Any]]:
            lines = access_lines(proxy.log())
            return lines if len(lines) == 2 else []

        access = wait_for(both, 10, "two access lines")
    by_call = {line["call_id"]: line for line in access}
    assert by_call.pop(stayed.headers[CALL_ID])["status"] == 504
    ((_, left),) = by_call.items()
    assert (left["status"], left["stage"], left["outcome"], left["error"]) == (
        499,
        "effect_unknown",
        "effect_unknown",
        "effect_unknown",
    ), left


def _raw_request(url: str, request: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(request)
        return sock.recv(65536)


def test_requests_refused_at_the_front_door_get_no_access_line(
    tmp_path: Path, provider: FakeProvider
) -> None:
    """logs-and-traces.md lists what is refused before the guard and gets no access line:
    a path refused as it came (an encoded line break), a header value that is not UTF-8,
    a web browser's request to a proxy without keys, an unknown provider, and a request
    the HTTP parser rejects, which gets one `uvicorn.error` warning line instead (a JSON
    line like any other). Only the one request through the guard has an access line."""
    args = ["--log-format", "json"]
    with running_proxy(tmp_path / "l.db", upstreams={"openai": provider.url}, args=args) as proxy:
        assert httpx.get(proxy.url + "/openai/v1/x%0aforged", timeout=5).status_code == 400
        browser = {"Origin": "http://example.com"}
        assert httpx.post(proxy.url + OPENAI_CHAT, json=chat(), headers=browser).status_code == 403
        assert httpx.get(proxy.url + "/nope/v1/models", timeout=5).status_code == 404
        head = b"POST /openai/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        latin = _raw_request(proxy.url, head + b"X-Note: caf\xe9\r\nContent-Length: 2\r\n\r\n{}")
        assert latin.startswith(b"HTTP/1.1 400"), latin
        bad = _raw_request(proxy.url, b"GET /openai/v1/a\x1bb HTTP/1.1\r\nHost: x\r\n\r\n")
        assert bad.startswith(b"HTTP/1.1 400"), bad
        assert httpx.post(proxy.url + OPENAI_CHAT, json=chat(), timeout=10).status_code == 200
    lines = [json.loads(line) for line in proxy.log().splitlines() if line.startswith("{")]
    assert [line["status"] for line in lines if line.get("event") == "access"] == [200]
    parser = [line for line in lines if line["logger"] == "uvicorn.error"]
    assert [(line["level"], line["message"]) for line in parser] == [
        ("warning", "Invalid HTTP request received.")
    ], parser


def test_an_appended_log_rotates_by_copytruncate_and_sighup_stops_serve(
    tmp_path: Path, provider: FakeProvider
) -> None:
    """logs-and-traces.md, "Volume, destination and rotation": with stderr appended to a
    file, a copytruncate leaves the file starting with the next whole line; SIGHUP is no
    reopen signal, it ends the process at once (no drain)."""
    log_path = tmp_path / "serve.log"
    args = ["--log-format", "json"]
    upstreams = {"openai": provider.url}
    proxy = start_proxy(tmp_path / "l.db", upstreams=upstreams, args=args, log_path=log_path)
    try:
        assert httpx.post(proxy.url + OPENAI_CHAT, json=chat(), timeout=10).status_code == 200
        wait_for(lambda: access_lines(log_path.read_text()), 10, "the first access line")
        rotated = tmp_path / "serve.log.1"
        rotated.write_bytes(log_path.read_bytes())
        os.truncate(log_path, 0)
        assert httpx.post(proxy.url + OPENAI_CHAT, json=chat(), timeout=10).status_code == 200
        text = wait_for(lambda: log_path.read_text(), 10, "a line after the truncation")
        assert text.startswith('{"time": '), text[:40]
        assert [line["status"] for line in access_lines(text)] == [200]
        assert len(access_lines(rotated.read_text())) == 1
        proxy.process.send_signal(signal.SIGHUP)
        assert proxy.process.wait(timeout=10) == 0
        lines = [json.loads(line) for line in log_path.read_text().splitlines()]
        hup = [line for line in lines if "SIGHUP" in line["message"]]
        assert [line["level"] for line in hup] == ["warning"], hup
    finally:
        proxy.kill()


def test_a_broken_stream_is_logged_by_effectguard_alone(tmp_path: Path) -> None:
    """logs-and-traces.md: a stream the provider broke has its `interrupted` line, a
    `stream cut off` warning and an access line (200, effect_unknown, stream_broken),
    each naming the call, and no line of uvicorn's (the docs said one followed)."""
    args = ["--log-format", "json"]
    with (
        fake_provider(tmp_path / "receipts.jsonl", break_after=2) as breaking,
        running_proxy(tmp_path / "l.db", upstreams={"openai": breaking.url}, args=args) as proxy,
    ):
        body = {**chat(), "stream": True}
        with (
            pytest.raises(httpx.RemoteProtocolError),
            httpx.stream("POST", proxy.url + OPENAI_CHAT, json=body, timeout=10) as response,
        ):
            call_id = response.headers[CALL_ID]
            response.read()
        wait_for(lambda: access_lines(proxy.log()), 10, "the stream's access line")
    # Read once serve has stopped: a line written after the access line is in it too.
    lines = [json.loads(x) for x in proxy.log().splitlines() if x.startswith("{")]
    named = {(line["logger"], line.get("event")): line for line in lines}
    access = named[("effectguard.access", "access")]
    assert (access["status"], access["stage"], access["error"]) == (
        200,
        "effect_unknown",
        "stream_broken",
    )
    assert named[("effectguard.events", "interrupted")]["call_id"] == call_id
    assert named[("effectguard.ingress.server", None)]["call_id"] == call_id
    assert not [line for line in lines if line["logger"].startswith("uvicorn")], lines


def test_a_python_warning_is_a_log_line_too(tmp_path: Path) -> None:
    """logs-and-traces.md: with `json`, every line is one JSON object. A warning a library
    raises inside serve (here a reconcile hook's module, at import) used to be written by
    Python's `warnings` as three raw lines of text among the JSON; it is now a record of
    logger `py.warnings`, one line in the configured format."""
    modules = tmp_path / "mods"
    modules.mkdir()
    (modules / "warnhook.py").write_text(
        "import warnings\n"
        'warnings.warn("old library\\nsecond line", FutureWarning)\n'
        "def did_it_happen(call):\n"
        "    return None\n"
    )
    config = tmp_path / "hook.toml"
    config.write_text('[guard]\nreconcile_hook = "warnhook:did_it_happen"\n')
    for log_format in ("json", "text"):
        args = ["--config", str(config), "--log-format", log_format]
        env = {"PYTHONPATH": str(modules)}
        with running_proxy(tmp_path / f"{log_format}.db", args=args, env=env) as proxy:
            pass
        lines = [x for x in proxy.log().splitlines() if not x.startswith("effectguard listening")]
        warned = [line for line in lines if "FutureWarning" in line]
        assert len(warned) == 1, lines
        if log_format == "json":
            record = json.loads(warned[0])
            assert record["logger"] == "py.warnings" and record["level"] == "warning"
            assert "old library\nsecond line" in record["message"]
            assert all(json.loads(line) for line in lines)
        else:
            assert " WARNING py.warnings: " in warned[0], warned


def test_a_thread_that_dies_inside_serve_is_one_log_line(tmp_path: Path) -> None:
    """A thread a library starts inside serve (here a reconcile hook's module) that dies
    with an exception: Python wrote its traceback raw, many lines among the JSON; it is
    now one error line of logger `effectguard.threads` with the traceback as `exception`."""
    modules = tmp_path / "mods"
    modules.mkdir()
    (modules / "threadhook.py").write_text(
        "import threading\n"
        "def _die():\n"
        '    raise RuntimeError("a library thread died")\n'
        "_thread = threading.Thread(target=_die, name='lib-worker')\n"
        "_thread.start()\n"
        "_thread.join()\n"
        "def did_it_happen(call):\n"
        "    return None\n"
    )
    config = tmp_path / "hook.toml"
    config.write_text('[guard]\nreconcile_hook = "threadhook:did_it_happen"\n')
    args = ["--config", str(config), "--log-format", "json"]
    env = {"PYTHONPATH": str(modules)}
    with running_proxy(tmp_path / "l.db", args=args, env=env) as proxy:
        pass
    lines = [x for x in proxy.log().splitlines() if not x.startswith("effectguard listening")]
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(records) == len(lines), lines
    (died,) = [r for r in records if "a library thread died" in r.get("exception", "")]
    assert (died["logger"], died["level"]) == ("effectguard.threads", "error"), died
    assert "lib-worker" in died["message"]
