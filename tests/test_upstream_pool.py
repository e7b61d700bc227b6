"""One provider that never answers cannot take the connections the other providers need.

Through real processes: ``effectguard serve`` with a small upstream pool, openai routed
to a fake provider that takes every request and answers after a minute (as a provider
that hangs does), anthropic to a well one. The upstream leg used to have one pool for
every provider and no bound per provider: the hung provider's calls held every
connection until ``read_timeout_s``, and a call to the well provider waited for one,
then failed unsent (502). Effects are counted from each fake provider's receipt log.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from observing import cli_json, wait_for

from effectguard.testing import FakeProvider, Proxy, fake_provider, running_proxy

pytestmark = pytest.mark.slow

CHAT = "/openai/v1/chat/completions"
MESSAGES = "/anthropic/v1/messages"
#: The hung provider answers after this long: past every wait in the test, which ends
#: before it (the proxy's drain is 1 s), so nothing here waits for it.
HANG_S = 120
#: How long a request may wait for a pooled connection before it fails unsent.
CONNECT_S = 3
#: Bounds each wait in the test (a loaded machine), never a measured duration.
WITHIN_S = 60


def chat(content: str) -> dict[str, Any]:
    """A small OpenAI chat completion request."""
    return {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": content}]}


def message(content: str) -> dict[str, Any]:
    """A small Anthropic messages request."""
    return {
        "model": "claude-3-5-haiku-20241022",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": content}],
    }


@pytest.fixture
def hung(tmp_path: Path) -> Iterator[FakeProvider]:
    """A provider that takes every request, makes its receipt durable, and says nothing."""
    with fake_provider(tmp_path / "hung.jsonl", delay=HANG_S) as provider:
        yield provider


@pytest.fixture
def well(tmp_path: Path) -> Iterator[FakeProvider]:
    """A provider that answers at once."""
    with fake_provider(tmp_path / "well.jsonl") as provider:
        yield provider


def proxy_with_pool(tmp_path: Path, hung: FakeProvider, well: FakeProvider, pool: str) -> Any:
    """``serve`` with the ``[upstream]`` lines ``pool``, openai hung and anthropic well."""
    config = tmp_path / "effectguard.toml"
    config.write_text(
        f"[server]\ndrain_timeout_s = 1\n[guard]\nmax_retries = 0\n"
        f"[upstream]\nconnect_timeout_s = {CONNECT_S}\nread_timeout_s = {HANG_S}\n{pool}"
    )
    (tmp_path / "db").mkdir()
    return running_proxy(
        tmp_path / "db" / "ledger.db",
        upstreams={"openai": hung.url, "anthropic": well.url},
        args=["--config", str(config)],
    )


def post(proxy: Proxy, path: str, body: dict[str, Any]) -> httpx.Response:
    """POST through the proxy, waiting as long as the hung provider might."""
    return httpx.post(proxy.url + path, json=body, timeout=HANG_S + WITHIN_S)


@pytest.mark.parametrize(
    ("pool", "share"),
    [
        ("max_connections = 2\n", 1),  # half of them per upstream, by default
        ("max_connections = 3\nmax_connections_per_upstream = 2\n", 2),
    ],
)
def test_a_hung_provider_leaves_connections_for_the_others(
    tmp_path: Path, hung: FakeProvider, well: FakeProvider, pool: str, share: int
) -> None:
    """The hung provider's calls hold its share of the connections; its next call waits
    for one and fails unsent (502, stage not_sent, no receipt), and a call to the well
    provider completes meanwhile, on a connection the hung one could not take."""
    # The threads outlive the proxy: stopping it (a 1 s drain) ends the hung calls.
    with (
        ThreadPoolExecutor(share + 1) as threads,
        proxy_with_pool(tmp_path, hung, well, pool) as proxy,
    ):
        held = []
        for n in range(share):
            held.append(threads.submit(post, proxy, CHAT, chat(f"hang {n}")))
            wait_for(lambda n=n: len(hung.receipts()) == n + 1, WITHIN_S, f"hung call {n} sent")
        extra = threads.submit(post, proxy, CHAT, chat("one too many"))
        # Sent (the old shared pool: the hung provider then held every connection) or
        # refused unsent (its share is taken): either way it has a connection or never will.
        wait_for(lambda: len(hung.receipts()) > share or extra.done(), WITHIN_S, "the extra")

        answer = post(proxy, MESSAGES, message("well"))

        assert answer.status_code == 200, answer.text
        assert len(well.effects()) == 1
        _assert_unsent(extra)
        assert len(hung.receipts()) == share
        calls = cli_json("calls", "--ledger", proxy.ledger)
        stages = sorted((c["provider"], c["stage"]) for c in calls)
        openai = [("openai", "in_flight")] * share + [("openai", "not_sent")]
        assert stages == [("anthropic", "completed"), *openai]
        assert not any(call.done() for call in held)  # each still holds its connection


def _assert_unsent(call: Future[httpx.Response]) -> None:
    """The call waited for a connection its provider had none of, and was sent nowhere."""
    answer = call.result(WITHIN_S)
    assert answer.status_code == 502, answer.text
    error = answer.json()["error"]
    assert error["type"] == "upstream_unreachable"
    assert error["stage"] == "not_sent"
