"""One running guard: the ledger, this process's worker, and the guard on top.

Both ways in (the transports and the proxy) start and stop a :class:`Runtime`
the same way, so the order is right everywhere: open the ledger, register as a
worker, build the guard, sweep (deciding what evidence can decide), then serve;
on stop, let background settlements finish and the admissions whose callers were cut
off end, then stop the worker and close the ledger.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from effectguard.callpath.crash import NO_CRASH, CrashPoints
from effectguard.callpath.dispatches import MARKING_WAIT_S
from effectguard.callpath.exchange import Send
from effectguard.callpath.guard import Guard
from effectguard.callpath.hooks import ReconcileHook
from effectguard.callpath.recovery import WorkerRuntime, lock_dir_for, lock_required
from effectguard.callpath.resolve import Resolver
from effectguard.config import defaults
from effectguard.config.settings import GuardSettings
from effectguard.errors import LedgerError
from effectguard.ledger import Ledger, Writer, open_store
from effectguard.ledger.base import probe
from effectguard.providers import Provider
from effectguard.telemetry.observer import Observer

log = logging.getLogger("effectguard.callpath.runtime")


@dataclass
class RuntimeConfig:
    """What a runtime needs; built once at the edge."""

    ledger_url: str
    providers: Mapping[str, Provider]
    guard: GuardSettings = field(default_factory=GuardSettings)
    crash: CrashPoints = NO_CRASH
    observer: Observer | None = None
    lease_s: float = defaults.LEASE_S
    heartbeat_s: float = defaults.HEARTBEAT_S
    sweep_s: float = defaults.SWEEP_S
    #: Each provider's API key, for lookups that no request carries (the sweeper's).
    credentials: Mapping[str, str] = field(default_factory=dict)
    reconcile_hook: ReconcileHook | None = None
    #: How the sweeper's lookups go out (the way in's upstream leg); None: no lookups.
    send: Send | None = None


class Runtime:
    """Opens the ledger, becomes a worker, and builds the guard."""

    def __init__(self, config: RuntimeConfig, ledger: Ledger | None = None) -> None:
        self.config = config
        self._own_ledger = ledger is None
        self.ledger = ledger or Ledger(open_store(config.ledger_url))
        self.worker: WorkerRuntime | None = None
        self.guard: Guard | None = None
        self._deciding: asyncio.Task[None] | None = None

    async def start(self) -> Guard:
        """Open everything; returns the guard. If any step fails, what was opened is closed.

        A half-started runtime would keep threads (the store's reader and writer) that
        hold the process open after the failure is reported.
        """
        try:
            return await self._start()
        except BaseException:
            with contextlib.suppress(Exception):
                await self.stop(0)
            raise

    async def _start(self) -> Guard:
        c = self.config
        if self._own_ledger:
            await self.ledger.store.open()
        self.worker = WorkerRuntime(
            self.ledger,
            lock_dir=lock_dir_for(c.ledger_url),
            lock_required=lock_required(c.ledger_url),
            lease_s=c.lease_s,
            heartbeat_s=c.heartbeat_s,
            sweep_s=c.sweep_s,
        )
        writer = await self.worker.register()
        self.guard = Guard(
            self.ledger,
            c.providers,
            writer=writer,
            settings=c.guard,
            crash=c.crash,
            observer=c.observer,
            resolver=Resolver(
                self.ledger,
                c.providers,
                credentials=c.credentials,
                hook=c.reconcile_hook,
                hook_timeout_s=c.guard.reconcile_hook_timeout_s,
                send=c.send,
            ),
        )
        self.worker.after_sweep.append(self.guard.recorder.retry_orphans)
        self.worker.after_sweep.append(self._decide_unknown)
        self.worker.after_rejoin.append(self._rejoined)
        self.guard.recorder.evidence_writer = self.worker.writer_after_refusal
        # Only now the first sweep: with the hooks attached, it decides too (in its own
        # task), so unknown calls a dead process left are not kept waiting a sweep_s.
        await self.worker.run()
        return self.guard

    async def _decide_unknown(self) -> None:
        """Each sweep, decide the unknown calls whose evidence is old enough to tell.

        In a task of its own: a slow provider lookup never delays the sweep that marks
        dead workers' calls; a sweep that finds the previous round still running skips.
        """
        assert self.guard is not None
        if self._deciding is None or self._deciding.done():
            self._deciding = asyncio.create_task(self._decide_round(self.guard))

    @staticmethod
    async def _decide_round(guard: Guard) -> None:
        try:
            await guard.resolver.sweep()
        except Exception as exc:  # the next sweep tries again; the calls stay unknown
            log.warning("deciding unknown calls by lookup failed: %s", exc)

    def _rejoined(self, writer: Writer) -> None:
        """The worker was fenced and registered anew: admit new calls as the new writer."""
        assert self.guard is not None
        self.guard.writer = writer

    async def stop(
        self,
        drain_timeout: float = 30.0,
        cut_off: str | None = None,
        settle: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Finish background settlements (then :func:`settle_admissions`), stop the worker,
        close the ledger. ``cut_off``: why a call still under way at the end (a stream
        still being read, a dispatch still waiting for its answer) is interrupted (None:
        it is left be). ``settle``: awaited once nothing more is sent, before the ledger
        closes (the way in's calls not yet dispatched then end: recorded not sent, or
        refused)."""
        if self._deciding is not None:
            self._deciding.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._deciding
        if self.guard is not None:
            await self.guard.drain(drain_timeout, cut_off)
        if settle is not None:
            await settle()
        if self.guard is not None:
            await settle_admissions(self.guard)
        if self.worker is not None:
            await self.worker.stop()
        if self._own_ledger:
            await self.ledger.store.close()


async def settle_admissions(guard: Guard, timeout: float = MARKING_WAIT_S) -> None:
    """Wait (at most ``timeout``) for the admissions whose callers were cancelled while
    they committed (the proxy's drain cancels the requests still waiting at its end), and
    for the ``not_sent`` records their commits lead to (``Recorder.unsent``). Closed
    before them, the ledger would refuse those records: such a call would be left in
    flight, its reservation held, though nothing was sent."""
    if not guard.admissions_cut:
        return  # no such admission: nothing to wait for (a stop with the ledger down too)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    # A store commits writes in the order they came: once a write queued now has ended,
    # each of those admissions has committed (or failed) and told its caller's stand-in.
    with contextlib.suppress(LedgerError, TimeoutError):
        async with asyncio.timeout(timeout):
            await guard.ledger.store.write(guard.writer, probe)
    await guard.recorder.drain(max(0.0, deadline - loop.time()))
