"""HTTP hygiene at the proxy's socket, /metrics access, and the end of a SIGTERM drain.

Each test runs a real ``effectguard serve`` with a config file of short limits in
front of the real fake provider, and talks to it over raw sockets where the
client's own behaviour (slow, huge) is the point.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from edgekit import address, parse_answer, read_until_closed
from observing import wait_for
from stagedkit import serve_refusing
from toolkit import cli_json

from effectguard.config.settings import hash_key
from effectguard.ops.cli import main as cli_main
from effectguard.rules.budget import BudgetNode
from effectguard.telemetry import metrics
from effectguard.testing import FakeProvider, Proxy, fake_provider, free_port, running_proxy

OPENAI_CHAT = "/openai/v1/chat/completions"
CALL_ID = "effectguard-call-id"
HEADER_TIMEOUT_S = 1
BODY_TIMEOUT_S = 2
SEND_TIMEOUT_S = 1
MAX_HEADER_BYTES = 16 * 1024
#: How long a test waits for something the proxy must do within a second or two.
PATIENCE_S = 20.0


def chat(content: str = "hello") -> dict[str, Any]:
    """An OpenAI chat completion request body."""
    return {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": content}]}


@pytest.fixture(scope="module")
def provider(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeProvider]:
    """The fake provider for the module."""
    with fake_provider(tmp_path_factory.mktemp("door") / "receipts.jsonl") as fake:
        yield fake


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory, provider: FakeProvider) -> Iterator[Proxy]:
    """A proxy with short front-door limits."""
    tmp = tmp_path_factory.mktemp("door")
    config = tmp / "config.toml"
    config.write_text(
        "[server]\n"
        f"header_timeout_s = {HEADER_TIMEOUT_S}\n"
        f"body_timeout_s = {BODY_TIMEOUT_S}\n"
        f"send_timeout_s = {SEND_TIMEOUT_S}\n"
        f"max_header_bytes = {MAX_HEADER_BYTES}\n"
    )
    with running_proxy(
        tmp / "ledger.db", upstreams={"openai": provider.url}, args=["--config", str(config)]
    ) as running:
        yield running


def closed_or_answered(sock: socket.socket) -> bytes | None:
    """What the proxy sent before closing ``sock``; None if it still holds it open."""
    sock.setblocking(False)
    try:
        data = sock.recv(65536)
    except BlockingIOError:
        return None
    except ConnectionResetError:
        return b""
    if not data:
        return b""
    return data + read_until_closed(sock, PATIENCE_S)


def test_slowloris_connections_are_closed(proxy: Proxy, provider: FakeProvider) -> None:
    """Four connections trickling a request's headers are answered 408 and closed."""
    receipts = len(provider.receipts())
    socks = [socket.create_connection(address(proxy.url)) for _ in range(4)]
    outcome: dict[int, bytes] = {}
    try:
        deadline = time.monotonic() + PATIENCE_S
        lines = [b"POST " + OPENAI_CHAT.encode() + b" HTTP/1.1\r\n", b"Host: x\r\n"]
        lines += [b"X-Slow-%d: y\r\n" % i for i in range(100)]
        for line in lines:
            if len(outcome) == len(socks) or time.monotonic() > deadline:
                break
            for i, sock in enumerate(socks):
                if i in outcome:
                    continue
                try:
                    sock.sendall(line)
                except OSError:
                    outcome[i] = b""
                    continue
                answer = closed_or_answered(sock)
                if answer is not None:
                    outcome[i] = answer
            time.sleep(0.3)  # a slow client, well under the header deadline per line
    finally:
        for sock in socks:
            sock.close()
    assert len(outcome) == 4, f"{4 - len(outcome)} slow connections were still open"
    for answer in outcome.values():
        assert answer == b"" or parse_answer(answer).status == 408, answer
    assert len(provider.receipts()) == receipts


