"""Operator reads on a ledger with many unknown calls: bounded, and exact about all of them.

An outage can leave thousands of ``effect_unknown`` calls. The operator page and
``/metrics`` must still say how many there are, what they hold and which is oldest,
while reading only aggregates and the few calls they show (docs/operations.md, the
operator page; docs/metrics.md).
"""

from __future__ import annotations

import re
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import pytest
from operatorkit import ADMIN_KEY, PAGE, config_text, write_unknown_calls
from prometheus_client.parser import text_string_to_metric_families

from effectguard.ingress.admin.routes import UNKNOWN_SHOWN
from effectguard.testing import Proxy, running_proxy

pytestmark = pytest.mark.slow

FIRST_AT = 1_780_000_000.0  # the oldest unknown call's admission
REST_AT = FIRST_AT + 3600.0  # every other's, an hour later


def _serve(tmp: Path) -> AbstractContextManager[Proxy]:
    """``effectguard serve`` with the admin key, on the test's ledger."""
    config = tmp / "effectguard.toml"
    config.write_text(config_text())
    return running_proxy(tmp / "ledger.db", args=["--config", str(config)])


def test_the_unknown_list_counts_every_call_and_lists_the_oldest(tmp_path: Path) -> None:
    """With more unknown calls than the page lists, it still counts all of them and their
    held money, and lists the oldest first."""
    count = UNKNOWN_SHOWN + 1
    ids = write_unknown_calls(tmp_path / "ledger.db", count, first_at=FIRST_AT, rest_at=REST_AT)
    with _serve(tmp_path) as proxy:
        page = httpx.get(proxy.url + PAGE, headers={"authorization": f"Bearer {ADMIN_KEY}"})
    assert page.status_code == 200
    # 501 calls of 10,000 nano-dollars each: $0.00501, not the 500 listed.
    assert f"{count} call(s) whose effect is unknown, holding $0.00501." in page.text
    listed = re.findall(r'href="/_effectguard/calls/([^"]+)"', page.text)
    assert len(listed) == UNKNOWN_SHOWN and listed[0] == ids[0]
    assert f"Only the oldest {UNKNOWN_SHOWN} are shown" in page.text


def test_the_oldest_unknown_gauge_is_exact_however_many_are_unknown(tmp_path: Path) -> None:
    """``effectguard_effect_unknown_oldest_timestamp_seconds`` names the oldest unknown
    call even when ten thousand newer ones are unknown too."""
    write_unknown_calls(tmp_path / "ledger.db", 10_001, first_at=FIRST_AT, rest_at=REST_AT)
    with _serve(tmp_path) as proxy:
        text = httpx.get(proxy.url + "/metrics", timeout=30).text
    samples = {
        (s.name, s.labels.get("provider")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples["effectguard_effect_unknown_calls", "openai"] == 10_001
    assert samples["effectguard_effect_unknown_oldest_timestamp_seconds", "openai"] == FIRST_AT
