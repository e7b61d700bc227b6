"""Migration 23 (PostgreSQL: 16) and a rate window's ``reached`` (docs/contract.md §5.6).

A window records the highest minute its node's windows counted in, so that a clock
stepped back far and then forward into a minute an earlier window counted starts the
window over exactly. The windows a release of writer format 5 counted have no ``reached``:
the migration leaves it NULL, this release counts on in them as that release did (the
forward step is not exact there), and verify judges them by that release's rule; a
declaration that gives the node rate limits starts a window that tracks it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import time
from typing import Any

import pytest
from pgkit import ledger_url
from test_clock_steps import SteppedClock
from test_verify import request
from test_verify_rates import _raw_any, _settled_at, verify_cli

from effectguard.errors import Refusal
from effectguard.ledger import Ledger, Writer, operations
from effectguard.ops.cli import main as cli_main
from effectguard.rules import ratelimit
from effectguard.rules.budget import BudgetPolicy
from effectguard.rules.ratelimit import RateWindow
from effectguard.testing.pgclock import set_ledger_clock

_ = (ledger_url,)  # fixtures


class _Session:
    """The ledger at a URL, on a clock the test steps either way (the database's on
    PostgreSQL), with one writer registered by the first session (every session writes
    as it, as one long-lived replica would)."""

    writer: Writer | None = None

    def __init__(self, url: str, at: float) -> None:
        self.url, self.clock = url, SteppedClock(at)
        self.ledger: Any = None
        self._opened: Any = None

    def set(self, at: float) -> None:
        self.clock.set(at)
        if self.url.startswith("postgresql://"):
            set_ledger_clock(self.url, at)

    async def __aenter__(self) -> _Session:
        self.set(self.clock())
        pg = self.url.startswith("postgresql://")
        self._opened = Ledger.open(self.url) if pg else Ledger.open(self.url, clock=self.clock)
        self.ledger = await self._opened.__aenter__()
        if _Session.writer is None:
            _Session.writer = await self.ledger.store.write(
                Writer("boot", 0),
                lambda tx: operations.register_worker(
                    tx, worker="w1", host="h", pid=1, lease_s=1e9
                ),
            )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._opened.__aexit__(*exc)

    async def admit(self, key: str, tokens: int) -> Any:
        return await self.ledger.admit(
            self.writer, dataclasses.replace(request(key), tokens=tokens)
        )

    async def settle(self, call_id: str, tokens: int) -> None:
        await self.ledger.record(self.writer, call_id, 1, _settled_at(call_id, tokens))


def _reached(url: str) -> list[Any]:
    with _raw_any(url) as conn:
        return [row[0] for row in conn.execute("SELECT reached FROM rate_windows")]


def _as_format_5_migrated(url: str) -> None:
    """The schema a release of writer format 5 left (no ``reached``), migrated by this one."""
    version = 16 if url.startswith("postgresql://") else 23
    with _raw_any(url) as conn:
        conn.execute("ALTER TABLE rate_windows DROP COLUMN reached")
        conn.execute(f"DELETE FROM migrations WHERE version = {version}")
    assert cli_main(["migrate", "--ledger", url]) == 0


def test_a_window_a_format_5_release_counted_is_counted_and_verified_as_it_did(
    ledger_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tpm 1000 on ``team/run``: a release of format 5 admits a call of 800 in minute m,
    then (the clock stepped back three minutes and forward again) one there and one of 800
    in m. Migrated, the window has ``reached`` NULL; this release settles the first call
    at 30 as that release would (taking 770 off the window, which then admits 300) and
    verify agrees. The same window claiming a ``reached`` is judged by this release's rule
    and named. Once a declaration gives the node its limit again, its window tracks
    ``reached``, and verify agrees."""
    start = (int(time.time()) // 60 + 1) * 60 + 30.0
    _Session.writer = None
    node = "team/run"

    async def as_format_5() -> tuple[str, str]:
        async with _Session(ledger_url, start) as s:
            await s.ledger.set_policy(BudgetPolicy(node, tpm=1000))
            first = await s.admit("a", 800)
            s.set(start - 180)
            back = await s.admit("b", 10)
            await s.settle(back.call_id, 10)
            s.set(start + 10)
            again = await s.admit("c", 800)
            return str(first.call_id), str(again.call_id)

    # That release's count: no window tracks a highest minute (this one's, without it).
    monkeypatch.setattr(ratelimit, "first", RateWindow)
    monkeypatch.setattr(
        ratelimit,
        "started",
        lambda p, at, since, flying=(): RateWindow(p, ratelimit.minute_of(at), since=since),
    )
    first, again = asyncio.run(as_format_5())
    monkeypatch.undo()
    _as_format_5_migrated(ledger_url)
    assert _reached(ledger_url) == [None]

    async def settle_and_admit() -> Any:
        async with _Session(ledger_url, start + 12) as s:
            await s.settle(first, 30)
            last = await s.admit("d", 300)
            for call_id, tokens in ((again, 800), (last.call_id, 300)):
                await s.settle(call_id, tokens)
            return last

    assert not isinstance(asyncio.run(settle_and_admit()), Refusal)
    assert _reached(ledger_url) == [None]
    assert verify_cli(ledger_url)[0] == 0, verify_cli(ledger_url)[1]["problems"]
    # An archive cut of every call carries the window as this release counts it from the
    # events (since set by the forward step, 1100 tokens): the stored count (330) stays
    # that release's, unjudged until the window starts over, and the ledger verifies.
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["archive", "--ledger", ledger_url, "--before", "2100-01-01"]) == 0
    assert verify_cli(ledger_url)[0] == 0, verify_cli(ledger_url)[1]["problems"]
    with _raw_any(ledger_url) as conn:
        conn.execute("UPDATE rate_windows SET reached = minute")
    code, report = verify_cli(ledger_url)
    assert code == 1 and report["problems"][0].startswith(f"rate window {node!r}: stored ")
    with _raw_any(ledger_url) as conn:
        conn.execute("UPDATE rate_windows SET reached = NULL")

    async def declare_again() -> None:
        async with _Session(ledger_url, start + 15) as s:
            await s.ledger.set_policy(BudgetPolicy(node))
            await s.ledger.set_policy(BudgetPolicy(node, tpm=1000))
            await s.admit("e", 100)

    asyncio.run(declare_again())
    assert _reached(ledger_url) == [(int(start) + 15) // 60]
    assert verify_cli(ledger_url)[0] == 0, verify_cli(ledger_url)[1]["problems"]
