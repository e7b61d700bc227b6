"""A ledger many processes have used: the sweeper's cost does not grow with them.

Every ``effectguard serve`` start and every process with a transport registers a worker,
and the ledger keeps each row for good (fenced once it is gone: the rows are part of
what ``verify`` folds). A fleet that runs short-lived agent processes leaves hundreds of
thousands. Each replica sweeps every ``sweep_s``; a sweep that read the table whole
spent, with 200,000 old rows, a sixth of a core of every idle replica and held its
requests up 1.6 s at a time. A sweep needs the live workers only.

The old rows are written straight into the file (registering 200,000 workers one by one
would take the test minutes); they are what the ledger holds after that many processes
came and went: fenced, on another host, long expired.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from effectguard.ledger.writerformat import FUNCTION, WRITER_FORMAT
from effectguard.testing import fake_provider, start_proxy

pytestmark = pytest.mark.slow

CHAT = "/openai/v1/chat/completions"
BODY = {"model": "gpt-4o-mini", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
#: Old, fenced workers in the ledger: about two days of an agent fleet starting a
#: process a second.
OLD_WORKERS = 200_000
#: Sweeps often, so a sweep's cost shows within a few seconds.
CONFIG = "[server]\nlease_s = 2\nheartbeat_s = 0.5\nsweep_s = 0.2\n"
#: How long the idle replica is watched, and the share of one core it may use meanwhile:
#: reading 200,000 rows twice a sweep kept it at about 80 % of a core; live rows only, 1 %.
IDLE_S = 4.0
MAX_IDLE_CPU = 0.3


def migrated(ledger: Path) -> sqlite3.Connection:
    """A new SQLite ledger, migrated by the CLI, opened to write rows straight in."""
    subprocess.run(
        [sys.executable, "-m", "effectguard", "migrate", "--ledger", str(ledger)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    conn = sqlite3.connect(ledger)
    conn.create_function(FUNCTION, 0, lambda: WRITER_FORMAT)  # the triggers ask for it
    return conn


def _old_workers(ledger: Path, count: int) -> None:
    """Write ``count`` fenced workers of processes long gone into ``ledger``."""
    conn = migrated(ledger)
    with conn:
        conn.executemany(
            "INSERT INTO workers (worker, generation, host, pid, lease_expires, fenced) "
            "VALUES (?, ?, 'gone', ?, 1.0e9, 1)",
            ((f"gone-{n}-0000000{n % 10}", n + 1, n + 1) for n in range(count)),
        )
        conn.execute("UPDATE meta SET value = ? WHERE key = 'generation'", (count + 1,))
    conn.close()


def _cpu_s(pid: int) -> float:
    """CPU seconds (user and system) the process ``pid`` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_sweep_costs_the_live_workers_not_every_worker_ever(tmp_path: Path) -> None:
    """With 200,000 old workers in the ledger an idle replica stays idle, and a replica
    killed mid-call is still taken over by the other."""
    ledger = tmp_path / "ledger.db"
    _old_workers(ledger, OLD_WORKERS)
    config = tmp_path / "serve.toml"
    config.write_text(CONFIG)
    with fake_provider(tmp_path / "receipts.jsonl", delay=30.0) as provider:
        replicas = [
            start_proxy(
                ledger,
                upstreams={"openai": provider.url},
                args=["--config", str(config)],
                log_path=tmp_path / f"replica-{n}.log",
            )
            for n in range(2)
        ]
        victim, survivor = replicas
        try:
            before = _cpu_s(survivor.process.pid)
            time.sleep(IDLE_S)
            share = (_cpu_s(survivor.process.pid) - before) / IDLE_S
            assert share < MAX_IDLE_CPU, f"an idle replica used {share:.0%} of a core"

            # A call in flight on the victim when it dies: the survivor's sweep finds it.
            call = threading.Thread(target=_post_until_cut, args=(victim.url,), daemon=True)
            call.start()
            deadline = time.monotonic() + 10
            while not provider.effects():
                assert time.monotonic() < deadline, "the call never reached the provider"
                time.sleep(0.05)
            victim.kill(signal.SIGKILL)
            call.join(10)
            deadline = time.monotonic() + 20
            while _stages(ledger) != ["effect_unknown"]:
                assert time.monotonic() < deadline, f"not taken over: {_stages(ledger)}"
                time.sleep(0.2)
        finally:
            for proxy in replicas:
                proxy.stop()
        assert len(provider.effects()) == 1


def _post_until_cut(url: str) -> None:
    """A chat completion through the replica at ``url``, which is killed while it waits."""
    with contextlib.suppress(httpx.TransportError):
        httpx.post(url + CHAT, json=BODY, headers={"authorization": "Bearer x"}, timeout=60)


def _stages(ledger: Path) -> list[str]:
    """The stages of the ledger's calls, through ``effectguard calls --json``."""
    done = subprocess.run(
        [sys.executable, "-m", "effectguard", "calls", "--ledger", str(ledger), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return [call["stage"] for call in json.loads(done.stdout)]
