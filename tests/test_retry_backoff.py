"""A key-less SDK retry that comes while its call waits between automatic retries.

The provider answers 429 (declared not processed, a retry status), so the proxy waits
``retry_wait_s`` before sending the call again (contract.md §3.5). The client's own
timeout ends its wait first and the SDK retries (``x-stainless-retry-count: 1``, no key)
during that back-off. The call then rests at ``not_processed``, which the retry used not
to match: it was admitted as new work and sent at once, and the proxy's own automatic
retry went out after it: the provider did the work twice for one SDK call. Effects are
counted with the provider's receipt log.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import httpx
import pytest

from effectguard.testing import fake_provider, running_proxy

pytestmark = pytest.mark.slow

BODY = json.dumps(
    {"model": "gpt-4o-mini", "max_tokens": 3, "messages": [{"role": "user", "content": "once"}]}
)


def test_a_retry_during_the_back_off_joins_the_call_it_repeats(tmp_path: Path) -> None:
    """429 on the first attempt, a 4 s back-off, the client gone at 1 s and its retry at
    1.5 s: the provider is sent the work once (one 200), and the retry gets that answer.
    (The client's timeout leaves the proxy ample time to admit and send the first try.)"""
    config = tmp_path / "c.toml"
    config.write_text("[guard]\nretry_wait_s = 4\nmax_retries = 1\n")
    headers = {
        "content-type": "application/json",
        "x-fake-behaviour": "status=429;id=backoff;times=1",  # only the first attempt
    }
    with (
        fake_provider(tmp_path / "receipts.jsonl") as fake,
        running_proxy(
            tmp_path / "l.db", upstreams={"openai": fake.url}, args=["--config", str(config)]
        ) as proxy,
    ):
        url = proxy.url + "/openai/v1/chat/completions"
        started = time.monotonic()
        with httpx.Client(timeout=1.0) as first, contextlib.suppress(httpx.TimeoutException):
            first.post(url, content=BODY, headers={**headers, "x-stainless-retry-count": "0"})
        time.sleep(max(0.0, started + 1.5 - time.monotonic()))
        with httpx.Client(timeout=30) as second:
            retry = second.post(
                url, content=BODY, headers={**headers, "x-stainless-retry-count": "1"}
            )
    assert [r["status"] for r in fake.receipts()] == [429, 200]
    assert retry.status_code == 200, retry.text
    assert retry.headers.get("effectguard-replayed") == "true"
