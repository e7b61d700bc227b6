"""Prometheus metrics (docs/contract.md §10): counters in-process, ledger gauges at scrape time.

Two kinds of numbers, on one injected :class:`~prometheus_client.CollectorRegistry`:

* **What this process saw** — requests, tokens, cost, refusals, replays and
  latencies — are counters and histograms fed by :class:`MetricsObserver`, the
  :class:`~effectguard.telemetry.observer.Observer` the guard calls. They start at zero
  with the process, as Prometheus counters do.
* **What the ledger holds** — calls in flight, unknown effects and the money
  they hold, each budget root's reserved, spent, held and limit — are gauges
  read from the ledger by :meth:`Metrics.refresh` (aggregate queries only) and
  yielded by a custom collector. They are right after a restart and identical
  from every replica, so dashboards take ``max`` of them, never ``sum``.

The proxy serves them at ``GET /metrics``. In-process::

    registry = prometheus_client.CollectorRegistry()
    metrics = Metrics(registry=registry)
    transport = AsyncGuardTransport(ledger=ledger, observer=metrics.observer)
    metrics.attach(ledger)  # in the event loop that uses the ledger
    prometheus_client.start_http_server(9100, registry=registry)

No label carries a call id, a key or a user: providers and reasons are declared
names, models are capped per provider, and budget labels stop at
``budget_depth`` segments (roots only by default).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from effectguard.errors import EffectguardError
from effectguard.rules.budget import BudgetNode
from effectguard.rules.budgetview import Policyless, top_nodes
from effectguard.rules.money import nanos_to_decimal
from effectguard.telemetry import firstseries
from effectguard.telemetry.budgetgauges import budget_gauges, period_ends
from effectguard.telemetry.capped import MAX_LABEL_VALUES, Capped
from effectguard.telemetry.ledgerinfo import ledger_info
from effectguard.telemetry.observer import NullObserver
from effectguard.telemetry.roomclosings import RoomClosings
from effectguard.telemetry.sharedread import SharedRead

if TYPE_CHECKING:
    from effectguard.ledger import Ledger

__all__ = ["MAX_LABEL_VALUES", "LedgerSnapshot", "Metrics", "MetricsObserver"]

log = logging.getLogger("effectguard.telemetry.metrics")

#: Budget nodes exported one by one; the rest are summed into one ``other`` series
#: (without proxy keys any client can create budget roots, one new series each).
MAX_BUDGET_SERIES = 50
OTHER_BUDGETS = "_other"

UPSTREAM_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
OVERHEAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
COMMIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
REPLAY_OUTCOMES = frozenset({"replayed", "joined"})


def top_budgets(
    nodes: list[BudgetNode],
    limit: int = MAX_BUDGET_SERIES,
    policyless: Policyless | None = None,
) -> list[BudgetNode]:
    """The ``limit`` nodes with the most money committed, plus the rest summed as ``_other``
    (:func:`~effectguard.rules.budgetview.top_nodes`): ``nodes`` and, read apart, the
    nodes without a policy. ``_other`` can never be a budget path (paths start with a
    letter or digit)."""
    return top_nodes(nodes, limit, policyless, OTHER_BUDGETS)


def _usd(nanos: int) -> float:
    """Nano-dollars as float USD: only here, at the exposition edge."""
    return float(nanos_to_decimal(nanos))


class MetricsObserver(NullObserver):
    """The guard's :class:`~effectguard.telemetry.observer.Observer`, as Prometheus counters.

    Per-request reports (call ids) are no metric labels: those hooks stay no-ops.
    """

    def __init__(self, registry: CollectorRegistry, capped: Capped) -> None:
        self._cap = capped
        self._children: dict[tuple[Any, ...], Any] = {}
        self._at_zero: set[tuple[str, ...]] = set()  # providers and (provider, model)s
        self.requests = Counter(
            "effectguard_requests",
            "Requests finished, by outcome.",
            ["provider", "model", "outcome"],
            registry=registry,
        )
        self.tokens = Counter(
            "effectguard_tokens",
            "Tokens of settled calls (direction: input or output).",
            ["provider", "model", "direction"],
            registry=registry,
        )
        self.cost = Counter(
            "effectguard_cost_usd",
            "Settled cost in USD.",
            ["provider", "model"],
            registry=registry,
        )
        self.refusals = Counter(
            "effectguard_refusals",
            "Requests refused, by reason (the docs/contract.md §9 error type).",
            ["provider", "reason"],
            registry=registry,
        )
        self.replays = Counter(
            "effectguard_replays",
            "Requests answered from the ledger (replayed or joined).",
            ["provider"],
            registry=registry,
        )
        self.upstream = Histogram(
            "effectguard_upstream_duration_seconds",
            "Time waiting on the upstream per attempt sent, by how it ended "
            "(outcome: answered, timeout or error).",
            ["provider", "outcome"],
            buckets=UPSTREAM_BUCKETS,
            registry=registry,
        )
        self.overhead = Histogram(
            "effectguard_overhead_duration_seconds",
            "effectguard's own time per dispatched request (total minus upstream), "
            "whatever its outcome.",
            buckets=OVERHEAD_BUCKETS,
            registry=registry,
        )
        self.internal_errors = Counter(
            "effectguard_internal_errors",
            "Unexpected exceptions answered with a 500 internal_error.",
            registry=registry,
        )
        self._by_model = (self.requests, self.tokens, self.cost)

    def _child(self, metric: Any, *values: str) -> Any:
        # labels() validates and locks on every call; a request makes five of them.
        # Values are capped before they get here, so this cache is bounded too.
        key = (metric, *values)
        child = self._children.get(key)
        if child is None:  # a first count: its provider's and model's series at 0 first
            self._zero(values[0], values[1] if metric in self._by_model else None)
            child = self._children.setdefault(key, metric.labels(*values))
        return child

    def _zero(self, provider: str, model: str | None) -> None:
        """Make, once, the series :mod:`firstseries` names for ``provider`` (and ``model``)."""
        if provider in ("", "other"):  # no provider, or past the cap: nothing to watch
            return
        scopes = [(provider,)] + ([(provider, model)] if model is not None else [])
        for scope in (s for s in scopes if s not in self._at_zero):
            self._at_zero.add(scope)
            of = firstseries.of_provider if len(scope) == 1 else firstseries.of_model
            for family, values in of(*scope):
                metric = getattr(self, family)  # firstseries names these attributes
                self._children.setdefault((metric, *values), metric.labels(*values))

    def declare(self, provider: str, models: Iterable[str]) -> None:
        """Make the series of ``provider`` and of each of its ``models`` at 0 now: the
        first call of a declared model after a start then shows in every rate, as the
        first count of a series born at 1 cannot (:mod:`firstseries`)."""
        p = self._provider(provider)
        self._zero(p, None)
        for model in models:
            self._zero(p, self._model(p, model))

    def _provider(self, provider: str) -> str:
        return self._cap("provider", provider)

    def _model(self, provider: str, model: str) -> str:
        return self._cap("model:" + provider, model)

    def request_done(self, provider: str, model: str, outcome: str) -> None:
        """Count a finished request; replays also count as replays."""
        p = self._provider(provider)
        self._child(self.requests, p, self._model(p, model), self._cap("outcome", outcome)).inc()
        if outcome in REPLAY_OUTCOMES:
            self._child(self.replays, p).inc()

    def refused(self, provider: str, reason: str) -> None:
        """Count a refusal by its error type."""
        self._child(self.refusals, self._provider(provider), self._cap("reason", reason)).inc()

    def settled(
        self, provider: str, model: str, input_tokens: int, output_tokens: int, cost_nanos: int
    ) -> None:
        """Add a settled call's tokens and cost."""
        p = self._provider(provider)
        m = self._model(p, model)
        self._child(self.tokens, p, m, "input").inc(max(0, input_tokens))
        self._child(self.tokens, p, m, "output").inc(max(0, output_tokens))
        self._child(self.cost, p, m).inc(_usd(max(0, cost_nanos)))

    def upstream_seconds(self, provider: str, seconds: float, outcome: str) -> None:
        """Observe one attempt's upstream time, whatever its ``outcome`` (three values,
        named by the call path: not capped)."""
        self._child(self.upstream, self._provider(provider), outcome).observe(seconds)

    def overhead_seconds(self, seconds: float) -> None:
        """Observe the guard's own time for one request."""
        self.overhead.observe(seconds)

    def internal_error(self) -> None:
        """Count an unexpected exception answered with a 500."""
        self.internal_errors.inc()


