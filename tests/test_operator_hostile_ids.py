"""The operator page given call ids no call can have, on each ledger (SQLite, and
PostgreSQL when EFFECTGUARD_TEST_PG_DSN is set), through a real ``effectguard serve``.

A crafted link's id is a page that does not exist (404), on every backend alike: never
a 503 that tells the operator the ledger is down, nor a ``the ledger failed`` warning in
the log that an alert on ledger failures would page someone for.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from operatorkit import ADMIN_KEY, PAGE, config_text
from pgkit import ledger_url

from effectguard.testing import fake_provider, running_proxy

_ = (ledger_url,)  # fixtures

pytestmark = pytest.mark.slow

#: A NUL (PostgreSQL's text holds none), a NUL inside an id's shape, and a long id.
IDS = ["%00", "call_0%000", "call_" + "0" * 300]


def test_an_id_no_call_can_have_is_not_found(ledger_url: str, tmp_path: Path) -> None:
    """GET a call's page and POST its decision for such ids: 404, nothing logged as a
    ledger failure."""
    config = tmp_path / "effectguard.toml"
    config.write_text(config_text())
    bearer = {"authorization": f"Bearer {ADMIN_KEY}"}
    decision = {"decision": "not_applied", "note": "checked"}
    with (
        fake_provider(tmp_path / "receipts.jsonl") as provider,
        running_proxy(
            ledger_url,
            upstreams={"openai": provider.url},
            args=["--config", str(config)],
            log_path=tmp_path / "proxy.log",
        ) as proxy,
    ):
        for call_id in IDS:
            url = f"{proxy.url}{PAGE}calls/{call_id}"
            page = httpx.get(url, headers=bearer)
            assert page.status_code == 404, (call_id, page.status_code)
            posted = httpx.post(f"{url}/reconcile", data=decision, headers=bearer)
            assert posted.status_code == 404, (call_id, posted.status_code)
        assert "the ledger failed" not in proxy.log()
