"""The ledger store interface.

A store has two halves:

* **writes** run as *operations*: plain synchronous functions of a :class:`Tx`
  (one transaction's view of the tables). The store runs many concurrent
  operations in one database transaction (group commit), each inside its own
  savepoint, and resolves each caller only after the commit is durable. The
  rules inside operations (``effectguard.ledger.operations``) are shared by
  every store; a store supplies only the table access.
* **reads** are async queries (:class:`LedgerStore`), answered from committed
  data without queueing behind writes.

Every write is attributed to a :class:`Writer` (worker id + fencing
generation); the store refuses writes of a fenced writer before running them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol, TypeVar

from effectguard.rules.bodyref import SpooledBody
from effectguard.rules.budget import BudgetNode, BudgetPolicy, Key
from effectguard.rules.budgetview import Policyless
from effectguard.rules.events import StoredEvent
from effectguard.rules.keys import LedgerKey
from effectguard.rules.ratelimit import RateWindow
from effectguard.rules.workstate import Stage, WorkState

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Writer:
    """Who writes: a worker id and the fencing generation it was given."""

    worker: str
    generation: int


@dataclass(frozen=True, slots=True)
class CallSpend:
    """What the spend chart needs of one call: when it was admitted, its provider and
    model, its cost (settled, or decided by a reconciliation; nano-dollars, None before
    any) and what it still holds. A store reads it without folding the call's events."""

    created_at: float
    provider: str
    model: str | None
    cost: int | None
    held: int

    @classmethod
    def of(cls, state: WorkState) -> CallSpend:
        """The spend of a call's state."""
        return cls(state.created_at, state.provider, state.model, state.cost, state.held)


#: A day as the ledger groups money by it: whole UTC days since 1970-01-01.
DAY_S = 86400


@dataclass(frozen=True, slots=True)
class DaySpend:
    """The money of one provider and model on one UTC day (``day``: days since the
    epoch): what its calls spent and still hold, and how many of them carry any money."""

    day: int
    provider: str
    model: str | None
    spent: int
    held: int
    calls: int


@dataclass(frozen=True, slots=True)
class SpendSums:
    """The spend of a window of calls summed by day, provider and model, with how many
    calls the window read (those without money too) and when the oldest was created."""

    days: tuple[DaySpend, ...] = ()
    calls: int = 0
    oldest: float | None = None


