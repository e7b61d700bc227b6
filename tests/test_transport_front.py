"""The in-process transport as a newcomer meets it: exits cleanly, routes by endpoint,
and names its own arguments in errors.

The upstream is the real fake provider process; the program that must exit on
its own runs as a subprocess.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import anthropic
import httpx
import httpx2
import openai
import pytest

from effectguard import AsyncGuardTransport, ConfigError, GuardTransport
from effectguard.ingress.httpx2 import AsyncHttpx2Transport
from effectguard.providers import load_providers
from effectguard.testing import FakeProvider, fake_provider

MESSAGES = [{"role": "user", "content": "Say hello"}]

EXIT_WITHOUT_ACLOSE = """
import asyncio, sys
import httpx, openai
import effectguard

async def main(url: str, ledger: str) -> None:
    transport = effectguard.AsyncGuardTransport(ledger=ledger, upstreams={"openai": url})
    client = openai.AsyncOpenAI(
        base_url=url + "/v1", api_key="x", http_client=httpx.AsyncClient(transport=transport)
    )
    await client.chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}]
    )
    print("called", flush=True)  # and never aclose()

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


@pytest.fixture
def provider(tmp_path: Path) -> FakeProvider:
    """A fake provider process for one test."""
    with fake_provider(tmp_path / "receipts.jsonl") as running:
        yield running  # type: ignore[misc]


