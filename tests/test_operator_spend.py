"""The spend page in-process: the ledger's sums laid out, and the notice when the window
reaches past the calls the page reads (``SPEND_CALLS``, made small here)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from operatorkit import ADMIN_KEY, PAGE, config_text

from effectguard.config.settings import load_settings
from effectguard.ingress.admin import routes
from effectguard.ingress.server import ProxyApp, create_app
from effectguard_bench import spendbench

NOTICE = "older days may show less"


@pytest_asyncio.fixture
async def app(tmp_path: Path) -> AsyncIterator[ProxyApp]:
    """A proxy with the operator page on, over a ledger of four paid calls (admitted and
    settled as the guard records them)."""
    config = tmp_path / "effectguard.toml"
    config.write_text(config_text())
    ledger = str(tmp_path / "l.db")
    await spendbench.fill(ledger, 4)
    settings = load_settings(config=config, ledger=ledger, upstreams={"openai": "http://up"})
    proxy = create_app(settings)
    await proxy.startup()
    try:
        yield proxy
    finally:
        await proxy.shutdown()


def client_of(proxy: ProxyApp) -> httpx.AsyncClient:
    """A client speaking to ``proxy`` in-process, as the admin."""
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=proxy),
        base_url="http://proxy",
        headers={"authorization": f"Bearer {ADMIN_KEY}"},
    )


async def test_the_spend_page_charts_the_ledgers_sums(app: ProxyApp) -> None:
    """Every paid call is in the table's count, and no notice is shown while the page
    reads every call of its window."""
    async with client_of(app) as client:
        page = (await client.get(PAGE + "spend?days=7")).text
    assert "openai/gpt-4o-mini" in page and "<rect" in page
    assert ">4<" in page
    assert NOTICE not in page


async def test_the_spend_page_says_when_its_window_reaches_past_the_calls_read(
    app: ProxyApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With more calls in the window than the page reads, it says from when it read."""
    monkeypatch.setattr(routes, "SPEND_CALLS", 3)
    async with client_of(app) as client:
        page = (await client.get(PAGE + "spend?days=7")).text
    assert NOTICE in page and ">3<" in page
