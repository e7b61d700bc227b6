"""A child process for the ledger-creation tests: one user of a ledger, on cue.

Usage::

    python ledger_user.py

Started once (its imports take far longer than the work), it then reads one job a line
from stdin, ``INSTANT ACTION PATH``, does it at ``INSTANT`` (``time.monotonic``, the same
clock in every process), and prints one JSON line,
``{"action", "code", "said", "out"}``: ``code`` 0 for a success, else the exit status
the command gave (or 1 for an exception), ``said`` what it printed on stderr or the
exception, ``out`` what it printed on stdout. Its parent gives the same instant to
several children, so they meet on the path as programs started at one moment do.

Actions: ``open`` starts an ``AsyncGuardTransport`` on the ledger (its ``guard()``) and
closes it; any other word is an ``effectguard`` command run with ``--ledger PATH``
(``migrate``, ``calls``, ``verify``).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import sys
import time

from effectguard import AsyncGuardTransport
from effectguard.ops.cli import main as cli_main


async def open_transport(path: str, instant: float) -> None:
    """Start a guarded transport on ``path`` (which opens, or creates, its ledger) at
    ``instant``: made before, since making one reads every provider's declaration."""
    transport = AsyncGuardTransport(ledger=path)
    wait_until(instant)
    try:
        await transport.guard()
    finally:
        await transport.aclose()


def wait_until(instant: float) -> None:
    """Wait until ``instant`` (``time.monotonic``, one clock for every process): sleep,
    then spin the last two milliseconds, so that children given one instant act in
    the same millisecond."""
    time.sleep(max(0.0, instant - time.monotonic() - 0.002))
    while time.monotonic() < instant:
        pass


def run(action: str, path: str, instant: float) -> tuple[int, str, str]:
    """Do one job at ``instant``: its exit code, what it said on stderr and on stdout."""
    if action == "open":
        try:
            asyncio.run(open_transport(path, instant))
        except Exception as exc:
            return 1, f"{type(exc).__name__}: {exc}", ""
        return 0, "", ""
    err, out = io.StringIO(), io.StringIO()
    wait_until(instant)
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = cli_main([action, "--ledger", path])
    return code, err.getvalue().strip(), out.getvalue().strip()


if __name__ == "__main__":
    for line in sys.stdin:
        instant, action, path = line.rstrip("\n").split(" ", 2)
        code, said, out = run(action, path, float(instant))
        print(json.dumps({"action": action, "code": code, "said": said, "out": out}), flush=True)