def test_a_program_that_never_closes_the_transport_still_exits(
    provider: FakeProvider, tmp_path: Path
) -> None:
    """One call through AsyncGuardTransport and no aclose(): the interpreter exits by itself."""
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(EXIT_WITHOUT_ACLOSE))
    ledger = tmp_path / "ledger.db"
    try:
        done = subprocess.run(
            [sys.executable, str(script), provider.url, str(ledger)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the program did not exit: {exc.stdout!r} {exc.stderr!r}") from exc
    assert done.returncode == 0, done.stderr
    assert done.stdout == "called\n"
    assert len(provider.effects()) == 1


async def test_two_providers_on_one_url_are_told_apart_by_endpoint(
    provider: FakeProvider, tmp_path: Path
) -> None:
    """openai and anthropic on one base URL: /v1/chat/completions is openai's, /v1/messages
    anthropic's."""
    transport = AsyncGuardTransport(
        ledger=str(tmp_path / "ledger.db"),
        upstreams={"openai": provider.url, "anthropic": provider.url},
    )
    # Closing either client closes the shared transport: read the ledger before that.
    http = httpx.AsyncClient(transport=transport)
    chat = openai.AsyncOpenAI(base_url=provider.url + "/v1", api_key="x", http_client=http)
    await chat.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)  # type: ignore[arg-type]
    # The anthropic SDK is built on httpx2: the adapter wraps the same transport.
    http2 = httpx2.AsyncClient(transport=AsyncHttpx2Transport(transport))
    claude = anthropic.AsyncAnthropic(base_url=provider.url, api_key="x", http_client=http2)
    await claude.messages.create(
        model="claude-haiku-4-5",
        max_tokens=64,
        messages=MESSAGES,  # type: ignore[arg-type]
    )
    calls = await transport.ledger.calls()
    await http.aclose()
    assert sorted((c.provider, c.model, c.stage) for c in calls) == [
        ("anthropic", "claude-haiku-4-5", "completed"),
        ("openai", "gpt-4o-mini", "completed"),
    ]


def test_two_clients_sharing_the_sync_transport_both_close(
    provider: FakeProvider, tmp_path: Path
) -> None:
    """Each client closes the GuardTransport it shares: the second close returns at once
    (it used to wait forever for the portal loop the first close had stopped)."""
    transport = GuardTransport(
        ledger=str(tmp_path / "ledger.db"), upstreams={"openai": provider.url}
    )
    clients = [httpx.Client(transport=transport) for _ in range(2)]
    body = {"model": "gpt-4o-mini", "messages": MESSAGES}
    assert clients[0].post(provider.url + "/v1/chat/completions", json=body).status_code == 200

    def close_both() -> None:
        for client in clients:
            client.close()

    closer = threading.Thread(target=close_both, daemon=True)
    closer.start()
    closer.join(timeout=30)
    assert not closer.is_alive(), "closing the shared transport a second time hung"
    assert len(provider.effects()) == 1


@pytest.mark.parametrize(
    ("upstreams", "message"),
    [
        ({"nope": "http://x"}, "upstreams={'nope': ...}: unknown provider"),
        ({"openai": "ftp://x"}, "upstreams={'openai': ...}: must be an http(s) URL"),
    ],
)
def test_transport_errors_name_the_transport_argument(
    upstreams: dict[str, str], message: str, tmp_path: Path
) -> None:
    """A bad ``upstreams`` entry is reported as the library argument, never as a CLI flag."""
    with pytest.raises(ConfigError, match=re.escape(message)) as caught:
        AsyncGuardTransport(ledger=str(tmp_path / "l.db"), upstreams=upstreams)
    assert "--upstream" not in str(caught.value)


@pytest.mark.parametrize("declared", [False, True], ids=["loaded", "given"])
def test_an_upstream_with_a_credential_is_refused_without_it(
    declared: bool, tmp_path: Path
) -> None:
    """A user and password in an ``upstreams`` URL is refused, whether the transport loads
    the declarations or is given them, and the message never quotes it: the ledger would
    record the URL as where an attempt went."""
    upstreams = {"openai": "http://gw:canary-pw@127.0.0.1:9"}
    providers = load_providers() if declared else None
    with pytest.raises(ConfigError, match="must not hold a user name or password") as caught:
        AsyncGuardTransport(ledger=str(tmp_path / "l.db"), providers=providers, upstreams=upstreams)
    assert "upstreams={'openai': ...}" in str(caught.value)
    assert "canary" not in str(caught.value)


def test_transport_with_declared_providers_names_the_argument(tmp_path: Path) -> None:
    """With ``providers=`` given as declarations, an unknown ``upstreams`` name is a
    ConfigError naming the argument (not a bare KeyError)."""
    with pytest.raises(ConfigError, match=re.escape("upstreams={'nope': ...}: unknown provider")):
        AsyncGuardTransport(
            ledger=str(tmp_path / "l.db"),
            providers=load_providers(),
            upstreams={"nope": "http://x"},
        )


def test_the_cli_still_names_its_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The same mistake on the command line is reported as ``--upstream NAME`` (exit 2)."""
    from effectguard.ops.cli import main

    argv = ["serve", "--ledger", str(tmp_path / "l.db"), "--upstream", "nope=http://x"]
    assert main(argv) == 2
    assert "effectguard: --upstream nope: unknown provider" in capsys.readouterr().err


def test_an_async_transport_under_trio_says_it_needs_asyncio(
    provider: FakeProvider, tmp_path: Path
) -> None:
    """AsyncGuardTransport runs on asyncio only: called from a trio program it refuses with
    a message naming asyncio and the way out (GuardTransport from a worker thread), before
    anything is recorded or sent. It used to fail with asyncio's bare "no running event
    loop", which names neither."""
    trio = pytest.importorskip("trio")
    transport = AsyncGuardTransport(
        ledger=str(tmp_path / "ledger.db"), upstreams={"openai": provider.url}
    )
    client = openai.AsyncOpenAI(
        base_url=provider.url + "/v1",
        api_key="x",
        max_retries=0,
        http_client=httpx.AsyncClient(transport=transport),
    )

    async def call() -> None:
        await client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)  # type: ignore[arg-type]

    with pytest.raises(RuntimeError, match=r"needs a running asyncio event loop.*GuardTransport"):
        trio.run(call)
    assert provider.effects() == []
    assert not (tmp_path / "ledger.db").exists()
