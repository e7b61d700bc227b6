"""A call billed above its reservation (docs/contract.md §5.4 "Overshoot", §11.2's example):
charged in full, the limit passed by that overshoot alone, every later call refused.

The real fake provider counts a token per 4 bytes of the whole body, as a provider counts
the framing around a prompt, so a short prompt bills more input tokens than the prompt
content's bytes that the reservation's input bound counts.
"""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
from transportkit import provider

import effectguard
from effectguard.ops.cli import main
from effectguard.testing import FakeProvider

__all__ = ["provider"]

# The compact JSON body of contract.md §11.2's example: 85 bytes, 21 tokens to the fake.
HELLO = b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hello"}],"max_tokens":5}'


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    """``effectguard ARGV --json`` in-process; must exit 0; its output."""
    capsys.readouterr()
    assert main([*argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_an_overshoot_is_charged_and_the_limit_it_passes_refuses_the_next_call(
    tmp_path: Path, provider: FakeProvider, capsys: pytest.CaptureFixture[str]
) -> None:
    """The documented example costs 0.00000615 on a 0.00000375 reservation; a limit with
    room for its reservation only is passed by the overshoot, never by a second call."""
    at = ("--ledger", str(tmp_path / "l.db"))
    assert main(["migrate", *at]) == 0
    assert main(["budget", "set", "default", "--limit", "0.000005", *at]) == 0
    transport = effectguard.GuardTransport(ledger=at[1], upstreams={"openai": provider.url})
    url = provider.url + "/v1/chat/completions"
    kind = {"content-type": "application/json"}
    with httpx.Client(transport=transport) as client:
        first = client.post(url, content=HELLO, headers=kind)
        second = client.post(url, content=HELLO, headers=kind)
    assert first.status_code == 200, first.text
    assert first.json()["usage"]["prompt_tokens"] == len(HELLO) // 4 == 21
    assert second.status_code == 402
    assert "has 0.000000000 USD of room" in second.json()["error"]["message"]
    assert len(provider.effects()) == 1

    (row,) = [c for c in cli(capsys, "calls", *at) if c["stage"] == "completed"]
    assert (row["reserved_usd"], row["cost_usd"]) == ("0.000003750", "0.000006150")
    (node,) = cli(capsys, "budgets", *at)
    assert Decimal(node["spent_usd"]) == Decimal(row["cost_usd"]) > Decimal(node["limit_usd"])
    assert Decimal(node["reserved_usd"]) == 0
    capsys.readouterr()
    assert main(["verify", *at]) == 0, capsys.readouterr()
