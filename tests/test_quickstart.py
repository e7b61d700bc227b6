"""The quick start's first command, ``effectguard serve --demo``, as real processes.

One foreground process runs the proxy and its offline upstream (the fake
provider, in the same event loop): it prints where the ledger is and where it
listens, serves priced calls, stops on Ctrl-C or SIGTERM leaving nothing behind,
starts again on the same ledger and port, and says plainly when the port is taken.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import effectguard.testing
from effectguard.testing import Proxy, free_port, running_proxy, start_proxy

pytestmark = pytest.mark.slow

CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {
    "model": "claude-haiku-4-5",
    "max_tokens": 64,
    "messages": [{"role": "user", "content": "hi"}],
}
DEMO_LINE = re.compile(r"fake provider answers for openai, anthropic at (http://127\.0\.0\.1:\d+)")
EXIT_WAIT_S = 30  # a bound on a hang, not a timing assertion


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST ``body`` as JSON and return the decoded answer."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        answer: dict[str, Any] = json.loads(response.read())
        return answer


def calls(ledger: Path) -> list[dict[str, Any]]:
    """``effectguard calls --json`` on ``ledger``, run as a process."""
    done = subprocess.run(
        [sys.executable, "-m", "effectguard", "calls", "--ledger", str(ledger), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    rows: list[dict[str, Any]] = json.loads(done.stdout)
    return rows


def demo_url(proxy: Proxy) -> str:
    """The demo upstream's URL, from the start lines."""
    found = DEMO_LINE.search(proxy.log())
    assert found, proxy.log()
    return found.group(1)


def refuses_connections(url: str) -> bool:
    """Whether nothing listens at ``url`` any more."""
    host, port = url.removeprefix("http://").split(":")
    with socket.socket() as sock:
        return sock.connect_ex((host, int(port))) != 0


def children_of(pid: int) -> list[int]:
    """Live processes whose parent is ``pid`` (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[Proxy]:
    """``effectguard serve --demo`` on a free port and a fresh ledger, healthy."""
    proxy = start_proxy(tmp_path / "ledger.db", args=["--demo"])
    try:
        yield proxy
    finally:
        proxy.stop()


def test_demo_serves_priced_calls_for_both_providers(demo: Proxy, tmp_path: Path) -> None:
    """A chat completion and a message through the demo complete with a cost, offline."""
    post(demo.url + "/openai/v1/chat/completions", CHAT)
    post(demo.url + "/anthropic/v1/messages", MESSAGES)
    rows = calls(tmp_path / "ledger.db")
    assert sorted((r["provider"], r["stage"]) for r in rows) == [
        ("anthropic", "completed"),
        ("openai", "completed"),
    ]
    assert all(r["cost_usd"] not in (None, "0.000000000") for r in rows)
    receipts = (tmp_path / "effectguard-demo-receipts.jsonl").read_text().splitlines()
    assert len(receipts) == 2


def test_demo_prints_the_ledger_path_and_the_url(demo: Proxy, tmp_path: Path) -> None:
    """The start lines name the absolute ledger path, the URL and the receipt log."""
    log = demo.log()
    ledger = (tmp_path / "ledger.db").resolve()
    assert f"effectguard listening on {demo.url} (ledger {ledger})" in log
    assert f"receipts in {tmp_path.resolve() / 'effectguard-demo-receipts.jsonl'}" in log


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_everything_and_a_second_run_works(tmp_path: Path, sig: int) -> None:
    """Ctrl-C or SIGTERM ends the one process cleanly, the demo upstream with it; the same
    ledger and port serve again."""
    ledger, port = tmp_path / "ledger.db", free_port()
    first = start_proxy(ledger, args=["--demo"], port=port)
    try:
        upstream = demo_url(first)
        post(first.url + "/openai/v1/chat/completions", CHAT)
        assert children_of(first.process.pid) == []
        first.kill(sig)
        code = first.process.wait(EXIT_WAIT_S)
    finally:
        first.stop()
    assert code in (0, 130), first.log()
    assert refuses_connections(upstream)
    with running_proxy(ledger, args=["--demo"], port=port) as second:
        post(second.url + "/openai/v1/chat/completions", CHAT)
    assert [r["stage"] for r in calls(ledger)] == ["completed", "completed"]


# Loaded at start-up by the serve process below (as ``sitecustomize``): the demo's first
# port-0 bind gets the proxy's own port, as the kernel may hand it out once a test's
# free_port() has let it go.
_KERNEL_PICKS_THE_PROXYS_PORT = """
import os
import effectguard.ops.demo as demo

