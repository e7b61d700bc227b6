"""A repeating condition (the ledger refusing each heartbeat) is said when it starts, at
most once a minute while it lasts, and once when it ends."""

from __future__ import annotations

from effectguard.callpath.repeating import SAY_EVERY_S, Repeating


def test_said_at_start_once_a_minute_and_at_its_end() -> None:
    busy = Repeating()
    turns = [t * 0.5 for t in range(300)]  # 150 s of heartbeats every 0.5 s, all refused
    said = [t for t in turns if busy.failed(t)]
    assert said == [0.0, SAY_EVERY_S, 2 * SAY_EVERY_S]
    assert busy.lasted(150.0) == 150.0
    assert busy.worked(150.0) == 150.0
    assert busy.worked(150.5) is None  # its end is said once
    assert busy.failed(151.0)  # a new spell is said at once
