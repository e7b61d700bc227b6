"""``effectguard calls`` stays light: it never imports the server, the fake provider,
the benchmarks, metrics, tenacity or httpx (checked with ``python -X importtime``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HEAVY = ("uvicorn", "aiohttp", "effectguard_bench", "prometheus_client", "tenacity", "httpx")


def imported_modules(stderr: str) -> set[str]:
    """The module names ``-X importtime`` reported on ``stderr``."""
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip())
    return names


def test_calls_imports_nothing_heavy(tmp_path: Path) -> None:
    """``effectguard calls --ledger X --json`` on a real ledger imports none of the heavy
    modules."""
    ledger = tmp_path / "ledger.db"
    migrate = [sys.executable, "-m", "effectguard", "migrate", "--ledger", str(ledger)]
    subprocess.run(migrate, check=True, capture_output=True, timeout=60)
    command = ["calls", "--ledger", str(ledger), "--json"]
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "effectguard", *command],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == []
    modules = imported_modules(done.stderr)
    assert "effectguard.ledger.sqlite" in modules  # the check sees the command's own imports
    heavy = sorted(m for m in modules if m.split(".")[0] in HEAVY)
    assert not heavy, heavy
