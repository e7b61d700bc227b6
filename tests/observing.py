"""Observing a running effectguard from a test: poll until something holds, and read
the CLI's JSON in this process (its own entry point, so no subprocess start-up)."""

from __future__ import annotations

import contextlib
import io
import json
import time
from collections.abc import Callable
from typing import Any

from effectguard.ops.cli import main as cli_main


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``predicate`` until it is truthy; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def cli_json(*args: str) -> Any:
    """Run an ``effectguard`` command with ``--json`` in this process; assert exit 0."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli_main([*args, "--json"])
    assert code == 0, out.getvalue()
    return json.loads(out.getvalue())
