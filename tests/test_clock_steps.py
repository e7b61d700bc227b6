"""The ledger's clock as it really behaves: stepped back by NTP or a resumed VM, or given
by a test as whole numbers. Each test drives the in-process transport (or the ledger a
user opens) on a SQLite ledger whose clock the test moves, and ends with ``effectguard
verify``.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from effectguard.ledger import Ledger
from effectguard.ops.cli import main as cli_main
from effectguard.rules.budget import BudgetPolicy
from effectguard.testing.clock import ManualClock

CHAT_URL = "https://api.openai.com/v1/chat/completions"
ANSWER = (
    b'{"id": "c", "object": "chat.completion", "model": "gpt-4o-mini", "choices": [],'
    b' "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}'
)
#: 30 seconds into a minute.
T0 = 1_800_000_030.0


class SteppedClock:
    """A wall clock that an operator's NTP may set anywhere, backwards too."""

    def __init__(self, at: float) -> None:
        self._at = at
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._at

    def set(self, at: float) -> None:
        with self._lock:
            self._at = at


def test_a_clock_answering_whole_numbers_keeps_the_ledger_verifiable(tmp_path: Path) -> None:
    """A ManualClock started at a whole number of seconds (an int) times events that verify
    reads back and accepts."""
    ledger = str(tmp_path / "l.db")

    async def run() -> None:
        async with Ledger.open(ledger, clock=ManualClock(start=1_800_000_000)) as led:
            await led.set_policy(BudgetPolicy("team", rpm=3))

    asyncio.run(run())
    assert cli_main(["verify", "--ledger", ledger]) == 0