_real, _picks = demo.listen_socket, [int(os.environ["DEMO_FIRST_PORT"])]


def listen_socket(host, port):
    return _real(host, _picks.pop() if port == 0 and _picks else port)


demo.listen_socket = listen_socket
"""


def test_the_demo_never_shares_the_proxys_port(tmp_path: Path) -> None:
    """The demo's upstream bound first, on the port the proxy was then told to use: both
    binds succeeded (neither listened yet), and the proxy never became healthy (a CI
    failure). The demo now moves to another port."""
    (tmp_path / "sitecustomize.py").write_text(_KERNEL_PICKS_THE_PROXYS_PORT)
    port = free_port()
    env = {"PYTHONPATH": str(tmp_path), "DEMO_FIRST_PORT": str(port)}
    with running_proxy(tmp_path / "ledger.db", args=["--demo"], port=port, env=env) as proxy:
        upstream = demo_url(proxy)
        answer = post(proxy.url + "/openai/v1/chat/completions", CHAT)
    assert upstream != proxy.url, proxy.log()
    assert answer["object"] == "chat.completion"
    receipts = (tmp_path / "effectguard-demo-receipts.jsonl").read_text().splitlines()
    assert len(receipts) == 1


def test_the_harness_picks_another_port_when_one_is_taken_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """start_proxy's port is free only a moment ago: another process may listen on it
    before serve binds it (serve then exits 2). The harness picks another, so the
    suite does not fail on that race; a port the caller names is never changed."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1], free_port()])
        monkeypatch.setattr(effectguard.testing, "free_port", lambda: next(ports))
        with running_proxy(tmp_path / "ledger.db", args=["--demo"]) as proxy:
            post(proxy.url + "/openai/v1/chat/completions", CHAT)
        assert proxy.url != f"http://127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(RuntimeError, match="already in use"):
            start_proxy(tmp_path / "ledger.db", port=taken.getsockname()[1])


@pytest.mark.parametrize("demo_flag", [["--demo"], []])
def test_a_taken_port_is_a_plain_usage_error(tmp_path: Path, demo_flag: list[str]) -> None:
    """A port in use: exit 2 with "port N on 127.0.0.1 is already in use", nothing claims to
    listen, and the ledger is never created."""
    ledger = tmp_path / "ledger.db"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        serve = ["serve", *demo_flag, "--ledger", str(ledger), "--port", str(port)]
        done = subprocess.run(
            [sys.executable, "-m", "effectguard", *serve],
            capture_output=True,
            text=True,
            timeout=EXIT_WAIT_S,
        )
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"port {port} on 127.0.0.1 is already in use" in done.stderr
    assert "listening" not in done.stdout
    assert not ledger.exists()


def test_demo_names_only_the_providers_it_answers_for(tmp_path: Path) -> None:
    """An explicit ``--upstream`` wins over the demo's: the start line used to say the
    fake provider answers for openai all the same, while openai calls went elsewhere.
    It names only the providers the demo really answers for."""
    elsewhere = f"http://127.0.0.1:{free_port()}"
    args = ["--demo", "--upstream", f"openai={elsewhere}"]
    with running_proxy(tmp_path / "ledger.db", args=args) as proxy:
        log = proxy.log()
        post(proxy.url + "/anthropic/v1/messages", MESSAGES)
    assert "the fake provider answers for anthropic at http://127.0.0.1:" in log, log
    assert "answers for openai" not in log, log
