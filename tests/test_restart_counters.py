"""A restart of a real ``effectguard serve`` changes no counter (issue #15): budget rows in
every period, rate-limit windows and key rows are the same after a SIGTERM and after a
SIGKILL as before, and an rpm limit reached before the restart still refuses after it, in
the same minute. On SQLite and (with EFFECTGUARD_TEST_PG_DSN) PostgreSQL.

The minute must not turn during the test. On PostgreSQL the ledger's clock is moved to a
second into a minute before the proxy starts (:mod:`effectguard.testing.pgclock`), which
leaves 59 s; on SQLite the ledger's clock is the host's, and the test waits for a new
minute when fewer than :data:`ROOM_S` seconds are left in this one. The whole test takes
about ten.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pgkit import ledger_url

from effectguard.ledger import Ledger
from effectguard.testing import FakeProvider, Proxy, fake_provider, start_proxy

_ = (ledger_url,)  # fixtures

pytestmark = pytest.mark.slow

CHAT = "/openai/v1/chat/completions"
#: Seconds of the current minute the test needs: two restarts and a few requests.
ROOM_S = 40.0


def cli(config: Path, *args: str) -> Any:
    """``effectguard ARGS --config CONFIG --json``; its parsed output."""
    done = subprocess.run(
        [sys.executable, "-m", "effectguard", *args, "--config", str(config), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def post(proxy: Proxy, key: str, budget: str) -> httpx.Response:
    """A small chat completion through ``proxy`` with proxy key ``key``, charged to ``budget``."""
    body = {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
    }
    headers = {"Authorization": f"Bearer {key}", "effectguard-budget": budget}
    return httpx.post(proxy.url + CHAT, json=body, headers=headers, timeout=15)


def stored(url: str) -> dict[str, Any]:
    """Every counter the ledger keeps: budget rows of every (path, period), policies, rate
    windows and key rows (read by opening the ledger, as the CLI does)."""

    async def read() -> dict[str, Any]:
        async with Ledger.open(url) as ledger:
            return {
                "budgets": sorted(await ledger.store.budget_nodes(), key=lambda n: n.key),
                "policies": await ledger.policies(),
                "windows": sorted(await ledger.store.rate_windows(), key=lambda w: w.path),
                "keys": sorted(await ledger.keys(), key=lambda k: k.name),
            }

    return asyncio.run(read())


def shown(config: Path) -> dict[str, Any]:
    """What the CLI shows: every budget now, this day's and this month's, and the keys."""
    now = cli(config, "budgets")
    day = next(n["period"] for n in now if n["path"] == "team")
    month = next(n["period"] for n in now if n["path"] == "ops")
    return {
        "now": now,
        "day": cli(config, "budgets", "--period", day),
        "month": cli(config, "budgets", "--period", month),
        "keys": cli(config, "key", "list"),
    }


def room_in_the_minute(url: str) -> None:
    """Leave :data:`ROOM_S` seconds before the ledger's minute turns (see the module doc)."""
    if url.startswith("postgres"):
        from effectguard.testing.pgclock import ledger_clock, set_ledger_clock

        set_ledger_clock(url, None)  # creates the ledger's tables
        now = ledger_clock(url)
        set_ledger_clock(url, now - now % 60 + 60 + 1)
        return
    left = 60 - time.time() % 60
    if left < ROOM_S:
        time.sleep(left + 0.5)


@pytest.fixture
def provider(tmp_path: Path) -> Iterator[FakeProvider]:
    """The fake provider process."""
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        yield fake


def serve(url: str, config: Path, provider: FakeProvider, log: Path) -> Proxy:
    """``effectguard serve --config CONFIG`` on the ledger, with the fake provider upstream."""
    return start_proxy(
        url, upstreams={"openai": provider.url}, args=["--config", str(config)], log_path=log
    )


def test_a_restart_of_serve_changes_no_counter(
    ledger_url: str, provider: FakeProvider, tmp_path: Path
) -> None:
    """Periods, an rpm limit and ledger keys: after a SIGTERM and after a SIGKILL restart,
    every budget row of every period, every rate window and every key row is what it was,
    the CLI shows the same, and the rpm limit reached before still refuses 429."""
    config = tmp_path / "effectguard.toml"
    # [budgets] seeds team; ops is set by an operator, which a restart must not undo.
    budgets = '[budgets]\n"team" = "5"\n"ops" = "9"\n'
    config.write_text(f"ledger = {json.dumps(ledger_url)}\n\n{budgets}")
    room_in_the_minute(ledger_url)
    proxy = serve(ledger_url, config, provider, tmp_path / "first.log")
    cli(config, "budget", "set", "team", "--period", "day", "--tz", "Europe/Berlin")
    cli(config, "budget", "set", "team/rated", "--rpm", "2")
    cli(config, "budget", "set", "ops", "--limit", "7", "--period", "month", "--tz", "UTC")
    team = cli(config, "key", "new", "--root", "team", "--name", "team-key")["key"]
    ops = cli(config, "key", "new", "--root", "ops", "--name", "ops-key")["key"]
    gone = cli(config, "key", "new", "--root", "ops", "--name", "gone")["key"]
    cli(config, "key", "revoke", "gone")
    try:
        deadline = time.monotonic() + 30
        while post(proxy, gone, "ops").status_code != 401:  # serve has read the revocation
            assert time.monotonic() < deadline, "serve never read the ledger's keys"
            time.sleep(0.1)
        for key, budget in ((team, "team"), (team, "team/a"), (ops, "ops"), (ops, "ops/x")):
            assert post(proxy, key, budget).status_code == 200
        assert [post(proxy, team, "team/rated").status_code for _ in range(3)] == [200, 200, 429]
        before, seen = stored(ledger_url), shown(config)
        assert [w.requests for w in before["windows"]] == [2]
        for how in ("SIGTERM", "SIGKILL"):
            if how == "SIGTERM":
                assert proxy.stop() == 0
            else:
                proxy.kill()
                proxy.process.wait(10)
            proxy = serve(ledger_url, config, provider, tmp_path / f"after-{how}.log")
            assert stored(ledger_url) == before, how
            assert shown(config) == seen, how
            refused = post(proxy, team, "team/rated")
            assert refused.status_code == 429, (how, refused.text)
            assert refused.json()["error"]["type"] == "rate_limited"
            assert stored(ledger_url) == before, how  # a refusal changes no counter either
    finally:
        proxy.kill()
        proxy.process.wait(10)
    assert cli(config, "verify")["ok"] is True