def test_a_30mb_header_is_refused(proxy: Proxy, provider: FakeProvider) -> None:
    """A huge header gets 431 once it passes the cap; the rest is never read."""
    receipts = len(provider.receipts())
    piece = b"a" * 65536
    sent = 0
    answer = b""
    with socket.create_connection(address(proxy.url), timeout=PATIENCE_S) as sock:
        sock.sendall(b"POST " + OPENAI_CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\nX-Huge: ")
        while sent < 30 * 1024 * 1024:
            try:
                sock.sendall(piece)
            except OSError:
                break
            sent += len(piece)
            answer = closed_or_answered(sock) or b""
            sock.setblocking(True)
            if answer:
                break
        answer = answer or read_until_closed(sock, PATIENCE_S)
    assert sent < 30 * 1024 * 1024, "the whole 30 MB header was read"
    assert parse_answer(answer).status == 431, answer[:200]
    assert len(provider.receipts()) == receipts


def _chat_request(extra_headers: bytes = b"") -> bytes:
    body = json.dumps(chat()).encode()
    return (
        b"POST " + OPENAI_CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n"
        % len(body)
        + extra_headers
        + b"\r\n"
        + body
    )


def _read_one_answer(sock: socket.socket) -> bytes:
    """One whole answer with a Content-Length, leaving the connection open."""
    data = b""
    while b"\r\n\r\n" not in data or len(data) < _answer_size(data):
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    return data


def _answer_size(data: bytes) -> int:
    head, _, _ = data.partition(b"\r\n\r\n")
    length = parse_answer(data).headers.get("content-length", "0")
    return len(head) + 4 + int(length)


@pytest.mark.parametrize("kept_alive", [False, True], ids=["first", "after-another"])
def test_headers_over_the_cap_in_one_read_are_refused_and_never_admitted(
    proxy: Proxy, provider: FakeProvider, kept_alive: bool
) -> None:
    """Headers a little over the cap, sent with their body in one write (so one read
    parses them whole), get 431 and reach neither the ledger nor the provider, as the
    first request of a connection or after another on it: they were once admitted and
    dispatched, because the cap was only checked while headers were still arriving."""
    receipts = len(provider.receipts())
    filler = b"".join(
        b"X-Fill-%d: %s\r\n" % (i, b"f" * 1000) for i in range(MAX_HEADER_BYTES // 1000 + 2)
    )
    with socket.create_connection(address(proxy.url), timeout=PATIENCE_S) as sock:
        if kept_alive:
            sock.sendall(_chat_request())
            assert parse_answer(_read_one_answer(sock)).status == 200
            receipts += 1
        sock.sendall(_chat_request(filler))
        answer = read_until_closed(sock, PATIENCE_S)
    assert parse_answer(answer).status == 431, answer[:200]
    assert answer.count(b"HTTP/1.1 ") == 1, answer[:400]
    assert len(provider.receipts()) == receipts
    served = httpx.post(proxy.url + OPENAI_CHAT, json=chat(), timeout=30)
    assert served.status_code == 200, served.text


@pytest.mark.parametrize("second", ["too-large", "too-slow", "body-too-slow"])
def test_a_pipelined_requests_refusal_never_takes_an_earlier_answers_place(
    proxy: Proxy, provider: FakeProvider, second: str
) -> None:
    """A paid request answered after 1.5 s (3 s), then on the same connection a second
    whose headers are over the cap, or never finish (whose body never finishes): the
    client reads the first request's 200,
    then the connection closes (answers go in request order, RFC 9112 §9.3.2). The 431 or
    408 for the second was once written at once, read by the client as the answer to its
    paid first request, whose answer was then lost."""
    receipts = len(provider.receipts())
    slow = b"X-Fake-Delay: 1.5\r\n"
    if second == "too-large":
        filler = b"X-Big: " + b"a" * (MAX_HEADER_BYTES + 1000) + b"\r\n"
        follower = _chat_request(filler)
    elif second == "too-slow":
        follower = b"POST " + OPENAI_CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\n"
    else:  # its body stops: its deadline passes while the first is still being answered
        slow = b"X-Fake-Delay: %d\r\n" % (BODY_TIMEOUT_S + 1)
        follower = _chat_request()[:-10]
    with socket.create_connection(address(proxy.url), timeout=PATIENCE_S) as sock:
        sock.sendall(_chat_request(slow) + follower)
        answer = read_until_closed(sock, PATIENCE_S)
    assert parse_answer(answer).status == 200, answer[:300]
    assert answer.count(b"HTTP/1.1 ") == 1, answer[:600]
    assert len(provider.receipts()) == receipts + 1


def test_a_client_that_stops_reading_its_stream_is_cut_off_and_the_call_settled(
    proxy: Proxy, provider: FakeProvider
) -> None:
    """A client reads a 30 MB stream's first bytes, then stops reading but keeps the
    connection open. After ``send_timeout_s`` the proxy cuts it off and reads the stream
    to its end itself: the call is completed while the client still holds its socket.
    It used to stay in flight for as long as the client held the connection, and an
    upstream giving up on the stalled read would have left it effect_unknown."""
    body = json.dumps({**chat(), "stream": True}).encode()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(PATIENCE_S)
        sock.connect(address(proxy.url))
        sock.sendall(
            b"POST " + OPENAI_CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nx-fake-behaviour: pad=30000000\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        head = sock.recv(4096)
        assert head.startswith(b"HTTP/1.1 200"), head[:200]
        call_id = parse_answer(head).headers[CALL_ID]

        def settled() -> str | None:
            stage = _stage(proxy, call_id)
            return stage if stage != "in_flight" else None

        assert wait_for(settled, PATIENCE_S, "the call settled") == "completed"


def _stage(proxy: Proxy, call_id: str) -> str:
    """The call's stage, as ``effectguard show --json`` prints it."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["show", call_id, "--ledger", proxy.ledger, "--json"]) == 0
    return str(json.loads(out.getvalue())["stage"])


def test_a_header_under_the_cap_is_served(proxy: Proxy) -> None:
    """The positive control: 12 KB of headers, under the cap, make an ordinary request."""
    headers = {f"x-big-{i}": "b" * 3000 for i in range(4)}  # aiohttp upstream: 8 KB a line
    response = httpx.post(proxy.url + OPENAI_CHAT, json=chat(), headers=headers, timeout=30)
    assert response.status_code == 200, response.text


def test_a_body_that_never_finishes_is_cut_off(proxy: Proxy, provider: FakeProvider) -> None:
    """A request whose body stops arriving is closed after the body deadline, not admitted."""
    receipts = len(provider.receipts())
    with socket.create_connection(address(proxy.url), timeout=PATIENCE_S) as sock:
        sock.sendall(
            b"POST " + OPENAI_CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\n"
            b'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"model"'
        )
        answer = read_until_closed(sock, PATIENCE_S)
        sock.setblocking(False)
        try:
            still_open = sock.recv(1) != b""
        except BlockingIOError:
            still_open = True
        except OSError:
            still_open = False
    assert not still_open
    assert answer == b"" or parse_answer(answer).status in (400, 408), answer
    assert len(provider.receipts()) == receipts


# -- /metrics -------------------------------------------------------------------------------
def test_metrics_needs_a_metrics_key_once_proxy_keys_exist(
    tmp_path: Path, provider: FakeProvider
) -> None:
    """With proxy keys, /metrics is 401 without a key, 403 for a tenant key, 200 for a key
    marked ``metrics = true``."""
    config = tmp_path / "keys.toml"
    config.write_text(
        f'[[keys]]\nsha256 = "{hash_key("tenant-key")}"\nbudget_root = "team-a"\n\n'
        f'[[keys]]\nsha256 = "{hash_key("ops-key")}"\nbudget_root = "ops"\nmetrics = true\n'
    )
    with running_proxy(
        tmp_path / "l.db", upstreams={"openai": provider.url}, args=["--config", str(config)]
    ) as proxy:
        anonymous = httpx.get(proxy.url + "/metrics")
        tenant = httpx.get(proxy.url + "/metrics", headers={"effectguard-key": "tenant-key"})
        ops = httpx.get(proxy.url + "/metrics", headers={"authorization": "Bearer ops-key"})
    assert anonymous.status_code == 401, anonymous.text
    assert anonymous.json()["error"]["type"] == "unknown_key"
    assert tenant.status_code == 403, tenant.text
    assert "effectguard_budget" not in tenant.text
    assert ops.status_code == 200, ops.text
    assert "effectguard_requests_total" in ops.text


def test_the_start_line_names_the_metrics_port_it_picked(
    tmp_path: Path, provider: FakeProvider
) -> None:
    """``--metrics-port 0`` binds a free port, and the start line names it after the
    proxy's own URL (which stays the line's first), so a scraper can be pointed there."""
    with running_proxy(
        tmp_path / "l.db", upstreams={"openai": provider.url}, args=["--metrics-port", "0"]
    ) as proxy:
        (line,) = [x for x in proxy.log().splitlines() if "effectguard listening on" in x]
        assert line.split("listening on ", 1)[1].startswith(proxy.url + " "), line
        found = re.search(r"; metrics at (http://127\.0\.0\.1:(\d+)/metrics)$", line)
        assert found is not None and found.group(2) != "0", line
        scraped = httpx.get(found.group(1))
    assert scraped.status_code == 200
    assert "effectguard_requests_total" in scraped.text


def test_metrics_on_their_own_port_only(tmp_path: Path, provider: FakeProvider) -> None:
    """``--metrics-port`` serves /metrics there, and the proxy's port no longer does."""
    port = free_port()
    with running_proxy(
        tmp_path / "l.db",
        upstreams={"openai": provider.url},
        args=["--metrics-port", str(port), "--metrics-host", "127.0.0.1"],
    ) as proxy:
        assert httpx.post(proxy.url + OPENAI_CHAT, json=chat(), timeout=PATIENCE_S).is_success
        apart = httpx.get(f"http://127.0.0.1:{port}/metrics")
        main = httpx.get(proxy.url + "/metrics")
    assert apart.status_code == 200
    assert "effectguard_spent_usd" in apart.text or "effectguard_budget_spent_usd" in apart.text
    assert main.status_code == 404


def test_a_metrics_port_that_is_taken_is_refused_before_the_ledger(tmp_path: Path) -> None:
    """A metrics listener that cannot bind is exit 2 in one line, as for the proxy's port,
    and no ledger (nor its .workers directory) is left behind."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = serve_refusing(
            "--ledger", "l.db", "--port", "0", "--metrics-port", str(port), cwd=tmp_path
        )
    assert done.code == 2, done
    assert done.err == f"effectguard: port {port} on 127.0.0.1 is already in use\n", done.err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "hosts",
    [[], ["--host", "0.0.0.0"], ["--host", "localhost", "--metrics-host", "127.0.0.1"]],
    ids=["same", "wildcard", "same-address"],
)
def test_a_metrics_port_that_is_the_proxys_own_is_refused(tmp_path: Path, hosts: list[str]) -> None:
    """--metrics-port equal to --port on the same address (or overlapping a wildcard) is
    exit 2 before the ledger: the metrics server would take the proxy's connections."""
    port = str(free_port())
    args = ["--ledger", "l.db", "--port", port, "--metrics-port", port, *hosts]
    done = serve_refusing(*args, cwd=tmp_path)
    assert done.code == 2, done
    assert f"metrics_port {port} is the proxy's own port" in done.err, done.err
    assert done.err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_budget_series_are_capped_with_the_rest_as_other() -> None:
    """Beyond the cap, the budgets with the least money are summed into ``_other``."""
    nodes = [BudgetNode(f"root-{i:04d}", spent=i) for i in range(2000)]
    nodes.append(BudgetNode("limited", limit=10))
    kept = metrics.top_budgets(nodes, 50)
    assert len(kept) == 51
    assert kept[0].path == "limited"  # an operator's limit is always watched
    assert [n.path for n in kept[1:4]] == ["root-1999", "root-1998", "root-1997"]
    other = kept[-1]
    assert other.path == metrics.OTHER_BUDGETS
    assert sum(n.spent for n in kept) == sum(n.spent for n in nodes)


def test_budget_roots_made_by_clients_do_not_grow_the_series(
    tmp_path: Path, provider: FakeProvider
) -> None:
    """60 client-made budget roots export at most 50 budget series plus ``_other``."""
    with (
        running_proxy(tmp_path / "l.db", upstreams={"openai": provider.url}) as proxy,
        httpx.Client(base_url=proxy.url, timeout=PATIENCE_S) as client,
    ):
        for i in range(60):
            budget = {"effectguard-budget": f"r{i}"}
            response = client.post(OPENAI_CHAT, json=chat(), headers=budget)
            assert response.status_code == 200, response.text
        text = client.get("/metrics").text
    series = [
        line for line in text.splitlines() if line.startswith("effectguard_budget_spent_usd{")
    ]
    assert len(series) == 51, series
    assert any(f'budget="{metrics.OTHER_BUDGETS}"' in line for line in series)


# -- the end of a SIGTERM drain ------------------------------------------------------------------
def test_drain_timeout_answers_504_effect_unknown_and_marks_the_call(
    tmp_path: Path, provider: FakeProvider, capsys: pytest.CaptureFixture[str]
) -> None:
    """A call still waiting when the drain timeout ends gets a provider-shaped 504
    ``effect_unknown`` with its call id and ``x-should-retry: false``, and the ledger
    holds it ``effect_unknown`` before the process exits, for the reason its 504 names
    (it could hold ``cancelled during dispatch``, as if its client had cancelled it). Its
    access line says 504, as the client got (it used to say 499, as if the client had
    left)."""
    config = tmp_path / "drain.toml"
    config.write_text("[server]\ndrain_timeout_s = 1\n")
    ledger = tmp_path / "l.db"
    result: dict[str, Any] = {}
    args = ["--config", str(config), "--log-format", "json"]
    with running_proxy(ledger, upstreams={"openai": provider.url}, args=args) as proxy:

        def call() -> None:
            try:
                result["response"] = httpx.post(
                    proxy.url + OPENAI_CHAT,
                    json=chat("slow"),
                    headers={"x-fake-delay": "30"},
                    timeout=PATIENCE_S * 2,
                )
            except Exception as exc:  # reported by the assertion below
                result["response"] = exc

        worker = _started_at_the_provider(provider, call)
        proxy.kill(signal.SIGTERM)
        worker.join(PATIENCE_S * 2)
        proxy.process.wait(PATIENCE_S)
    response = result["response"]
    assert isinstance(response, httpx.Response), response
    assert response.status_code == 504, response.text
    error = response.json()["error"]
    assert error["type"] == "effect_unknown"
    call_id = response.headers[CALL_ID]
    assert error["call_id"] == call_id
    assert response.headers["x-should-retry"] == "false"
    capsys.readouterr()
    assert cli_main(["calls", "--json", "--ledger", str(ledger)]) == 0
    stages = {c["call_id"]: c["stage"] for c in json.loads(capsys.readouterr().out)}
    assert stages == {call_id: "effect_unknown"}
    lines = [json.loads(x) for x in proxy.log().splitlines() if x.startswith("{")]
    access = [x for x in lines if x.get("event") == "access"]
    assert [(x["call_id"], x["status"], x["stage"]) for x in access] == [
        (call_id, 504, "effect_unknown")
    ]
    # One incident line, with the reason the ledger holds (logs-and-traces.md: each is
    # written once); the cut-off and the dispatch it cancels both try to mark the call.
    interrupted = [x for x in lines if x.get("event") == "interrupted"]
    assert len(interrupted) == 1, interrupted
    assert cli_main(["show", call_id, "--json", "--ledger", str(ledger)]) == 0
    events = json.loads(capsys.readouterr().out)["events"]
    reasons = [e["data"]["reason"] for e in events if e["kind"] == "attempt.interrupted"]
    assert len(reasons) == 1 and reasons[0] in interrupted[0]["message"], (reasons, interrupted)
    assert reasons == ["the proxy's drain timeout ended"] and reasons[0] in error["message"]


def test_a_stream_under_way_at_the_end_of_the_drain_is_cut_off_without_an_error_log(
    tmp_path: Path, provider: FakeProvider, capsys: pytest.CaptureFixture[str]
) -> None:
    """A stream that never ends is still being read when the drain timeout ends: its
    client's connection is cut (an error, never a clean end), the call is settled as the
    stream's end allows, and the log holds no "Exception in ASGI application" traceback,
    which every deploy used to print at ERROR for each stream under way (nor uvicorn's
    "returned without completing response", once printed for every stream the guard
    broke off on purpose)."""
    config = tmp_path / "drain.toml"
    config.write_text("[server]\ndrain_timeout_s = 1\n[guard]\nmax_answer_bytes = 8000000\n")
    ledger = tmp_path / "l.db"
    result: dict[str, Any] = {}
    with running_proxy(
        ledger, upstreams={"openai": provider.url}, args=["--config", str(config)]
    ) as proxy:

        def call() -> None:
            body = {**chat("endless"), "stream": True}
            headers = {"x-fake-behaviour": "endless"}
            try:
                with httpx.stream(
                    "POST", proxy.url + OPENAI_CHAT, json=body, headers=headers, timeout=PATIENCE_S
                ) as streamed:
                    result["call_id"] = streamed.headers[CALL_ID]
                    for n, _ in enumerate(streamed.iter_raw()):
                        if n == 0:
                            time.sleep(3)  # past the drain's end: the stream is under way
                result["ended"] = "cleanly"
            except httpx.HTTPError as exc:
                result["ended"] = type(exc).__name__

        worker = _started_at_the_provider(provider, call)
        proxy.kill(signal.SIGTERM)
        worker.join(PATIENCE_S * 2)
        proxy.process.wait(PATIENCE_S)
        log = proxy.log()
    assert result["ended"] != "cleanly", result
    assert "Exception in ASGI application" not in log, log
    assert "without completing response" not in log and "Traceback" not in log, log
    capsys.readouterr()
    assert cli_main(["calls", "--json", "--ledger", str(ledger)]) == 0
    stages = {c["call_id"]: c["stage"] for c in json.loads(capsys.readouterr().out)}
    assert stages == {result["call_id"]: "effect_unknown"}


def test_a_second_sigterm_stops_at_once_and_the_call_is_left_as_a_crash_leaves_it(
    tmp_path: Path, provider: FakeProvider, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second SIGTERM during the drain (``timeout`` and some supervisors signal twice)
    exits 0 at once, without a traceback; the call still waiting stays in flight in the
    ledger and the next start marks it ``effect_unknown``, as after a crash."""
    ledger = tmp_path / "l.db"
    upstreams = {"openai": provider.url}
    with running_proxy(ledger, upstreams=upstreams) as proxy:
        slow = {"x-fake-delay": "30"}
        worker = _started_at_the_provider(provider, lambda: _post_ignoring_errors(proxy.url, slow))
        proxy.kill(signal.SIGTERM)
        time.sleep(0.2)  # the first signal is being handled: the drain has begun
        proxy.kill(signal.SIGTERM)
        # The drain alone would wait up to its 30 s for the 30 s call.
        assert proxy.process.wait(PATIENCE_S / 2) == 0
        log = proxy.log()
    worker.join(PATIENCE_S)
    assert "Traceback" not in log, log
    assert "stopped without draining" in log, log
    with running_proxy(ledger, upstreams=upstreams):
        deadline = time.monotonic() + PATIENCE_S
        while time.monotonic() < deadline:
            capsys.readouterr()
            assert cli_main(["calls", "--json", "--ledger", str(ledger)]) == 0
            stages = [c["stage"] for c in json.loads(capsys.readouterr().out)]
            if stages == ["effect_unknown"]:
                break
            time.sleep(0.1)
    assert stages == ["effect_unknown"]


def test_a_call_cut_off_by_a_second_signal_does_not_blame_the_drain_timeout(
    tmp_path: Path, provider: FakeProvider
) -> None:
    """A second SIGTERM cuts the call still waiting off at once: its client gets 504
    ``effect_unknown`` naming the call. The answer (and the ledger's interrupt reason)
    said "the proxy's drain timeout ended", which never happened (the drain had 30 s
    left); it says a second signal stopped the proxy."""
    ledger = tmp_path / "l.db"
    answers: list[httpx.Response] = []
    with running_proxy(ledger, upstreams={"openai": provider.url}) as proxy:
        slow = {"x-fake-delay": "30"}

        def post() -> None:
            url = proxy.url + OPENAI_CHAT
            answers.append(httpx.post(url, json=chat("cut"), headers=slow, timeout=PATIENCE_S))

        worker = _started_at_the_provider(provider, post)
        proxy.kill(signal.SIGTERM)
        time.sleep(0.2)  # the first signal is being handled: the drain has begun
        proxy.kill(signal.SIGTERM)
        assert proxy.process.wait(PATIENCE_S / 2) == 0
        worker.join(PATIENCE_S)
    (answer,) = answers
    assert answer.status_code == 504, answer.text
    message = answer.json()["error"]["message"]
    assert "drain timeout" not in message and "a second signal" in message, message
    call_id = answer.json()["error"]["call_id"]
    shown = cli_json("show", call_id, "--ledger", str(ledger))
    reasons = [e["data"]["reason"] for e in shown["events"] if e["kind"] == "attempt.interrupted"]
    assert reasons == ["a second signal stopped the proxy without draining"], reasons


def _started_at_the_provider(provider: FakeProvider, call: Callable[[], None]) -> threading.Thread:
    """``call`` on a thread of its own, once its request has reached the provider."""
    receipts = len(provider.receipts())
    worker = threading.Thread(target=call)
    worker.start()
    deadline = time.monotonic() + PATIENCE_S
    while len(provider.receipts()) == receipts and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(provider.receipts()) > receipts, "the call never reached the provider"
    return worker


def _post_ignoring_errors(url: str, headers: dict[str, str]) -> None:
    # The proxy goes away under this request: whatever the client sees is not the point.
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(url + OPENAI_CHAT, json=chat("slow"), headers=headers, timeout=PATIENCE_S)
