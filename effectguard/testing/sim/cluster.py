"""The real processes of one run: a fake provider and K ``effectguard serve`` replicas.

Each replica keeps its port across restarts, so a client's URL stays valid
while the process behind it is killed, stopped, crashed and started again.
Every action taken on a process is appended to :attr:`Cluster.actions` with
the moment it happened, because the OS decides exactly when: that record,
not the schedule, is what a failing run's bundle shows as "what was done".
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from effectguard.errors import LedgerError
from effectguard.rules.money import nanos_to_usd
from effectguard.testing import FakeProvider, Proxy, fake_provider, free_port, start_proxy
from effectguard.testing.payments import declaration
from effectguard.testing.sim import clocksteps
from effectguard.testing.sim.faketime import FakeClocks, fake_clocks
from effectguard.testing.sim.pgcluster import OwnedPostgres, owned_postgres
from effectguard.testing.sim.proxykeys import ClientKeys
from effectguard.testing.sim.schedule import (
    FRESHNESS_S,
    KEY_REFRESH_S,
    KEY_ROOTS,
    MAINTENANCE_ACTIONS,
    MAX_ANSWER_BYTES,
    SEARCH_LAG_S,
    Schedule,
    key_root,
)

__all__ = ["Cluster", "Replica", "ledger_url", "running_cluster"]

_CONFIG = """\
[server]
key_refresh_s = {key_refresh}
lease_s = {lease}
heartbeat_s = {heartbeat}
sweep_s = {sweep}
drain_timeout_s = 5

[guard]
max_answer_bytes = {max_answer}

[upstream]
connect_timeout_s = 2
read_timeout_s = 20

[budgets]
{budgets}
"""


#: ``--maintenance``: ``send_email``'s idempotency window, 24 h as bundled, cut to 3 s. An
#: archive keeps every call inside its window live, and everything after it: with the
#: bundled window, the first keyed email of a run would hold every archive's cut.
_SHORT_WINDOW = """\
extends = "send_email"

