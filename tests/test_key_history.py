"""A ledger with many key names: a replica's key refresh does not grow with them.

The ledger keeps a row for every key name ever made (a name is never reused, so a
revoked key stays refused), and a fleet that makes a key per job leaves hundreds of
thousands. Each replica refreshes its copy every ``key_refresh_s``; reading every row
each time cost, at 100,000 names, 16 % of a core of every idle replica (default 2 s) and
stalled its requests half a second at each read. A refresh now reads only the key
events written since its last (through an index of them), and folds them into its copy:
an idle replica reads nothing, a key made or revoked costs what changed, and it is
honoured as before.

The old keys are written straight into the file, revoked (making 100,000 with the CLI
would take the test minutes).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_key_replicas import cli, new_key, post, wait_for
from test_worker_history import _cpu_s, migrated

from effectguard.config.settings import hash_key
from effectguard.ledger import Ledger
from effectguard.rules.events import KeyCreated
from effectguard.testing import FakeProvider, Proxy, fake_provider, running_proxy

pytestmark = pytest.mark.slow

OLD_KEYS = 100_000
#: Refreshes often, so a refresh's cost shows within a few seconds.
CONFIG = "[server]\nkey_refresh_s = 0.2\n"
#: How long the idle replica is watched, and the share of one core it may use meanwhile:
#: reading 100,000 rows five times a second kept it busy all the time; now, under 2 %.
IDLE_S = 4.0
MAX_IDLE_CPU = 0.3


def _old_keys(ledger: Path, count: int) -> None:
    """Write ``count`` revoked keys of jobs long done into ``ledger``."""
    conn = migrated(ledger)
    with conn:
        conn.executemany(
            "INSERT INTO keys (name, sha256, budget_root, created_at, revoked_at) "
            "VALUES (?, ?, 'jobs', 1.0e9, 1.0e9 + 60)",
            ((f"job-{n}", f"{n:064x}") for n in range(count)),
        )
    conn.close()


@contextlib.contextmanager
def replica(tmp_path: Path, ledger: Path) -> Iterator[tuple[FakeProvider, Proxy]]:
    """A fake provider and one ``serve`` on ``ledger`` refreshing its keys every 0.2 s."""
    config = tmp_path / "serve.toml"
    config.write_text(CONFIG)
    with (
        fake_provider(tmp_path / "receipts.jsonl") as provider,
        running_proxy(
            ledger, upstreams={"openai": provider.url}, args=["--config", str(config)]
        ) as proxy,
    ):
        yield provider, proxy


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_key_refresh_costs_one_read_until_a_key_changes(tmp_path: Path) -> None:
    """With 100,000 old key names an idle replica stays idle, and a key made, then
    revoked, on the CLI is honoured, then refused, within the refresh."""
    ledger = tmp_path / "ledger.db"
    _old_keys(ledger, OLD_KEYS)
    with replica(tmp_path, ledger) as (provider, proxy):
        before = _cpu_s(proxy.process.pid)
        time.sleep(IDLE_S)
        share = (_cpu_s(proxy.process.pid) - before) / IDLE_S
        assert share < MAX_IDLE_CPU, f"an idle replica used {share:.0%} of a core"

        key = new_key(str(ledger), "--root", "team", "--name", "fresh")
        wait_for(lambda: post(proxy, key).status_code == 200, "the new key to be honoured")
        assert cli(str(ledger), "key", "revoke", "fresh").returncode == 0
        wait_for(lambda: post(proxy, key).status_code == 401, "the revoked key to be refused")
    assert len(provider.effects()) >= 1


async def _make_keys(ledger: Path, count: int, every_s: float) -> list[str]:
    """Make ``count`` keys in ``ledger``, one every ``every_s`` seconds; returns them."""
    made = []
    async with Ledger.open(str(ledger)) as book:
        for n in range(count):
            secret = f"eg-churn-{n}"
            await book.create_key(
                KeyCreated(name=f"churn-{n}", sha256=hash_key(secret), budget_root="team")
            )
            made.append(secret)
            await asyncio.sleep(every_s)
    return made


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_keys_made_one_after_another_cost_what_changed(tmp_path: Path) -> None:
    """With 100,000 old key names, a key made every refresh or so: each refresh folds the
    few key events written since its last instead of reading every row again (which kept
    the replica busy the whole time: 0.3-0.6 s of CPU at each change), and every key made
    is honoured."""
    ledger = tmp_path / "ledger.db"
    _old_keys(ledger, OLD_KEYS)
    with replica(tmp_path, ledger) as (provider, proxy):
        before, started = _cpu_s(proxy.process.pid), time.monotonic()
        made = asyncio.run(_make_keys(ledger, count=16, every_s=0.25))
        share = (_cpu_s(proxy.process.pid) - before) / (time.monotonic() - started)
        assert share < MAX_IDLE_CPU, f"a replica used {share:.0%} of a core as keys were made"
        for key in (made[0], made[-1]):
            wait_for(lambda k=key: post(proxy, k).status_code == 200, "a new key honoured")
    assert len(provider.effects()) >= 2


def test_a_key_event_an_archive_moved_out_unread_is_still_honoured(tmp_path: Path) -> None:
    """A key made, then revoked, each archived (its event moved out of the live ledger)
    while the replica was paused, so before any refresh read it: the replica sees the
    archive's mark move and reads the rows again. It then requires a key, honours this
    one, and later refuses it."""
    ledger = tmp_path / "ledger.db"
    with replica(tmp_path, ledger) as (provider, proxy):

        @contextlib.contextmanager
        def paused_then_archived() -> Iterator[None]:
            """The replica stopped while the body runs, then everything archived."""
            os.kill(proxy.process.pid, signal.SIGSTOP)
            try:
                yield
                archived = cli(str(ledger), "archive", "--before", "2999-01-01", "--json")
                assert archived.returncode == 0, archived.stderr
                assert json.loads(archived.stdout)["last_seq"] > 0, archived.stdout
            finally:
                os.kill(proxy.process.pid, signal.SIGCONT)

        assert post(proxy, "none yet").status_code == 200  # a call to archive with the key
        with paused_then_archived():
            secret = new_key(str(ledger), "--root", "team", "--name", "archived")
        # The first key closes the proxy to requests without one: known only from its event,
        # it would stay open.
        wait_for(lambda: post(proxy, "eg-not-a-key").status_code == 401, "keys required")
        assert post(proxy, secret).status_code == 200
        with paused_then_archived():
            assert cli(str(ledger), "key", "revoke", "archived").returncode == 0
        wait_for(lambda: post(proxy, secret).status_code == 401, "the archived key refused")
    assert len(provider.effects()) == 2  # the call before the key, and the key's one


def test_ledger_keys_are_honoured_while_an_archive_cuts_in_small_steps(tmp_path: Path) -> None:
    """An archive in many small steps, each moving the archive's mark, while a replica with
    100,000 key names serves a ledger key: every refresh reads every row again (about half
    a second), during which a step commits. Those reads were thrown away and retried, then
    given up ("archive steps kept moving events out"), and 5.2 s later the replica answered
    its ledger keys 503 for as long as the archive ran. A read begun before a step already
    holds every key event written before it began: the key is honoured throughout."""
    from effectguard_bench.recoverybench import build_ledger

    ledger = tmp_path / "ledger.db"
    build_ledger(ledger, 10_000, in_flight=0)  # about 60,000 events to archive
    _old_keys(ledger, OLD_KEYS)
    secret = new_key(str(ledger), "--root", "team", "--name", "live")
    with replica(tmp_path, ledger) as (provider, proxy):
        assert post(proxy, secret).status_code == 200
        started = time.monotonic()
        archive = subprocess.Popen(
            [
                *(sys.executable, "-m", "effectguard", "archive", "--ledger", str(ledger)),
                *("--before", "2999-01-01", "--step-events", "20", "--out", str(tmp_path / "a.gz")),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        statuses: list[int] = []
        while archive.poll() is None:
            statuses.append(post(proxy, secret).status_code)
            time.sleep(0.05)
        took = time.monotonic() - started
        assert archive.returncode == 0, archive.stderr.read() if archive.stderr else ""
    # The refusals began key_refresh_s + 5 s after the last good read: a shorter archive
    # proves nothing.
    assert took > 6.5, f"the archive took {took:.1f} s, too short to show the refusals"
    assert set(statuses) == {200}, sorted(set(statuses))
    assert len(provider.effects()) == len(statuses) + 1
