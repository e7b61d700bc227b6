"""A rate-limit refusal through the proxy, as the openai SDK meets it (contract §5.6, §9).

SPEC gives every 429 ``rate_limited`` ``retry-after`` and ``x-should-retry: true``, the
refusals of a request that does not fit a limit as it is set now (rpm or concurrency 0,
a tpm below the request's own estimate) included: an operator can raise the limit at
run time, and the SDKs retry a bounded number of times (``max_retries``). The SDK's
waits are recorded instead of slept (its module's ``time``); provider effects are
counted in the fake provider's receipt log.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import openai._base_client
import pytest

from effectguard.ops.cli import main as cli_main
from effectguard.testing import fake_provider, running_proxy

pytestmark = pytest.mark.slow

MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]


class _SdkClock:
    """The openai SDK's ``time`` module, recording each wait it would sleep (and running
    ``on_sleep``) instead of sleeping, so a 60-second ``retry-after`` costs the test none."""

    def __init__(self, on_sleep: Callable[[], None] = lambda: None) -> None:
        self.waits: list[float] = []
        self._on_sleep = on_sleep

    def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        self._on_sleep()

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def _ledger(tmp_path: Path, *limits: str) -> str:
    ledger = str(tmp_path / "l.db")
    assert cli_main(["migrate", "--ledger", ledger]) == 0
    assert cli_main(["budget", "set", "team", *limits, "--ledger", ledger]) == 0
    return ledger


def _sdk(proxy_url: str) -> openai.OpenAI:
    return openai.OpenAI(
        api_key="sk-test",
        base_url=proxy_url + "/openai/v1",
        max_retries=2,
        default_headers={"Effectguard-Budget": "team"},
    )


def _rate_refusals(metrics: str) -> float:
    """``effectguard_refusals_total`` for ``rate_limited``, summed over its labels."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("effectguard_refusals_total{") and 'reason="rate_limited"' in line
    )


def test_the_sdk_retries_a_request_no_limit_fits_twice_then_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rpm 0: the proxy answers 429 ``rate_limited`` with ``retry-after: 60`` and
    ``x-should-retry: true``; the SDK (``max_retries=2``) waits 60 s twice, then raises
    ``RateLimitError``; three refusals, nothing reached the provider."""
    ledger = _ledger(tmp_path, "--rpm", "0")
    clock = _SdkClock()
    monkeypatch.setattr(openai._base_client, "time", clock)
    with fake_provider(tmp_path / "receipts.jsonl") as provider:
        with running_proxy(ledger, upstreams={"openai": provider.url}) as proxy:
            with pytest.raises(openai.RateLimitError) as raised:
                _sdk(proxy.url).chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)
            metrics = httpx.get(proxy.url + "/metrics", timeout=10).text
        receipts = provider.receipts()
    refused = raised.value.response
    assert refused.headers["x-should-retry"] == "true"
    assert refused.headers["retry-after"] == "60"
    assert raised.value.body["type"] == "rate_limited"  # type: ignore[index]
    assert "an operator must raise" in raised.value.body["message"]  # type: ignore[index]
    assert clock.waits == [60.0, 60.0]
    assert _rate_refusals(metrics) == 3
    assert receipts == []


def test_a_retry_after_an_operator_raises_the_limit_is_sent_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rpm 0, and an operator runs ``budget set team --rpm 10`` while the SDK waits its
    ``retry-after``: the SDK's retry is admitted and the provider receives it once."""
    ledger = _ledger(tmp_path, "--rpm", "0")

    def raise_the_limit() -> None:
        assert cli_main(["budget", "set", "team", "--rpm", "10", "--ledger", ledger]) == 0

    clock = _SdkClock(raise_the_limit)
    monkeypatch.setattr(openai._base_client, "time", clock)
    with fake_provider(tmp_path / "receipts.jsonl") as provider:
        with running_proxy(ledger, upstreams={"openai": provider.url}) as proxy:
            completion = _sdk(proxy.url).chat.completions.create(
                model="gpt-4o-mini", messages=MESSAGES
            )
        receipts = provider.receipts()
    assert completion.choices
    assert clock.waits == [60.0]
    assert len(receipts) == 1