[idempotency]
header = "Idempotency-Key"
window_seconds = 3
"""

#: The key the fake provider's search asks for, and the replicas' sweepers send.
PAYMENTS_KEY = "sk-sim-payments"


def ledger_url(schedule: Schedule, workdir: Path, pg_dsn: str | None) -> str:
    """The run's ledger: a SQLite file in ``workdir``, or schema ``sim_<seed>_<pid>`` on
    PostgreSQL (the pid: two runs of one seed on one database, say two test suites, must
    never write into each other's ledger)."""
    if schedule.ledger == "sqlite":
        return str(workdir / "ledger" / "ledger.db")
    if not pg_dsn:
        raise RuntimeError("--ledger postgres needs EFFECTGUARD_TEST_PG_DSN")
    schema = f"sim_{schedule.seed}_{os.getpid()}"
    return f"{pg_dsn}{'&' if '?' in pg_dsn else '?'}schema={schema}"


def reset_postgres_schema(url: str) -> None:
    """Drop the run's schema, so a seed always starts from an empty ledger."""
    import psycopg

    base, _, schema = url.rpartition("schema=")
    with psycopg.connect(base.rstrip("?&"), autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


@dataclass
class Replica:
    """One ``effectguard serve`` slot: a fixed port and the process currently behind it."""

    index: int
    port: int
    proxy: Proxy | None = None
    stopped: bool = False
    armed: str | None = None

    @property
    def url(self) -> str:
        """The replica's base URL."""
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        """Whether a process is running (or stopped) behind the port."""
        return self.proxy is not None and self.proxy.process.poll() is None


@dataclass
class Cluster:
    """The fake provider and the replicas, with a log of every action taken on them."""

    schedule: Schedule
    workdir: Path
    ledger: str
    fake: FakeProvider
    env: dict[str, str]
    replicas: list[Replica] = field(default_factory=list)
    actions: list[dict[str, Any]] = field(default_factory=list)
    started_at: float = field(default_factory=time.monotonic)
    disk: Path | None = None
    #: The PostgreSQL cluster the run owns and may stop (``--ledger-faults`` on PostgreSQL).
    owned_pg: OwnedPostgres | None = None
    #: The proxy keys the clients hold (``--operator``: the schedule rotates keys).
    keys: ClientKeys | None = None
    #: Each call id a client was given (``Effectguard-Call-Id``) -> its scheduled call's id,
    #: once the client is done with it: how the operator finds a call's receipts.
    seen: dict[str, str] = field(default_factory=dict)
    #: ``--clock-steps``: the hosts' clocks the run steps (libfaketime).
    clocks: FakeClocks | None = None

    @property
    def maintenance(self) -> bool:
        """Whether the schedule runs maintenance commands (``--maintenance``)."""
        return any(f.kind in MAINTENANCE_ACTIONS for f in self.schedule.faults)

    def note(self, action: str, replica: int | None = None, **detail: Any) -> None:
        """Record that ``action`` happened now."""
        at = round(time.monotonic() - self.started_at, 3)
        self.actions.append({"at": at, "action": action, "replica": replica, **detail})

    @property
    def config(self) -> Path:
        """The ``serve --config`` file: short leases, the run's budget limits."""
        return self.workdir / "effectguard.toml"

    def write_config(self) -> None:
        """Write :attr:`config` from the schedule."""
        lease = self.schedule.lease_s
        budgets = "\n".join(
            f'"{path}" = "{nanos_to_usd(limit)}"'
            for path, limit in self.schedule.limits.items()
            if limit is not None
        )
        text = _CONFIG.format(
            lease=lease,
            heartbeat=lease / 4,
            sweep=lease / 2,
            budgets=budgets,
            max_answer=MAX_ANSWER_BYTES,
            key_refresh=KEY_REFRESH_S,
        )
        self.config.write_text(text)
        if self.maintenance:
            (self.workdir / "providers").mkdir(exist_ok=True)
            (self.workdir / "providers" / "send_email.toml").write_text(_SHORT_WINDOW)
        if self.schedule.lookups:
            (self.workdir / "providers").mkdir(exist_ok=True)
            # Priced low: its calls spend from the same small budgets as the model calls.
            payments = declaration(FRESHNESS_S, per_call="0.00001", unknown_500=True)
            (self.workdir / "providers" / "payments.toml").write_text(payments)

    def start(self, replica: Replica, crash_at: str | None = None) -> None:
        """Start a process behind ``replica`` (armed to crash at ``crash_at``)."""
        env = dict(self.env)
        if crash_at:
            env["EFFECTGUARD_CRASH_AT"] = crash_at
        if self.clocks is not None and self.schedule.ledger != "sqlite":
            env |= self.clocks.env(f"replica-{replica.index}")  # each on a host of its own
        names = ("openai", "anthropic", "send_email", "payments")
        upstreams = {name: self.fake.url for name in names[: 4 if self.schedule.lookups else 3]}
        args = ["--config", str(self.config)]
        if self.schedule.lookups or self.maintenance:
            args += ["--providers", str(self.workdir / "providers")]
            env["PAYMENTS_API_KEY"] = PAYMENTS_KEY
        log = self.workdir / "logs" / f"replica-{replica.index}.log"
        with log.open("a") as out:
            out.write(
                f"\n==== start at {time.monotonic() - self.started_at:.3f} crash_at={crash_at}\n"
            )
        replica.proxy = start_proxy(
            self.ledger,
            upstreams=upstreams,
            args=args,
            env=env,
            log_path=log,
            port=replica.port,
        )
        replica.stopped, replica.armed = False, crash_at
        self.note("start", replica.index, pid=replica.proxy.process.pid, crash_at=crash_at)

    def signal(self, replica: Replica, sig: signal.Signals) -> None:
        """Send ``sig`` to the replica's process, if it runs."""
        if replica.proxy is not None and replica.alive():
            replica.proxy.kill(sig)
            replica.stopped = sig == signal.SIGSTOP
            self.note(sig.name, replica.index, pid=replica.proxy.process.pid)

    def kill(self, replica: Replica) -> None:
        """SIGKILL and reap (a stopped process dies too)."""
        if replica.proxy is not None and replica.alive():
            self.signal(replica, signal.SIGKILL)
            replica.proxy.process.wait()
        replica.stopped = False

    def stop(self, replica: Replica) -> None:
        """Graceful stop: SIGCONT if stopped, then SIGTERM and wait (SIGKILL after 15 s)."""
        if replica.proxy is None or not replica.alive():
            return
        if replica.stopped:
            self.signal(replica, signal.SIGCONT)
        code = replica.proxy.stop()
        self.note("stopped", replica.index, code=code)

    def fill_disk(self) -> Path | None:
        """Fill the ledger's tmpfs to the last byte; returns the filler to remove later."""
        if self.disk is None:
            return None
        filler = self.disk / "filler"
        with contextlib.suppress(OSError), filler.open("wb") as out:
            while True:
                out.write(b"\0" * 65536)
                out.flush()
        self.note("disk_full")
        return filler

    def free_disk(self, filler: Path) -> None:
        """Remove the filler written by :meth:`fill_disk`."""
        filler.unlink(missing_ok=True)
        self.note("disk_freed")

    def remount(self, mode: str) -> bool:
        """Remount the ledger's tmpfs ``ro`` or ``rw``; noted as ``read_only``/``read_write``.

        Linux refuses a read-only remount (EBUSY) while any process holds a file on it
        open for writing, as every running replica does with the ledger: the caller
        kills the replicas first. A refusal is noted as ``remount_refused``.
        """
        if self.disk is None:
            return False
        done = subprocess.run(
            ["mount", "-o", f"remount,{mode}", str(self.disk)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            self.note("remount_refused", mode=mode, error=done.stderr.strip()[-300:])
            return False
        self.note("read_only" if mode == "ro" else "read_write")
        return True

    def budget_set(self, point: str) -> None:
        """``effectguard budget set`` as an operator would, for ``PATH=NANOS`` or
        ``PATH=none``; noted ``budget_set`` (or ``budget_set_failed``, e.g. on a full or
        read-only ledger, with the command's last words)."""
        path, _, nanos = point.partition("=")
        limit = ["--no-limit"] if nanos == "none" else ["--limit", nanos_to_usd(int(nanos))]
        self._operator("budget_set", ["budget", "set", path, *limit], path=path, limit=nanos)

    def rate_set(self, point: str) -> None:
        """``effectguard budget set PATH --rpm N --tpm N --concurrency N`` for ``PATH
        rpm=N tpm=N concurrency=N`` (``none`` removes one; ``-`` leaves it out); noted
        ``rate_set``."""
        path, *pairs = point.split()
        argv = ["budget", "set", path]
        for name, _, value in (pair.partition("=") for pair in pairs):
            if value != "-":
                argv += [f"--{name}", value]
        self._operator("rate_set", argv, path=path, limit=" ".join(pairs))

    def make_first_keys(self) -> None:
        """Make each root's first key (``ROOT.0``) before any replica starts, so every
        request of the run carries one (once a ledger key exists, every request needs
        one). The ledger is created first: no replica has made it yet."""
        self.keys = ClientKeys()
        self._operator("migrate", ["migrate"])
        for root in KEY_ROOTS:
            self.key_new(f"{root}.0")

    def key_new(self, name: str) -> None:
        """``effectguard key new --root ROOT --name NAME``; once it returns, the root's
        clients send the new key. Noted ``key_new`` with the times it ran (wall clock)."""
        argv = ["key", "new", "--root", key_root(name), "--name", name, "--json"]
        done = self._operator("key_new", argv, name=name)
        if done.returncode == 0 and self.keys is not None:
            self.keys.give(name, json.loads(done.stdout)["key"])

    def key_revoke(self, point: str) -> None:
        """``effectguard key revoke NAME`` on the key the root of ``point`` (``ROOT.N``)
        has its clients send: ``ROOT.N`` unless a ``key new`` failed (the ledger was
        down). The clients go on sending it until a new key is made. Noted ``key_revoke``
        with the times it ran (wall clock), or ``key_revoke_skipped``."""
        name = self.keys.to_revoke(key_root(point)) if self.keys is not None else None
        if name is None:
            self.note("key_revoke_skipped", name=point)
        else:
            self._operator("key_revoke", ["key", "revoke", name], name=name)

    def reconcile_auto(self) -> None:
        """``effectguard reconcile --auto`` with the ``payments`` declaration and the
        search key, as an operator would; noted ``reconcile_auto`` with its decisions."""
        providers = ["--providers", str(self.workdir / "providers")]
        upstream = ["--upstream", f"payments={self.fake.url}"]
        argv = ["reconcile", "--auto", "--json", *providers, *upstream]
        self._operator("reconcile_auto", argv, {"PAYMENTS_API_KEY": PAYMENTS_KEY})

    def _operator(
        self, action: str, argv: list[str], env: dict[str, str] | None = None, **detail: Any
    ) -> subprocess.CompletedProcess[str]:
        """Run ``effectguard ARGV --ledger LEDGER``; noted ``action`` (with the output's
        tail) or ``action_failed`` (with the error's), with ``began`` and ``returned``
        (``time.time()``: a revocation's delay counts from the command's return)."""
        detail["began"] = time.time()
        done = subprocess.run(
            [sys.executable, "-m", "effectguard", *argv, "--ledger", self.ledger],
            env=self.env | (env or {}),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        detail["returned"] = time.time()
        if done.returncode == 0:
            output = "" if action == "key_new" else done.stdout.strip()[-300:]  # the secret
            self.note(action, **detail, output=output)
        else:
            error = (done.stderr or done.stdout).strip()[-300:]
            self.note(f"{action}_failed", **detail, code=done.returncode, error=error)
        return done

    def step_clock(self, replica: int, point: str) -> None:
        """Step a clock as ``point`` (``TARGET SPEC``, :mod:`~effectguard.testing.sim.clocksteps`)
        says; noted ``clock_step`` with the step, the clock's offset since the run began, the
        real time before it (``began``) and by which every process reads it (``returned``),
        and whether it is the ledger's clock (``ledger``)."""
        target, spec = point.split()
        began = time.time()
        if target == "db":
            import psycopg  # PostgreSQL's driver, only when used

            from effectguard.testing import pgclock

            try:
                step = clocksteps.delta(spec, pgclock.ledger_clock(self.ledger))
                offset = pgclock.step_ledger_clock(self.ledger, step)
            except (psycopg.Error, LedgerError) as exc:  # stopped (--ledger-faults)
                self.note("clock_step_failed", target=target, error=str(exc)[-300:])
                return
            returned = time.time()
        elif self.clocks is not None:
            host = "host" if target == "host" else f"replica-{replica}"
            step = clocksteps.delta(spec, self.clocks.now(host))
            began, returned, offset = self.clocks.step(host, step)  # returned: seen by all
        else:
            return
        self.note(
            "clock_step",
            replica if target == "replica" else None,
            target=target,
            step=round(step, 6),
            offset=round(offset, 6),
            began=began,
            returned=returned,
            ledger=target != "replica",
        )

    def restore_clock(self) -> None:
        """Step the ledger's clock forward to the furthest it was ahead during the run, once
        every replica is stopped: a step back delays the takeover of a dead worker's lease
        by that much (docs/operations.md, "Clocks"), longer than the quiet period waits."""
        steps = [a for a in self.actions if a["action"] == "clock_step" and a["ledger"]]
        if steps:
            ahead = max(0.0, *(float(a["offset"]) for a in steps)) - float(steps[-1]["offset"])
            if ahead > 0:
                self.step_clock(0, f"{steps[-1]['target']} +{ahead:.6f}")

    def pg_stop(self, mode: str) -> None:
        """Stop the owned PostgreSQL cluster (``fast`` or ``immediate``)."""
        if self.owned_pg is not None:
            self.owned_pg.stop(mode)
            self.note("pg_stopped", mode=mode)

    def pg_start(self) -> None:
        """Start the owned PostgreSQL cluster again."""
        if self.owned_pg is not None:
            self.owned_pg.start()
            self.note("pg_started")


def _mount_tmpfs(path: Path, size: str) -> bool:
    """Mount a small tmpfs at ``path`` (needs root); False where the platform refuses."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    return done.returncode == 0


@contextlib.contextmanager
def running_cluster(
    schedule: Schedule,
    workdir: Path,
    *,
    pg_dsn: str | None,
    env: dict[str, str],
    disk: bool,
    ledger_faults: bool = False,
) -> Iterator[Cluster]:
    """Start the fake provider and every replica; stop everything on the way out.

    ``ledger_faults`` puts SQLite on the tmpfs (to remount it read-only) and
    PostgreSQL on a cluster of the run's own (to stop it) instead of ``pg_dsn``.
    """
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    ledger_dir = workdir / "ledger"
    tmpfs = (disk or ledger_faults) and schedule.ledger == "sqlite"
    mounted = tmpfs and _mount_tmpfs(ledger_dir, "48m")
    ledger_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        owned = None
        if ledger_faults and schedule.ledger == "postgres":
            owned = stack.enter_context(owned_postgres(schedule.seed))
            pg_dsn = owned.dsn
        url = ledger_url(schedule, workdir, pg_dsn)
        if schedule.ledger == "postgres":
            reset_postgres_schema(url)
        if mounted:
            stack.callback(_unmount, ledger_dir, workdir / "ledger-copy")
        stepped = any(f.kind == "clock_step" for f in schedule.faults)
        # Entered first, left last: the clocks' shared memory outlives every process.
        clocks = stack.enter_context(fake_clocks(workdir / "clocks")) if stepped else None
        cluster = stack.enter_context(_processes(schedule, workdir, url, env))
        cluster.disk = ledger_dir if mounted else None
        cluster.owned_pg = owned
        cluster.clocks = clocks
        if clocks is not None and schedule.ledger == "sqlite":
            cluster.env = cluster.env | clocks.env("host")  # every process writing the ledger
        if any(f.kind == "key_new" for f in schedule.faults):
            cluster.make_first_keys()
        for replica in cluster.replicas:
            cluster.start(replica)
        yield cluster


@contextlib.contextmanager
def _processes(
    schedule: Schedule, workdir: Path, url: str, env: dict[str, str]
) -> Iterator[Cluster]:
    """The fake provider and the replicas (started once the caller has set up the ledger)."""
    lookups = ["--search-lag", str(SEARCH_LAG_S), "--search-jitter", "0.3"]
    lookups += ["--lookup-key", PAYMENTS_KEY]
    extra = lookups if schedule.lookups else []
    with fake_provider(workdir / "receipts.jsonl", idempotent=True, extra_args=extra) as fake:
        cluster = Cluster(schedule, workdir, url, fake, env)
        cluster.write_config()
        cluster.replicas = [Replica(i, free_port()) for i in range(schedule.replicas)]
        try:
            yield cluster
        finally:
            for replica in cluster.replicas:
                with contextlib.suppress(Exception):
                    cluster.stop(replica)
                cluster.kill(replica)


def _unmount(ledger_dir: Path, keep: Path) -> None:
    """Keep a copy of the ledger files, then unmount the tmpfs and put the copy in place."""
    shutil.copytree(ledger_dir, keep, ignore=shutil.ignore_patterns("filler"), dirs_exist_ok=True)
    subprocess.run(["umount", "-l", str(ledger_dir)], capture_output=True, check=False)
    shutil.copytree(keep, ledger_dir, dirs_exist_ok=True)
    shutil.rmtree(keep, ignore_errors=True)