@dataclasses.dataclass(frozen=True, slots=True)
class LedgerSnapshot:
    """What the ledger held at one refresh (money in nano-dollars)."""

    #: provider, stage, count, held, oldest created_at
    stages: tuple[tuple[str, str, int, int, float], ...] = ()
    budgets: tuple[BudgetNode, ...] = ()
    #: When each shown budget's current period ends (budgets with a calendar period).
    period_ends: tuple[tuple[str, float], ...] = ()
    oldest_unknown: tuple[tuple[str, float], ...] = ()  # provider, created_at
    ok: bool = True
    seconds: float = 0.0


class _LedgerCollector:
    """Yields the gauges of the latest :class:`LedgerSnapshot`."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[Metric]:
        # Names only, so registering does not read the ledger.
        return list(_gauges(LedgerSnapshot(), []))

    def collect(self) -> Iterator[Metric]:
        self._metrics._refresh_from_other_thread()
        m = self._metrics
        yield from _gauges(m.snapshot, m._cap.values("provider"))
        if m._info is not None:
            yield m._info


def _gauges(snap: LedgerSnapshot, providers: list[str]) -> Iterator[Metric]:
    def gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, doc, labels=labels)

    in_flight = gauge("effectguard_calls_in_flight", "Calls in flight (ledger).", ["provider"])
    unknown = gauge(
        "effectguard_effect_unknown_calls", "Calls whose effect is unknown (ledger).", ["provider"]
    )
    unknown_held = gauge(
        "effectguard_effect_unknown_held_usd",
        "USD held by effect-unknown calls until they are reconciled (ledger).",
        ["provider"],
    )
    oldest = gauge(
        "effectguard_effect_unknown_oldest_timestamp_seconds",
        "When the oldest effect-unknown call was admitted (Unix time; ledger).",
        ["provider"],
    )
    counts: dict[tuple[str, str], tuple[int, int]] = {
        (p, stage): (n, held) for p, stage, n, held, _ in snap.stages
    }
    # Providers this process knows of show 0, so a reconciled call's series drops to 0.
    known = {p for p in providers if p not in ("", "other")} if snap.ok else set()
    names = sorted({p for p, _ in counts} | known)
    for p in names:
        in_flight.add_metric([p], counts.get((p, "in_flight"), (0, 0))[0])
        n, held = counts.get((p, "effect_unknown"), (0, 0))
        unknown.add_metric([p], n)
        unknown_held.add_metric([p], _usd(held))
    for p, created_at in snap.oldest_unknown:
        oldest.add_metric([p], created_at)
    yield from (in_flight, unknown, unknown_held, oldest)

    yield from budget_gauges(snap.budgets, snap.period_ends)

    up = gauge("effectguard_ledger_up", "1 if the last ledger read for metrics succeeded.", [])
    up.add_metric([], 1 if snap.ok else 0)
    took = gauge(
        "effectguard_ledger_read_duration_seconds",
        "Time the last ledger read for metrics took.",
        [],
    )
    took.add_metric([], snap.seconds)
    yield from (up, took)


class Metrics:
    """effectguard's metrics on one registry: the observer, the ledger gauges, exposition."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        budget_depth: int = 1,
        max_budget_series: int = MAX_BUDGET_SERIES,
        refresh_timeout_s: float = 5.0,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.budget_depth = budget_depth
        self.max_budget_series = max_budget_series
        self.refresh_timeout_s = refresh_timeout_s
        self._cap = Capped()
        self.observer = MetricsObserver(self.registry, self._cap)
        self.commit_duration = Histogram(
            "effectguard_ledger_commit_duration_seconds",
            "Time of one ledger group commit.",
            buckets=COMMIT_BUCKETS,
            registry=self.registry,
        )
        self.commit_batch = Histogram(
            "effectguard_ledger_commit_batch_size",
            "Write operations in one group commit.",
            buckets=BATCH_BUCKETS,
            registry=self.registry,
        )
        self.commits = Counter(
            "effectguard_ledger_commits",
            "Ledger group commits, by result (ok or failed).",
            ["result"],
            registry=self.registry,
        )
        # Both children made now, once: labels() costs more than the increment, and
        # at one client every request commits twice.
        self._commits = {True: self.commits.labels("ok"), False: self.commits.labels("failed")}
        #: Called by the proxy's front door with each closing for room.
        self.closed_for_room = RoomClosings(self.registry)
        self.snapshot = LedgerSnapshot()
        self._ledger: Ledger | None = None
        self._info: Metric | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._hooked: object = None
        self._collector: _LedgerCollector | None = None
        self._fresh = False
        self._pending: asyncio.Task[None] | None = None
        self._shared = SharedRead(self._read)

    def declare(self, providers: Iterable[tuple[str, Iterable[str]]]) -> None:
        """Show each (provider, its model names)'s counters at 0 from the first scrape
        (:meth:`MetricsObserver.declare`); call before the first request."""
        for provider, models in providers:
            self.observer.declare(provider, models)

    def attach(self, ledger: Ledger, url: str | None = None) -> None:
        """Read gauges from ``ledger`` and time its commits (call in the ledger's loop);
        with its ``url``, name it in ``effectguard_ledger_info`` (:mod:`ledgerinfo`)."""
        self._ledger = ledger
        self._info = None if url is None else ledger_info(url)
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._hook_commits()
        if self._collector is None:
            self._collector = _LedgerCollector(self)
            self.registry.register(self._collector)
        self._refresh_soon()

    async def refresh(self) -> None:
        """Read the ledger's gauges into :attr:`snapshot` (aggregate queries only).

        Concurrent calls share one read, one that begins after each of them was called
        (:class:`~effectguard.telemetry.sharedread.SharedRead`): the gauges are never
        older than the call, and many scrapers cost the ledger one read at a time. A
        read not done within ``refresh_timeout_s`` (a locked table, a silent database)
        goes on alone and this call reports the ledger unreadable, so the scrape still
        answers within Prometheus' scrape timeout, with ``effectguard_ledger_up`` 0.
        """
        try:
            await asyncio.wait_for(self._shared(), self.refresh_timeout_s)
        except TimeoutError:
            log.warning("metrics: ledger read took over %.1f s", self.refresh_timeout_s)
            self.snapshot = LedgerSnapshot(ok=False, seconds=self.refresh_timeout_s)
            self._fresh = True

    async def _read(self) -> None:
        ledger = self._ledger
        if ledger is None:
            return
        self._hook_commits()
        started = time.perf_counter()
        try:
            # Aggregates only: a scrape reads no call, however many are unknown.
            stages = await ledger.stage_counts()
            # Only the labelled depth is read: per-user nodes (100,000 of them took a
            # scrape 1.3 s of the event loop) are never shown, so never loaded. Of the
            # nodes without a policy (any client can make one a header: 100,000 roots
            # took 0.76 s of the loop) the store ranks and sums; only the first are read.
            nodes, policyless = await ledger.budget_ranking(
                self.budget_depth, self.max_budget_series
            )
            policies = await ledger.policies()
        except EffectguardError as exc:
            log.warning("metrics could not read the ledger: %s", exc)
            self.snapshot = LedgerSnapshot(ok=False, seconds=time.perf_counter() - started)
            self._fresh = True
            return
        oldest = {p: at for p, stage, _, _, at in stages if stage == "effect_unknown"}
        for provider, *_ in stages:
            self._cap("provider", provider)
        self.snapshot = LedgerSnapshot(
            stages=tuple(stages),
            budgets=tuple(top_budgets(nodes, self.max_budget_series, policyless)),
            period_ends=tuple(period_ends(nodes, policies)),
            oldest_unknown=tuple(sorted(oldest.items())),
            seconds=time.perf_counter() - started,
        )
        self._fresh = True

    def render(self) -> tuple[bytes, str]:
        """The exposition body and its content type.

        Await :meth:`refresh` first for gauges as of this scrape; without it they are
        those of the previous scrape (a refresh is started for next time).
        """
        if not self._fresh:
            self._refresh_soon()
        self._fresh = False
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    # -- internals --------------------------------------------------------------
    def _hook_commits(self) -> None:
        """Observe the store's group committer (again, if the store was reopened)."""
        if self._ledger is None:
            return
        try:
            committer = getattr(self._ledger.store, "committer", None)
        except EffectguardError:  # not open yet: hooked on a later refresh
            return
        if committer is None or committer is self._hooked:
            return
        committer.stats.observers.append(self._on_commit)
        self._hooked = committer

    def _on_commit(self, batch_size: int, seconds: float, ok: bool) -> None:
        """Called on the writer thread after every commit (prometheus_client is thread-safe)."""
        try:
            self.commit_duration.observe(seconds)
            self.commit_batch.observe(batch_size)
            self._commits[ok].inc()
        except Exception:  # a metrics fault must never stop the ledger's writer thread
            log.exception("metrics could not record a ledger commit")

    def _refresh_soon(self) -> None:
        """Start a background refresh if we are in the ledger's loop and none is pending."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if loop is not self._loop or (self._pending is not None and not self._pending.done()):
            return
        self._pending = loop.create_task(self.refresh())

    def _refresh_from_other_thread(self) -> None:
        """When scraped off the ledger's loop (``start_http_server``), refresh on that loop."""
        loop = self._loop
        if loop is None or loop.is_closed() or not loop.is_running():
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            return  # on a loop: the caller awaits refresh() (or render() started one)
        future = asyncio.run_coroutine_threadsafe(self.refresh(), loop)
        try:  # refresh() gives up at refresh_timeout_s; the margin is for a busy loop
            future.result(self.refresh_timeout_s + 1.0)
        except concurrent.futures.TimeoutError:
            future.cancel()
            log.warning("metrics: ledger read took over %.1f s", self.refresh_timeout_s)