def sum_spend(spends: Iterable[CallSpend]) -> SpendSums:
    """The sums a store answers for a window of calls (the rule its SQL follows)."""
    groups: dict[tuple[int, str, str | None], tuple[int, int, int]] = {}
    count, oldest = 0, None
    for one in spends:
        count += 1
        oldest = one.created_at if oldest is None else min(oldest, one.created_at)
        key = (int(one.created_at // DAY_S), one.provider, one.model)
        spent, held, calls = groups.get(key, (0, 0, 0))
        money = 1 if (one.cost or one.held) else 0
        groups[key] = (spent + (one.cost or 0), held + one.held, calls + money)
    days = tuple(DaySpend(*key, *sums) for key, sums in sorted(groups.items(), key=_by_day))
    return SpendSums(days, count, oldest)


def _by_day(item: tuple[tuple[int, str, str | None], Any]) -> tuple[int, str, str]:
    (day, provider, model), _ = item
    return day, provider, model or ""


#: Writer identity for operator tools (CLI reconcile, budget set): never fenced.
OPERATOR = Writer("operator", 0)


@dataclass(frozen=True, slots=True)
class WorkerRow:
    """A registered worker and its lease (times from the ledger's clock)."""

    worker: str
    generation: int
    host: str
    pid: int
    lease_expires: float
    fenced: bool = False


class Tx(Protocol):
    """One transaction's access to the ledger tables (synchronous)."""

    def now(self) -> float:
        """The ledger's clock (seconds since the epoch)."""
        ...

    def head(self) -> tuple[int, str]:
        """The last event's sequence number and digest (0 and genesis if none)."""
        ...

    def insert_event(self, event: StoredEvent, data_json: str) -> None:
        """Append one sealed event."""
        ...

    def events_of(self, call_id: str) -> list[StoredEvent]:
        """A call's events in order."""
        ...

    def get_call(self, call_id: str) -> WorkState | None:
        """A call's projected state."""
        ...

    def put_call(self, state: WorkState) -> None:
        """Store a call's projected state (insert or replace)."""
        ...

    def find_keyed(self, root: str, key: str) -> WorkState | None:
        """The admitted (not refused) call holding ``key`` under budget ``root``."""
        ...

    def find_archived(self, root: str, key: str) -> tuple[str, str] | None:
        """``(call_id, request_hash)`` of the archived call that held ``key`` under ``root``."""
        ...

    def find_unresolved(self, root: str, request_hash: str, since: float) -> WorkState | None:
        """The newest in-flight or effect-unknown call with this hash created since ``since``."""
        ...

    def find_decided(
        self, root: str, request_hash: str, since: float, applied: bool, limit: int
    ) -> list[WorkState]:
        """The newest ``limit`` calls with this hash created since ``since`` that a
        decision (evidence or a person) recorded applied: ``reconciled_applied``
        (``applied`` False: ``reconciled_not_applied``), newest first, in one read
        (calls created at the same moment in the store's order, the same every time)."""
        ...

    def in_flight_of(self, workers: Sequence[str]) -> list[WorkState]:
        """Calls in flight whose current attempt one of ``workers`` started, in one read."""
        ...

    def get_policies(self, paths: Sequence[str]) -> dict[str, BudgetPolicy]:
        """The declared policies among ``paths`` (a path without one has none)."""
        ...

    def put_policy(self, policy: BudgetPolicy) -> None:
        """Store one node's policy (insert or replace)."""
        ...

    def get_nodes(self, keys: Sequence[Key]) -> dict[Key, BudgetNode]:
        """The existing per-period counters among ``keys`` (``limit`` left None)."""
        ...

    def put_node(self, node: BudgetNode) -> None:
        """Store one node's counters for its period (insert or replace; ``limit`` ignored)."""
        ...

    def get_key(self, name: str) -> LedgerKey | None:
        """A proxy key's row, by name."""
        ...

    def put_key(self, row: LedgerKey) -> None:
        """Store a proxy key's row (insert or replace)."""
        ...

    def get_windows(self, paths: Sequence[str]) -> dict[str, RateWindow]:
        """The rate windows kept among ``paths``."""
        ...

    def put_window(self, window: RateWindow) -> None:
        """Store one node's rate window (insert or replace)."""
        ...

    def count_in_flight(self, path: str) -> int:
        """How many calls under ``path`` (it or a descendant) are in flight."""
        ...

    def flying_under(self, path: str) -> list[WorkState]:
        """The calls under ``path`` (it or a descendant) in flight, in one read (a
        declaration's: never on a request's path)."""
        ...

    def get_worker(self, worker: str) -> WorkerRow | None:
        """A worker's row."""
        ...

    def put_worker(self, row: WorkerRow) -> None:
        """Store a worker's row (insert or replace)."""
        ...

    def live_workers(self) -> list[WorkerRow]:
        """Workers not yet fenced."""
        ...

    def next_generation(self) -> int:
        """Take the next fencing generation (strictly increasing, never reused)."""
        ...

    def put_body(self, call_id: str, body: SpooledBody) -> None:
        """Store a by-reference request body (rules/bodyref) for ``call_id``: read from
        its file in chunks, never whole, in this transaction."""
        ...

    def put_ended_session(self, token_sha256: str, expires_at: float, purge_before: float) -> None:
        """Record an operator-page session as ended (ledger/endedsessions: outside the
        hash chain) and delete the ended sessions that expired before ``purge_before``."""
        ...


Operation = Callable[[Tx], T]
#: Told the result of an operation whose caller was cancelled while it committed.
Orphaned = Callable[[Any], None]

_BULKY = "effectguard_bulky"


def bulky(op: Operation[T]) -> Operation[T]:
    """Mark ``op`` as one that copies bulk data (a spooled upload's chunks): a committer
    that runs batches on the event loop runs a batch holding it on a thread instead, so
    storing a 10 MiB upload (about 30 ms on SQLite) never stalls other requests."""
    setattr(op, _BULKY, True)
    return op


def is_bulky(op: Operation[Any]) -> bool:
    """Whether ``op`` was marked with :func:`bulky`."""
    return getattr(op, _BULKY, False) is True


def probe(tx: Tx) -> None:
    """An operation that writes nothing: proves a transaction can begin and commit.

    Committers do not count a probe as a real commit: a health check built on one
    would pass on a full disk, where an empty transaction still commits.
    """


class LedgerStore(Protocol):
    """A ledger engine: group-committed write operations and async reads."""

    url: str

    async def open(self) -> None:
        """Open connections, run migrations, check durability settings."""
        ...

    async def close(self) -> None:
        """Finish queued writes and close."""
        ...

    async def write(self, writer: Writer, op: Operation[T], orphaned: Orphaned | None = None) -> T:
        """Run ``op`` in a durable transaction as ``writer``; fenced writers are refused.
        If the caller is cancelled meanwhile and ``op`` commits, ``orphaned`` gets its
        result (a cancelled caller never stops a commit)."""
        ...

    async def renew_lease(self, writer: Writer, lease_s: float) -> float:
        """Renew ``writer``'s lease for ``lease_s`` from now (ledger clock); the new expiry.
        :class:`~effectguard.errors.FencedError` if the store refuses the registration."""
        ...

    async def clock_now(self) -> float:
        """The ledger's clock now: what admission would read (PostgreSQL: the database's)."""
        ...

    async def get_call(self, call_id: str) -> WorkState | None:
        """A call's projected state, or None."""
        ...

    async def call_events(self, call_id: str) -> list[StoredEvent]:
        """A call's events in ledger order."""
        ...

    async def list_calls(
        self,
        stage: Stage | None = None,
        budget: str | None = None,
        limit: int = 1000,
        *,
        provider: str | None = None,
        since: float | None = None,
        oldest_first: bool = False,
    ) -> list[WorkState]:
        """Calls (newest first; ``oldest_first``: oldest first), optionally by stage,
        budget subtree, provider and creation time (at or after ``since``)."""
        ...

    async def unknown_after(self, after: tuple[float, str] | None, limit: int) -> list[WorkState]:
        """Up to ``limit`` ``effect_unknown`` calls ordered by creation time, then call id
        (in the store's order of ids), those after ``after`` (a call's ``(created_at,
        call_id)``; None: from the oldest). A sweep pages through the unknown calls with
        it, never reading more than a page however many there are."""
        ...

    async def in_flight_except(self, workers: Sequence[str], limit: int) -> list[WorkState]:
        """Up to ``limit`` calls in flight whose current attempt none of ``workers``
        started, in one read: the operator page's look for calls whose owner is gone,
        given the workers it judged alive (a fenced worker's call not yet marked, or one
        whose worker has no row, is found too). PostgreSQL walks the calls in flight in
        its index ``calls_stage(stage, worker)``; SQLite has no index of workers, and walks
        its partial index of unresolved calls once (a cost that grows with the calls
        effect unknown)."""
        ...

    async def call_spend(self, since: float, limit: int) -> list[CallSpend]:
        """The spend of up to ``limit`` calls created at or after ``since``, newest first
        (the calls, in the order, that ``list_calls(limit=limit, since=since)`` lists)."""
        ...

    async def spend_sums(self, since: float, limit: int) -> SpendSums:
        """:func:`sum_spend` of ``call_spend(since, limit)``, summed by the database:
        the spend page reads a few hundred sums, not tens of thousands of calls."""
        ...

    async def kept_states(self, after: str | None, limit: int) -> list[WorkState]:
        """Up to ``limit`` of the call states the store keeps in its calls' rows, of the
        calls after ``after`` in the store's own order of call ids (None: from the first),
        in that order: ``verify`` pages through them (SQLite keeps a call's state only
        while it is unresolved and folds it from the events on read after that; the
        other stores keep every call's)."""
        ...

    async def lookup_problems(self) -> list[tuple[int, str]]:
        """``(seq, problem)`` where the store's own way of finding a call's events
        disagrees with the events (SQLite: its per-call links); for ``verify``."""
        ...

    async def budget_nodes(
        self,
        depth: int | None = None,
        periods: Collection[str] | None = None,
        under: str | None = None,
        *,
        policied: bool = False,
    ) -> list[BudgetNode]:
        """Every stored ``(path, period)`` counter row (``limit`` left None), ordered by
        path and period. Given a ``depth``, only those of paths with fewer than ``depth``
        ``/`` (1: the roots), so a reader of the top of the tree reads no per-user node.
        Given ``periods``, a path that has a policy keeps only its rows of those labels
        (a view of today reads no past day); a path with no policy keeps every row. Given
        ``under``, only that path's rows and its descendants'. ``policied``: only the
        rows of paths that have a policy."""
        ...

    async def policyless(self, depth: int, limit: int) -> Policyless:
        """Of the paths with fewer than ``depth`` ``/`` that have no policy (policies are
        never removed, so each has one row, period ``total``): the first ``limit`` by money
        committed (most first, then by path), and all of them counted and summed (the
        sum's path is empty)."""
        ...

    async def policyless_page(
        self, depth: int, under: str | None, limit: int
    ) -> tuple[list[BudgetNode], int]:
        """Of the paths with fewer than ``depth`` ``/`` that have no policy (at ``under`` or
        below it, if given), the first ``limit`` in the tree's order (segment by segment:
        a parent before its children, ``a/b`` before ``a-c``), and how many there are."""
        ...

    async def budget_rows(self, paths: Collection[str]) -> list[BudgetNode]:
        """Every stored counter row of these paths (``limit`` left None), in no order."""
        ...

    async def budget_policies(self) -> list[BudgetPolicy]:
        """Every declared budget policy."""
        ...

    async def events_after(self, seq: int, limit: int) -> list[StoredEvent]:
        """Up to ``limit`` events with sequence number greater than ``seq``."""
        ...

    async def workers(self) -> list[WorkerRow]:
        """Every registered worker."""
        ...

    async def live_workers(self) -> list[WorkerRow]:
        """The workers not fenced: what a sweep reads (the table keeps every worker ever
        registered, one per process start, so reading it whole grows without end)."""
        ...

    async def keys(self) -> list[LedgerKey]:
        """Every proxy key row (revoked and expired ones too), by name."""
        ...

    async def key_events_since(self, seq: int) -> list[StoredEvent]:
        """The ``key.created`` and ``key.revoked`` events after ``seq``, in ledger order:
        what a replica's copy of the key rows lacks (read through an index of those
        events only, so it costs what changed, not every key ever made)."""
        ...

    async def key_events_high(self) -> int:
        """The seq of the last key event (0: none)."""
        ...

    async def archived_through(self) -> int:
        """The last event an archive moved out of the live ledger (0: none)."""
        ...

    async def limit_events(self) -> list[StoredEvent]:
        """Every ``budget.limit_set`` event, in ledger order (who set which limit)."""
        ...

    async def checkpoint_events(self) -> list[StoredEvent]:
        """Every ``ledger.archived`` event (an archive's checkpoint), in ledger order, read
        without decoding the other events."""
        ...

    async def rate_windows(self) -> list[RateWindow]:
        """Every stored rate window (one per node that has counted a minute)."""
        ...

    async def stage_counts(self) -> list[tuple[str, str, int, int, float]]:
        """``(provider, stage, count, held, oldest)`` for unresolved stages, for metrics
        and the operator page (``oldest``: the earliest ``created_at`` of them)."""
        ...

    async def session_ended(self, token_sha256: str) -> bool:
        """Whether the operator-page session whose token has this SHA-256 was ended by a
        logout (ledger/endedsessions), read from committed data."""
        ...

    async def writable(self) -> bool:
        """Whether a write transaction can commit now."""
        ...

    async def call_columns(self, after: str | None, limit: int) -> list[tuple[Any, ...]]:
        """The columns ``verify`` compares with a call's events, of up to ``limit`` calls
        after ``after`` (as :meth:`kept_states` pages): the indexed ones
        (``rows.INDEX_COLUMNS``, the call id first), then its spend (``rows.SPEND_COLUMNS``)."""
        ...

    async def copy_body(self, call_id: str, out: BinaryIO) -> int:
        """Write ``call_id``'s by-reference request body (rules/bodyref) to ``out``, one
        chunk at a time; the number of bytes written (0 if none is stored).
        Raises ``BodyMismatch`` if a chunk is missing (chunk numbers not 0, 1, 2, …)."""
        ...

    async def body_size(self, call_id: str) -> int | None:
        """The bytes of ``call_id``'s stored body (None: none is stored), read without
        reading the body."""
        ...

    async def body_chunks(self) -> list[tuple[str, int, int]]:
        """``(call_id, seq, bytes)`` of every stored body chunk, by call and seq (for
        ``verify``: which bodies are stored, whole or not; the bytes are not read)."""
        ...

    def snapshot(self) -> AbstractAsyncContextManager[None]:
        """Reads inside this block see one consistent state of the ledger."""
        ...
