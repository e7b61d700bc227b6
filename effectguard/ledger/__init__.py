"""The ledger: a store (memory, SQLite, PostgreSQL) behind one async API.

``Ledger`` is the Python API operators and tests use (list, show, reconcile,
set limits, verify) and the guard writes through (admit, record, interrupt).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from datetime import date
from typing import Any, BinaryIO

from effectguard.errors import CallNotFound, ConfigError
from effectguard.ledger import attempts, decisions, endedsessions, evidence, keyops, operations
from effectguard.ledger.base import (
    OPERATOR,
    CallSpend,
    LedgerStore,
    Operation,
    SpendSums,
    Tx,
    Writer,
    bulky,
)
from effectguard.ledger.operations import Admitted
from effectguard.ledger.stopadmit import admit as admit_now
from effectguard.rules.admission import AdmitRequest
from effectguard.rules.bodytext import carries_bulk
from effectguard.rules.budget import BudgetNode, BudgetPolicy, is_under
from effectguard.rules.budgetview import (
    Policyless,
    budget_view,
    tree_order,
    view_periods,
    ways_to,
)
from effectguard.rules.events import AttemptLateAnswer, Event, KeyCreated, StoredEvent
from effectguard.rules.keys import LedgerKey
from effectguard.rules.workstate import Stage, WorkState

log = logging.getLogger("effectguard.ledger")

__all__ = [
    "OPERATOR",
    "AdmitRequest",
    "Admitted",
    "CallSpend",
    "Ledger",
    "LedgerStore",
    "SpendSums",
    "Writer",
    "open_store",
    "shown_ledger",
]


def open_store(url: str, *, clock: Callable[[], float] | None = None) -> LedgerStore:
    """A store for ``url``: ``memory://``, ``postgresql://…``, or a SQLite path.

    ``clock`` replaces the wall clock as the ledger's clock (leases, event times),
    so tests can let a lease lapse without waiting. PostgreSQL always uses the
    database's clock (one clock for every replica), so it refuses one.
    """
    # Event times are sealed into the digests as floats and read back as floats: a clock
    # answering ints (``ManualClock(start=1_800_000_000)``) sealed ``1800000000`` and
    # every event it timed then failed verify.
    tick = time.time if clock is None else _seconds(clock)
    if url.startswith("memory://"):
        from effectguard.ledger.memory import MemoryStore

        return MemoryStore(url, tick)
    if url.startswith(("postgresql://", "postgres://")):
        if clock is not None:
            raise ConfigError("a PostgreSQL ledger uses the database's clock; it takes no clock")
        from effectguard.ledger.postgres import PostgresStore

        store: LedgerStore = PostgresStore(url)
        return store
    from effectguard.ledger.sqlite import SqliteStore

    return SqliteStore(url, tick)


def shown_ledger(url: str) -> str:
    """The ledger as effectguard prints it (start line, commands it suggests, ``migrate``):
    a SQLite file's absolute path (given as a path or a ``sqlite:///`` URL), so a printed
    command works from any directory, or a URL without its password."""
    if url.startswith(("postgresql://", "postgres://")):
        from effectguard.rules.urltext import redacted

        return redacted(url)
    if url.startswith("sqlite:///"):  # sqlite:///rel.db is relative to the working directory
        return os.path.abspath(url.removeprefix("sqlite:///"))
    return url if "://" in url else os.path.abspath(url)


def _seconds(clock: Callable[[], float]) -> Callable[[], float]:
    """``clock`` answering floats, whatever number type it answers with."""
    return lambda: float(clock())


class Ledger:
    """The async API over one store."""

    def __init__(self, store: LedgerStore) -> None:
        self.store = store

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls, url: str, *, clock: Callable[[], float] | None = None
    ) -> AsyncIterator[Ledger]:
        """Open the ledger at ``url`` for the duration of the block (``clock``: see open_store)."""
        store = open_store(url, clock=clock)
        await store.open()
        try:
            yield cls(store)
        finally:
            await store.close()

    # -- the guard's writes
    async def admit(
        self,
        writer: Writer,
        request: AdmitRequest,
        orphaned: Callable[[Admitted], None] | None = None,
        stopped: Callable[[], str | None] = lambda: None,
    ) -> Admitted:
        """Admission (docs/contract.md §3.2) in one durable transaction. If the caller is
        cancelled meanwhile and it commits, ``orphaned`` is told what it decided; once
        ``stopped()`` says why nothing is sent, its attempt is not sent (ledger/stopadmit)."""
        op: Operation[Admitted] = lambda tx: admit_now(tx, writer, request, stopped)  # noqa: E731
        chosen = bulky(op) if request.spool is not None else op
        return await self.store.write(writer, chosen, orphaned)

    async def record(
        self, writer: Writer, call_id: str, attempt: int, events: Sequence[Event]
    ) -> WorkState:
        """Record an attempt's outcome (refused if the attempt is no longer in flight).

        A large answer's observation (a stream of many MiB) is bulky work, done off the
        event loop as an upload's chunks are: inline it stalled every other request."""
        op: Operation[WorkState] = lambda tx: attempts.record(  # noqa: E731
            tx, writer, call_id, attempt, events
        )
        return await self.store.write(writer, bulky(op) if carries_bulk(events) else op)

    async def interrupt(self, writer: Writer, call_id: str, attempt: int, reason: str) -> WorkState:
        """Mark ``attempt`` interrupted: effect unknown, reservation held."""
        return (await self.interrupt_once(writer, call_id, attempt, reason))[0]

    async def interrupt_once(
        self, writer: Writer, call_id: str, attempt: int, reason: str
    ) -> tuple[WorkState, bool]:
        """:meth:`interrupt`, and whether this call wrote the ``attempt.interrupted`` (false
        when the attempt was no longer in flight: another path marked or settled it)."""

        def op(tx: Tx) -> tuple[WorkState, bool]:
            state = tx.get_call(call_id)
            if state is None:
                raise CallNotFound(call_id)
            if state.stage != "in_flight" or state.attempts != attempt:
                return state, False
            return operations.interrupt(tx, writer, state, reason), True

        result: tuple[WorkState, bool] = await self.store.write(writer, op)
        return result

    async def record_late_answer(self, writer: Writer, event: AttemptLateAnswer) -> WorkState:
        """Keep a late answer as evidence, written as ``writer`` (one the store accepts);
        the call's stage and money are unchanged."""
        result: WorkState = await self.store.write(
            writer, lambda tx: evidence.record_late_answer(tx, writer, event)
        )
        return result

    # -- operator API
    async def reconcile(
        self,
        call_id: str,
        *,
        applied: bool,
        note: str,
        by: str,
        cost: int | None = None,
        writer: Writer = OPERATOR,
        result: bytes | None = None,
        attempt: int | None = None,
        automated: bool = False,
    ) -> WorkState:
        """Decide an effect-unknown or failed call: applied (with cost and, where evidence
        recovered it, the ``result`` later keyed resends replay) or not applied. Evidence
        gathered about ``attempt`` is refused once a later attempt has started, and an
        ``automated`` decision (a lookup's, the hook's) against a late answer kept (the
        attempt's; for "not applied", an applied one to any attempt) is refused too."""
        state: WorkState = await self.store.write(
            writer,
            lambda tx: decisions.reconcile(
                tx,
                writer,
                call_id,
                applied=applied,
                cost=cost,
                note=note,
                by=by,
                result=result,
                attempt=attempt,
                automated=automated,
            ),
        )
        # The note is the operator's free text: it stays in the ledger, out of the logs.
        log.info(
            "call %s reconciled as %s by %s",
            call_id,
            state.stage,
            by,
            extra={"event": "reconciled", "call_id": call_id, "stage": state.stage, "by": by},
        )
        return state

    async def accept_evidence(
        self,
        call_id: str,
        *,
        note: str | None,
        by: str,
        writer: Writer = OPERATOR,
        attempt: int | None = None,
    ) -> WorkState:
        """Reconcile an effect-unknown call as its late answer proves (applied at the cost
        it implies, or not applied); refused without one, and once a later attempt than
        ``attempt`` (the one a person examined) has started."""
        state: WorkState = await self.store.write(
            writer,
            lambda tx: evidence.accept_evidence(
                tx, writer, call_id, note=note, by=by, attempt=attempt
            ),
        )
        log.info(
            "call %s reconciled as %s by %s on its late answer",
            call_id,
            state.stage,
            by,
            extra={"event": "reconciled", "call_id": call_id, "stage": state.stage, "by": by},
        )
        return state

    async def authorize_resend(
        self,
        call_id: str,
        *,
        note: str,
        by: str,
        writer: Writer = OPERATOR,
        attempt: int | None = None,
    ) -> WorkState:
        """Authorize exactly one new attempt of an effect-unknown call (the duplicate risk
        accepted); its hold stays until that attempt settles. Refused once a later
        attempt than ``attempt`` (the one a person examined) has started."""
        state: WorkState = await self.store.write(
            writer,
            lambda tx: decisions.authorize_resend(
                tx, writer, call_id, note=note, by=by, attempt=attempt
            ),
        )
        log.info(
            "call %s: one resend authorized by %s",
            call_id,
            by,
            extra={"event": "resend_authorized", "call_id": call_id, "by": by},
        )
        return state

    async def set_limit(self, path: str, limit: int | None, writer: Writer = OPERATOR) -> None:
        """Set (``None``: clear) the limit of budget ``path`` in nano-dollars, keeping the
        rest of its policy."""
        await self.store.write(writer, lambda tx: operations.set_limit(tx, writer, path, limit))

    async def set_limit_if(
        self, path: str, limit: int | None, expected: BudgetPolicy | None, writer: Writer
    ) -> bool:
        """Set the limit of budget ``path`` only if its policy is still ``expected`` (None:
        none declared), in the write's transaction; whether it was set."""
        done: bool = await self.store.write(
            writer, lambda tx: operations.set_limit_if(tx, writer, path, limit, expected)
        )
        return done

    async def create_key(self, event: KeyCreated, writer: Writer = OPERATOR) -> LedgerKey:
        """Record a new proxy key (``event`` carries its SHA-256, never the key)."""
        return await self.store.write(writer, lambda tx: keyops.create_key(tx, writer, event))

    async def revoke_key(self, name: str, writer: Writer = OPERATOR) -> LedgerKey:
        """Revoke proxy key ``name``."""
        return await self.store.write(writer, lambda tx: keyops.revoke_key(tx, writer, name))

    async def keys(self) -> list[LedgerKey]:
        """Every proxy key in the ledger, revoked and expired ones included."""
        return await self.store.keys()

    async def key_events_since(self, seq: int) -> list[StoredEvent]:
        """The ``key.created`` / ``key.revoked`` events after ``seq``, in ledger order."""
        return await self.store.key_events_since(seq)

    async def key_events_high(self) -> int:
        """The seq of the last key event (0: none)."""
        return await self.store.key_events_high()

    async def archived_through(self) -> int:
        """The last event an archive moved out of the live ledger (0: none)."""
        return await self.store.archived_through()

    async def set_policy(self, policy: BudgetPolicy, writer: Writer = OPERATOR) -> None:
        """Declare budget ``policy.path``'s limit, period, timezone and rate limits."""
        await self.store.write(writer, lambda tx: operations.set_policy(tx, writer, policy))

    async def change_policy(
        self, path: str, changes: Mapping[str, Any], writer: Writer = OPERATOR
    ) -> BudgetPolicy:
        """Change only the named fields of budget ``path``'s policy (``limit``, ``period``,
        ``tz``, ``rpm``, ``tpm``, ``concurrency``), reading the rest in the same
        transaction, so a concurrent change to another field is kept. Returns the policy
        now declared."""
        policy: BudgetPolicy = await self.store.write(
            writer, lambda tx: operations.change_policy(tx, writer, path, changes)
        )
        return policy

    async def end_session(
        self, token_sha256: str, expires_at: float, writer: Writer = OPERATOR
    ) -> None:
        """Record the operator-page session whose token has SHA-256 ``token_sha256`` (hex;
        never the token) as ended until ``expires_at``, for every replica: outside the
        hash chain (ledger/endedsessions). Ended sessions long expired are deleted."""
        endedsessions.validate_digest(token_sha256)
        await self.store.write(
            writer, lambda tx: endedsessions.end_session(tx, token_sha256, expires_at)
        )

    async def session_ended(self, token_sha256: str) -> bool:
        """Whether the operator-page session with this token digest was ended by a logout."""
        return await self.store.session_ended(token_sha256)

    async def call(self, call_id: str) -> WorkState:
        """One call's state; raises :class:`CallNotFound`."""
        if "\x00" in call_id:
            # No call has one, and PostgreSQL's text refuses it: asked, the store would fail
            # (the operator page's crafted link: "the ledger is unavailable").
            raise CallNotFound(call_id)
        state = await self.store.get_call(call_id)
        if state is None:
            raise CallNotFound(call_id)
        return state

    async def events(self, call_id: str) -> list[StoredEvent]:
        """One call's events."""
        return await self.store.call_events(call_id)

    async def copy_body(self, call_id: str, out: BinaryIO) -> int:
        """Write a call's request body stored by reference (rules/bodyref) to ``out``, one
        chunk at a time; the bytes written (0 where none is stored)."""
        return await self.store.copy_body(call_id, out)

    async def body_size(self, call_id: str) -> int | None:
        """The size of a call's request body stored by reference (None: none is stored)."""
        return await self.store.body_size(call_id)

    async def calls(
        self,
        stage: Stage | None = None,
        budget: str | None = None,
        limit: int = 1000,
        *,
        provider: str | None = None,
        since: float | None = None,
        oldest_first: bool = False,
    ) -> list[WorkState]:
        """Calls, newest first (``oldest_first``: oldest first), optionally filtered by
        stage, budget subtree, provider and creation time (at or after ``since``, seconds
        since the epoch)."""
        return await self.store.list_calls(
            stage, budget, limit, provider=provider, since=since, oldest_first=oldest_first
        )

    async def in_flight_except(self, workers: Sequence[str], limit: int = 1000) -> list[WorkState]:
        """Up to ``limit`` calls in flight whose current attempt none of ``workers``
        started, in one read (``ReadStore.in_flight_except``)."""
        return await self.store.in_flight_except(workers, limit)

    async def stage_counts(self) -> list[tuple[str, str, int, int, float]]:
        """``(provider, stage, count, held, oldest)`` of the unresolved calls: aggregates
        the store answers without reading any call, however many there are."""
        return await self.store.stage_counts()

    async def unknown_after(
        self, after: tuple[float, str] | None, limit: int = 20
    ) -> list[WorkState]:
        """Up to ``limit`` ``effect_unknown`` calls, oldest first (ties in the store's
        order of call ids), after the call ``after`` names by ``(created_at, call_id)``
        (None: from the oldest): a page, however many calls are unknown."""
        return await self.store.unknown_after(after, limit)

    async def call_spend(self, since: float, limit: int = 1000) -> list[CallSpend]:
        """What the spend chart needs of each call created at or after ``since`` (seconds
        since the epoch), newest first, at most ``limit``: the calls ``calls(limit=limit,
        since=since)`` lists, read without folding their events."""
        return await self.store.call_spend(since, limit)

    async def spend_sums(self, since: float, limit: int = 1000) -> SpendSums:
        """The money of the calls ``call_spend(since, limit)`` reads, summed per UTC day,
        provider and model by the store (no call read into Python), with how many calls
        that window holds and when its oldest was created."""
        return await self.store.spend_sums(since, limit)

    async def policies(self) -> dict[str, BudgetPolicy]:
        """Every declared budget policy, by path."""
        return {p.path: p for p in await self.store.budget_policies()}

    async def budgets(
        self,
        *,
        at: float | None = None,
        period: str | None = None,
        on: date | None = None,
        depth: int | None = None,
        under: str | None = None,
        policied: bool = False,
    ) -> list[BudgetNode]:
        """Every budget node in one period, with its limit.

        By default each node is shown in its period containing now; ``at`` picks another
        instant, ``on`` a local date (in each node's timezone) and ``period`` a label (only
        nodes whose period has labels of that form). ``depth`` keeps the nodes of paths
        with fewer than ``depth`` ``/`` (1: the roots), ``under`` the node at that path and
        its descendants, each read as such from the store; ``policied`` only the nodes
        that have a policy.
        """
        declared = await self.policies()
        return await self._view(declared, depth, under, policied, at=at, period=period, on=on)

    async def _view(
        self,
        declared: Mapping[str, BudgetPolicy],
        depth: int | None,
        under: str | None,
        policied: bool,
        *,
        at: float | None = None,
        period: str | None = None,
        on: date | None = None,
    ) -> list[BudgetNode]:
        """:meth:`budgets` given the policies, read once by a caller that needs them too."""
        policies = {
            p: v
            for p, v in declared.items()
            if (depth is None or p.count("/") < depth) and (under is None or is_under(p, under))
        }
        # The period admission charges now, by the store's clock (on PostgreSQL the
        # database's, which every replica shares), not this host's.
        when = await self.store.clock_now() if at is None else at
        # Only the periods the view shows: a node with a daily period gains a row a day.
        wanted = view_periods(policies, when, period, on)
        counters = await self.store.budget_nodes(depth, wanted, under, policied=policied)
        return budget_view(policies, counters, when, period, on)

    async def budget_tree(
        self, under: str | None, depth: int, limit: int
    ) -> tuple[list[BudgetNode], int]:
        """The budget tree's nodes at ``under`` or below it (the whole tree without it) of
        paths with fewer than ``depth`` ``/``: the first ``limit`` in the tree's order, each
        in its current period, and how many there are. Nodes with a policy, and those on
        the way to one (:func:`~effectguard.rules.budgetview.ways_to`; empty where never
        charged), are read whole: operators declared them. Of the nodes clients made by
        naming budgets, ``limit`` are read, however many there are."""
        page, many = await self.store.policyless_page(depth, under, limit)
        declared = await self.policies()
        shown = await self._view(declared, depth, under, policied=True)
        seen = {n.path for n in shown}
        # A node given its first policy since the page was read is shown once.
        page = [n for n in page if n.path not in seen]
        seen |= {n.path for n in page}
        ways = ways_to(declared, under, depth) - seen
        stored = {n.path for n in await self.store.budget_rows(ways)}  # beyond the page
        empty = [BudgetNode(path) for path in ways - stored]
        nodes = sorted([*shown, *page, *empty], key=tree_order)[:limit]
        return nodes, len(shown) + many + len(empty)

    async def budget_ranking(self, depth: int, limit: int) -> tuple[list[BudgetNode], Policyless]:
        """The nodes of paths with fewer than ``depth`` ``/`` for a ranking of ``limit``
        (:func:`~effectguard.rules.budgetview.top_nodes`): those with a policy in their
        current period, and of those without one, the ``limit`` first, their count and
        sum. However many nodes clients made, it reads ``limit`` of them."""
        # Read first: a node given its first policy before the reads below is then
        # counted twice for one scrape (in ``_other``'s sum), never left out.
        policyless = await self.store.policyless(depth, limit)
        return await self.budgets(depth=depth, policied=True), policyless
