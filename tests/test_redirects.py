"""A provider's redirect through the proxy: the SDK that follows it stays behind the guard.

effectguard never follows a redirect itself (contract §1.4); a billable call answered
``3xx`` is booked ``failed`` and its answer passed on. The OpenAI and Anthropic SDKs
follow redirects on their own, so a ``Location`` on the provider's origin, passed on as
written, sent the SDK's repeat of the request straight to the provider: an effect no
budget admitted and no ledger recorded. The proxy now writes such a ``Location`` as its
own path for that provider; one pointing anywhere else is passed on as it came and
logged. Effects are counted on the fake provider's receipt log.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest

from effectguard.ledger import Ledger
from effectguard.rules.workstate import WorkState
from effectguard.testing import fake_provider, free_port, running_proxy

pytestmark = pytest.mark.slow

CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def calls_of(ledger: str) -> list[WorkState]:
    """Every call the ledger holds, oldest first."""

    async def read() -> list[WorkState]:
        async with Ledger.open(ledger) as opened:
            return sorted(await opened.calls(), key=lambda c: c.created_at)

    return asyncio.run(read())


def post_chat(tmp_path: Path, headers: dict[str, str]) -> tuple[httpx.Response, str]:
    """One chat call with ``headers`` through a proxy before the fake provider; its
    answer and the proxy's log."""
    with (
        fake_provider(tmp_path / "receipts.jsonl") as provider,
        running_proxy(tmp_path / "ledger.db", upstreams={"openai": provider.url}) as proxy,
    ):
        answer = httpx.post(proxy.url + "/openai/v1/chat/completions", json=CHAT, headers=headers)
        return answer, proxy.log()


def test_an_sdk_following_a_307_to_the_provider_comes_back_through_the_guard(
    tmp_path: Path,
) -> None:
    """The openai SDK follows a 307 whose Location is on the provider's origin: the repeat
    reaches the provider through the proxy, as a call of its own that the ledger records
    and the budget admits, so every receipt the provider writes is a call in the ledger."""
    with (
        fake_provider(tmp_path / "receipts.jsonl") as provider,
        running_proxy(tmp_path / "ledger.db", upstreams={"openai": provider.url}) as proxy,
    ):
        client = openai.OpenAI(base_url=proxy.url + "/openai/v1", api_key="sk-x", max_retries=0)
        moved = "moved=/v1/chat/completions;id=r1;times=1"
        raw = client.chat.completions.with_raw_response.create(
            **CHAT, extra_headers={"x-fake-behaviour": moved}
        )
        completion = raw.parse()
        receipts = provider.receipts()
        calls = calls_of(proxy.ledger)
    assert completion.choices[0].message.content
    assert [r["status"] for r in receipts] == [307, 200]
    assert [c.stage for c in calls] == ["failed", "completed"]
    assert raw.headers.get("effectguard-call-id") == calls[1].call_id


def test_a_location_elsewhere_is_passed_on_as_it_came_and_logged(tmp_path: Path) -> None:
    """A 307 to another origin keeps its Location byte for byte (the proxy cannot guard
    it); the proxy logs it, with the call's id and without the Location's query."""
    elsewhere = "https://elsewhere.example/v2/chat?token=s3cret-token"
    answer, log = post_chat(tmp_path, {"x-fake-behaviour": f"moved={elsewhere}"})
    assert answer.status_code == 307
    assert answer.headers["location"] == elsewhere
    call_id = answer.headers["effectguard-call-id"]
    (line,) = [ln for ln in log.splitlines() if "redirect" in ln and call_id in ln]
    assert "https://elsewhere.example/v2/chat?…" in line
    assert "s3cret" not in log


def test_a_location_on_the_provider_is_written_as_the_proxys_path(tmp_path: Path) -> None:
    """Without following: the Location of a 3xx on the provider's origin (a path, a query)
    comes back as the proxy's path for that provider, on a call and on a read alike."""
    answer, _ = post_chat(
        tmp_path, {"x-fake-behaviour": "status=308;moved=/v1/chat/completions2?x=1"}
    )
    assert answer.status_code == 308
    assert answer.headers["location"] == "/openai/v1/chat/completions2?x=1"


def test_a_prefix_header_from_a_reverse_proxy_is_not_read(tmp_path: Path) -> None:
    """effectguard has no setting for a path prefix a reverse proxy serves it under and
    reads no header naming one (docs/operations.md, "Behind a reverse proxy"): the
    Location is the proxy's own path, even from the trusted loopback address with
    ``X-Forwarded-Prefix``. The docs tell the reverse proxy to add its prefix; a change
    that read the header would change that advice."""
    answer, _ = post_chat(
        tmp_path,
        {
            "x-fake-behaviour": "status=308;moved=/v1/chat/completions2",
            "x-forwarded-prefix": "/llm",
            "x-forwarded-proto": "https",
        },
    )
    assert answer.status_code == 308
    assert answer.headers["location"] == "/openai/v1/chat/completions2"


def test_on_a_providers_own_port_the_location_is_the_whole_path(tmp_path: Path) -> None:
    """On a ``--provider-port`` listener every path is the provider's: the Location is the
    path below the base URL alone, and the openai SDK following it comes back there."""
    port = free_port()
    with (
        fake_provider(tmp_path / "receipts.jsonl") as provider,
        running_proxy(
            tmp_path / "ledger.db",
            upstreams={"openai": provider.url},
            args=["--provider-port", f"openai={port}"],
        ) as proxy,
    ):
        own = f"http://127.0.0.1:{port}"
        moved = httpx.post(
            own + "/v1/chat/completions",
            json=CHAT,
            headers={"x-fake-behaviour": "moved=/v1/chat/completions?x=1"},
        )
        client = openai.OpenAI(base_url=own + "/v1", api_key="sk-x", max_retries=0)
        behaviour = "moved=/v1/chat/completions;id=r2;times=1"
        raw = client.chat.completions.with_raw_response.create(
            **CHAT, extra_headers={"x-fake-behaviour": behaviour}
        )
        receipts = provider.receipts()
        calls = calls_of(proxy.ledger)
    assert moved.headers["location"] == "/v1/chat/completions?x=1"
    assert [r["status"] for r in receipts] == [307, 307, 200]
    assert [c.stage for c in calls] == ["failed", "failed", "completed"]
    assert raw.headers.get("effectguard-call-id") == calls[2].call_id
