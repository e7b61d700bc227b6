# ruff: noqa: F811  (the provider fixture is imported by name and used as an argument)
"""An AsyncGuardTransport across event loops, with the real fake provider (its receipt log
counts what reached it): a script that calls ``asyncio.run`` more than once with one
transport made at module level (docs/contract.md §3.8)."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import httpx
import pytest
from transportkit import provider, stages_of  # noqa: F401  (a fixture, used by name)

import effectguard
from effectguard.ops.cli import main as cli_main
from effectguard.testing import FakeProvider

pytestmark = pytest.mark.slow

CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}

#: A bound on a hang, not a timing claim.
HANG_BOUND_S = 60.0


def test_a_transport_left_open_by_an_ended_asyncio_run_works_in_the_next(
    provider: FakeProvider, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One transport, three ``asyncio.run`` calls that each make a call and never close it,
    then one that closes it: every call is sent once and completed, the close returns,
    and the ledger verifies. The second ``asyncio.run`` was refused ("close it (aclose)
    before using it from another event loop"), and the ``aclose()`` it advised failed
    from the next loop with "Event loop is closed", for good."""
    ledger = tmp_path / "ledger.db"
    transport = effectguard.AsyncGuardTransport(
        ledger=str(ledger), upstreams={"openai": provider.url}
    )

    async def call() -> int:
        client = httpx.AsyncClient(transport=transport, base_url=provider.url)
        response = await client.post("/v1/chat/completions", json=CHAT)
        return response.status_code

    async def bounded(step: str) -> object:
        work = call() if step == "call" else transport.aclose()
        try:
            return await asyncio.wait_for(work, HANG_BOUND_S)
        except RuntimeError as exc:
            return str(exc)

    steps = ["call", "call", "call", "aclose"]
    assert [asyncio.run(bounded(step)) for step in steps] == [200, 200, 200, None]
    assert len(provider.effects()) == 3
    assert stages_of(capsys, ledger) == Counter(completed=3)
    capsys.readouterr()
    assert cli_main(["verify", "--ledger", str(ledger)]) == 0
