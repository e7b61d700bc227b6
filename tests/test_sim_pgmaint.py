"""``effectguard sim --maintenance`` on a PostgreSQL ledger: the archive table read back.

An archive on PostgreSQL moves its range into the ledger's ``archived_events`` table;
the simulator puts those events before the live ones, so ``event_lost`` (and every other
invariant) judges the whole history. The real runs are seeds in ``tests/sim_seeds.txt``.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from eventkit import completion
from pgkit import NEEDS_PG, pg_url
from test_verify import R, request

from effectguard.ledger import Ledger, Writer, operations
from effectguard.ops.cli import main
from effectguard.testing.sim.evidence import Evidence, read_ledger
from effectguard.testing.sim.maintchecks import no_event_lost
from effectguard.testing.sim.maintevidence import read_archived_table

_ = (pg_url,)  # fixtures

pytestmark = NEEDS_PG


async def _completed_long_ago(url: str, count: int) -> None:
    """``count`` calls admitted and completed (settled: an archive takes them)."""
    async with Ledger.open(url) as ledger:
        writer = await ledger.store.write(
            Writer("boot", 0),
            lambda tx: operations.register_worker(tx, worker="w1", host="h", pid=1, lease_s=30),
        )
        for n in range(count):
            done = await ledger.admit(writer, request(f"done-{n}"))
            events = completion(done.call_id, budget="team/run", reserved=R, actual=R)
            await ledger.record(writer, done.call_id, 1, events)


def test_archived_events_are_read_back_from_the_table(
    pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """After an archive, the live events alone miss the archived range (``event_lost``);
    with the table's events put before them the history is whole, each event once."""
    asyncio.run(_completed_long_ago(pg_url, 3))
    argv = ["archive", "--ledger", pg_url, "--before", "2999-01-01", "--step-events", "5"]
    assert main([*argv, "--json"]) == 0
    moved = json.loads(capsys.readouterr().out)
    assert moved["calls"] == 3 and moved["steps"] > 1, moved

    live, calls = asyncio.run(read_ledger(pg_url))
    archived = read_archived_table(pg_url)
    assert [e.seq for e in archived] == list(range(1, moved["last_seq"] + 1))
    assert {e.call_id for e in archived if e.kind == "call.manifest"} and not calls
    assert [v.invariant for v in no_event_lost(Evidence(live, calls))] == ["event_lost"]
    assert no_event_lost(Evidence(archived + live, calls)) == []
