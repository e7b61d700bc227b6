"""``cost_usd`` is null while a call is not settled (SPEC §8, docs/contract.md §8 `calls`),
also once an earlier round of it was decided not applied and a resend is unknown again.

Traffic goes through ``AsyncGuardTransport`` to a respx-mocked OpenAI; a keyed call's
upstream times out (effect unknown), a person decides it ``--not-applied``, and its keyed
resend times out again. ``calls --json`` and ``show --json`` must not report the first
round's zero as the call's settled cost while the second round's effect is unknown.
"""

from __future__ import annotations

import asyncio
import json
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx

from effectguard import AsyncGuardTransport, GuardSettings
from effectguard.ops.cli import main

CHAT_URL = "https://api.openai.com/v1/chat/completions"
BODY = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
USAGE = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}


class Upstream:
    """Times out (after the request was sent) until told to answer."""

    def __init__(self) -> None:
        self.answer = False
        self.sent = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.sent += 1
        if not self.answer:
            raise httpx.ReadTimeout("upstream read timed out", request=request)
        return httpx.Response(200, json={"id": "c", "object": "chat.completion", "usage": USAGE})


async def _send(ledger: Path, upstream: Upstream) -> httpx.Response:
    settings = GuardSettings(retry_wait_s=0, retry_wait_max_s=0)
    with respx.mock(assert_all_called=True) as mock:
        mock.post(CHAT_URL).mock(side_effect=upstream)
        transport = AsyncGuardTransport(ledger=str(ledger), settings=settings)
        async with httpx.AsyncClient(transport=transport, timeout=10) as client:
            return await client.post(CHAT_URL, json=BODY, headers={"Idempotency-Key": "k-1"})


def send(ledger: Path, upstream: Upstream) -> httpx.Response:
    """The keyed request, through a fresh transport on ``ledger``."""
    return asyncio.run(asyncio.wait_for(_send(ledger, upstream), timeout=30))


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    """``effectguard ARGV --json`` in-process; must exit 0; its output."""
    capsys.readouterr()
    assert main([*argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_a_resend_unknown_again_after_not_applied_has_no_settled_cost(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """After ``--not-applied`` (cost 0) and a keyed resend whose effect is unknown again,
    ``cost_usd`` is null (not the first round's 0) and ``held_usd`` the new hold; once a
    resend settles, ``cost_usd`` is its real cost."""
    ledger, upstream = tmp_path / "l.db", Upstream()
    at = ("--ledger", str(ledger))
    first = send(ledger, upstream)
    assert first.status_code == 504
    call_id = first.headers["effectguard-call-id"]
    decided = cli(capsys, "reconcile", call_id, "--not-applied", "--note", "not there", *at)
    assert (decided["stage"], decided["cost_usd"]) == ("reconciled_not_applied", "0.000000000")

    again = send(ledger, upstream)
    assert again.status_code == 504 and again.headers["effectguard-call-id"] == call_id
    assert upstream.sent == 2
    (row,) = cli(capsys, "calls", *at)
    assert (row["stage"], row["attempts"]) == ("effect_unknown", 2)
    assert row["cost_usd"] is None, row
    assert Decimal(row["held_usd"]) == Decimal(row["reserved_usd"]) > 0
    assert cli(capsys, "show", call_id, *at)["cost_usd"] is None

    cli(capsys, "reconcile", call_id, "--not-applied", "--note", "not there either", *at)
    upstream.answer = True
    assert send(ledger, upstream).status_code == 200
    (row,) = cli(capsys, "calls", *at)
    assert row["stage"] == "completed" and Decimal(row["cost_usd"]) > 0
    assert Decimal(row["held_usd"]) == 0
    (node,) = [b for b in cli(capsys, "budgets", *at) if b["path"] == "default"]
    assert Decimal(node["spent_usd"]) == Decimal(row["cost_usd"])
