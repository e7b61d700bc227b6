"""A PostgreSQL connection lost while it is being set up: "ledger unavailable", exit 4.

Each new connection first declares its session settings (the writer format, the
ledger's schema as ``search_path``, timeouts). A server that shuts down or restarts
right then (``pg_ctlcluster stop -m immediate``) accepted the connection and closes it
under the first statement. Found by ``effectguard sim --ledger postgres --maintenance
--ledger-faults`` (seed 4, 15 s): a ``reconcile`` started as the server stopped ended in
a traceback (exit 1) instead of exit 4. The connection here runs through a relay that
holds a chosen statement and then closes every connection, as the server did.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest
from pgkit import NEEDS_PG, pg_url, server_port, via
from test_pg_faults import Relay
from test_verify import request

from effectguard.ledger import Ledger, Writer, operations
from effectguard.ops.cli import main

_ = (pg_url,)  # fixtures

pytestmark = NEEDS_PG


async def _unknown_call(url: str) -> str:
    """One call left ``effect_unknown`` (its attempt interrupted)."""
    async with Ledger.open(url) as ledger:
        writer = await ledger.store.write(
            Writer("boot", 0),
            lambda tx: operations.register_worker(tx, worker="w1", host="h", pid=1, lease_s=30),
        )
        call = await ledger.admit(writer, request("lost-connect"))
        await ledger.interrupt(writer, call.call_id, 1, "read timeout")
    return call.call_id


def _cut_at(relay: Relay, marker: str, nth: int) -> threading.Thread:
    """Hold the ``nth`` connection's statement holding ``marker`` (the ones before it go
    on), then close every connection."""

    def watch() -> None:
        for seen in range(1, nth + 1):
            deadline = time.monotonic() + 30
            while relay.stalls < seen and time.monotonic() < deadline:
                time.sleep(0.01)
            if seen < nth:
                relay.stall(marker)
                relay.release()
        relay.cut_idle()

    relay.stall(marker)
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _exits_unavailable(
    url: str, relay: Relay, capsys: pytest.CaptureFixture[str], argv: Callable[[str], list[str]]
) -> None:
    capsys.readouterr()
    code = main(argv(via(url, relay.port)))
    err = capsys.readouterr().err
    assert code == 4, err
    assert "ledger unavailable" in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    ("marker", "nth"),
    [
        # The command's first connection: it checks the ledger's schema (synchronous).
        ("set_config", 1),
        # The reader's connection (asynchronous): the second to set lock_timeout, after
        # the writer's.
        ("'lock_timeout'", 2),
    ],
)
def test_a_connection_closed_during_its_setup_is_ledger_unavailable(
    pg_url: str, capsys: pytest.CaptureFixture[str], marker: str, nth: int
) -> None:
    """``reconcile`` whose connection the server closes under its session settings exits
    4 "ledger unavailable" (nothing decided), and decides the call once run again."""
    call = asyncio.run(_unknown_call(pg_url))
    relay = Relay(server_port())
    try:

        def argv(ledger: str) -> list[str]:
            return ["reconcile", call, "--applied", "--note", "seen", "--ledger", ledger]

        watcher = _cut_at(relay, marker, nth)
        _exits_unavailable(pg_url, relay, capsys, argv)
        watcher.join(timeout=30)
        assert main(argv(via(pg_url, relay.port))) == 0
    finally:
        relay.close()
