"""The proxy's logs as an operator and a log pipeline read them, from a real
``effectguard serve``: what docs/logs-and-traces.md and docs/configuration.md promise
about access lines holds for each outcome."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from leavekit import leave_with_reset
from observing import wait_for

from effectguard.testing import FakeProvider, fake_provider, running_proxy

pytestmark = pytest.mark.slow

OPENAI_CHAT = "/openai/v1/chat/completions"
CALL_ID = "effectguard-call-id"
TENANT_KEY = "eg-logwalk-tenant-key-0123456789"


@pytest.fixture
def provider(tmp_path: Path) -> Iterator[FakeProvider]:
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        yield fake


def chat(content: str = "hello") -> dict[str, Any]:
    return {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": content}]}


def access_lines(log: str) -> list[dict[str, Any]]:
    """Every JSON access line of a ``--log-format json`` log (each line must parse)."""
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("event") == "access"]


def test_access_lines_name_the_proxy_key(tmp_path: Path, provider: FakeProvider) -> None:
    """configuration.md: a `[[keys]]` entry's `name` is "printed in access lines". Each
    line of a request made with a key names it as the field `key` (JSON and text), a
    refusal's line too; a proxy with no keys writes no `key` field."""
    digest = hashlib.sha256(TENANT_KEY.encode()).hexdigest()
    config = tmp_path / "keys.toml"
    config.write_text(
        f'[budgets]\n"team-a/poor" = "0.000000001"\n'
        f'[[keys]]\nname = "ci-runner"\nsha256 = "{digest}"\nbudget_root = "team-a"\n'
    )
    upstreams = {"openai": provider.url}
    headers = {"Authorization": f"Bearer {TENANT_KEY}"}
    for log_format in ("json", "text"):
        args = ["--config", str(config), "--log-format", log_format]
        ledger = tmp_path / f"{log_format}.db"
        with running_proxy(ledger, upstreams=upstreams, args=args) as proxy:
            done = httpx.post(proxy.url + OPENAI_CHAT, json=chat(), headers=headers, timeout=10)
            poor = httpx.post(
                proxy.url + OPENAI_CHAT,
                json=chat(),
                headers={**headers, "Effectguard-Budget": "team-a/poor"},
                timeout=10,
            )
        assert (done.status_code, poor.status_code) == (200, 402)
        log = proxy.log()
        assert TENANT_KEY not in log
        if log_format == "json":
            access = access_lines(log)
            assert [(line["status"], line.get("key")) for line in access] == [
                (200, "ci-runner"),
                (402, "ci-runner"),
            ], access
        else:
            access = [line for line in log.splitlines() if "effectguard.access" in line]
            assert len(access) == 2 and all(
                "key=ci-runner" in line.split(" ") for line in access
            ), access
    json_args = ["--log-format", "json"]
    with running_proxy(tmp_path / "open.db", upstreams=upstreams, args=json_args) as p:
        assert httpx.post(p.url + OPENAI_CHAT, json=chat(), timeout=10).status_code == 200
    (line,) = access_lines(p.log())
    assert "key" not in line, line


def test_a_client_that_left_before_its_refusal_is_logged_499(
    tmp_path: Path, provider: FakeProvider
) -> None:
    """logs-and-traces.md: `status` is 499 for "a proxy client whose connection was gone
    when its whole answer came to be written". A client whose connection is reset 0.3 s
    into a call answered 504 `effect_unknown` at 1 s got nothing: its line says 499 (with
    the call's stage, outcome and error), as a 200's does. It used to say 504."""
    config = tmp_path / "slow.toml"
    config.write_text("[upstream]\nread_timeout_s = 1\n")
    args = ["--config", str(config), "--log-format", "json"]
    slow = {"x-fake-delay": "3"}
    with running_proxy(tmp_path / "l.db", upstreams={"openai": provider.url}, args=args) as proxy:
        leave_with_reset(proxy.url, OPENAI_CHAT, chat("left"), slow, 0.3)
        stayed = httpx.post(proxy.url + OPENAI_CHAT, json=chat("stayed"), headers=slow, timeout=10)
        assert stayed.status_code == 504

        def both() -> list[dict[str, Any]]:
            lines = access_lines(proxy.log())
            return lines if len(lines) == 2 else []

        access = wait_for(both, 10, "two access lines")
    by_call = {line["call_id"]: line for line in access}
    assert by_call.pop(stayed.headers[CALL_ID])["status"] == 504
    ((_, left),) = by_call.items()
    assert (left["status"], left["stage"], left["outcome"], left["error"]) == (
        499,
        "effect_unknown",
        "effect_unknown",
        "effect_unknown",
    ), left
