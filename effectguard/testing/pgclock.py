"""A PostgreSQL ledger's clock, moved for a test: the database stays the only clock.

A PostgreSQL ledger reads time only through its SQL function ``effectguard_now()``:
the database's ``clock_timestamp()`` plus the one row of table ``clock_offset``
(0 seconds unless set here). A test that needs a period boundary seconds away
moves the ledger's clock with :func:`set_ledger_clock`; every replica on that
ledger reads the moved clock at its next transaction, and no replica's host clock
decides anything::

    set_ledger_clock(url, next_midnight - 2.5)   # the boundary is 2.5 s away
    ...
    set_ledger_clock(url, None)                   # back to the database's own clock

This module is the only code that writes the offset. A replica that opens a ledger
whose offset is not 0 logs a warning: outside a test it must be 0.
"""

from __future__ import annotations

from effectguard.ledger.pgschema import CLOCK_FUNCTION, Target, migrate

__all__ = ["ledger_clock", "set_ledger_clock", "step_ledger_clock"]


def ledger_clock(url: str) -> float:
    """What the ledger at ``url`` reads as now (seconds since the epoch)."""
    with Target.parse(url).connect() as conn:
        row = conn.execute(f"SELECT {CLOCK_FUNCTION}()").fetchone()
    assert row is not None
    return float(row[0])


def set_ledger_clock(url: str, at: float | None) -> float:
    """Move the ledger's clock so that it reads ``at`` now (``None``: the database's own).

    Creates the ledger's tables if they are missing. Returns the offset now in force.
    """
    migrate(url)
    with Target.parse(url).connect() as conn:
        # One statement: the offset is taken against the same clock_timestamp() reading.
        row = conn.execute(
            "UPDATE clock_offset SET seconds = "
            "coalesce(%s - extract(epoch FROM clock_timestamp())::float8, 0) RETURNING seconds",
            (at,),
        ).fetchone()
    assert row is not None
    return float(row[0])


def step_ledger_clock(url: str, seconds: float) -> float:
    """Step the ledger's clock by ``seconds`` (back when negative), as NTP steps a
    database host's clock; returns the offset now in force."""
    with Target.parse(url).connect() as conn:
        row = conn.execute(
            # Rounded to the microsecond: steps that add up to none leave exactly 0.
            "UPDATE clock_offset SET seconds = round((seconds + %s)::numeric, 6)::float8 "
            "RETURNING seconds",
            (seconds,),
        ).fetchone()
    assert row is not None
    return float(row[0])
