"""A fleet that outgrows PostgreSQL's connection slots, simulated with a role's
``CONNECTION LIMIT`` (as a small server's ``max_connections``).

A replica holds two connections (docs/operations.md). With the role's two slots taken by
a running replica, a second replica that starts must stop with exit 4 ("the ledger is
unavailable", the exit-code table's) naming the cause; until 2026-12-05 it exited 3,
which the table gives a ledger's refusal. A command meets the same: exit 4, no
traceback. The running replica serves on, each request sent once.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pgkit import NEEDS_PG, scratch_role
from stagedkit import run, serve_refusing

from effectguard.testing import fake_provider, running_proxy

pytestmark = NEEDS_PG

CHAT = "/openai/v1/chat/completions"
FULL = "too many connections"


@pytest.fixture
def two_slots() -> Iterator[str]:
    """A fresh, migrated ledger reached as a role with two connection slots."""
    with scratch_role("CONNECTION LIMIT 2") as url:
        assert run("migrate", "--ledger", url).code == 0
        yield url


def test_a_replica_or_command_with_no_slot_left_is_exit_4_and_the_fleet_serves_on(
    two_slots: str, tmp_path: Path
) -> None:
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
    with (
        fake_provider(tmp_path / "receipts.jsonl") as fake,
        running_proxy(
            two_slots, upstreams={"openai": fake.url}, log_path=tmp_path / "serve.log"
        ) as proxy,
    ):
        second = serve_refusing("--ledger", two_slots, "--port", "0")
        assert second.code == 4 and FULL in second.err, second
        assert "Traceback" not in second.err, second.err
        listed = run("calls", "--ledger", two_slots)
        assert listed.code == 4 and FULL in listed.err, listed
        answer = httpx.post(proxy.url + CHAT, json=body, timeout=30)
        assert answer.status_code == 200, answer.text
        assert len(fake.effects()) == 1
    assert run("verify", "--ledger", two_slots).code == 0
