"""The SQL text the SQLite and PostgreSQL stores share, written once.

A :class:`Queries` holds every statement in one dialect: the two differ only in
their placeholder (``?`` or ``%s``), how ``false`` is spelled and how a JSON
field of the stored state is read. What else differs (binding a list of budget
paths, sending rows one statement per row or many) stays in the store.

The pieces they are built from (stage lists, upserts, the body store's statements) are
in :mod:`effectguard.ledger.sqlparts`.
"""

from __future__ import annotations

from typing import Any

from effectguard.ledger import sqlitecalls, sqliteevents
from effectguard.ledger.rows import (
    CALL_COLUMNS,
    EVENT_COLUMNS,
    INDEX_COLUMNS,
    KEY_COLUMNS,
    MUTABLE_CALL_COLUMNS,
    NODE_COLUMNS,
    POLICY_COLUMNS,
    SLIM_FIELDS,
    SPEND_COLUMNS,
    STATE_FIELDS,
    WINDOW_COLUMNS,
    WORKER_COLUMNS,
    limit_param,
    names,
)
from effectguard.ledger.sqlparts import (
    IN_FLIGHT_SQL,
    KEY_KINDS_SQLITE,
    KEY_KINDS_TEXT,
    UNRESOLVED_SQL,
    BodyQueries,
    upsert,
)
from effectguard.rules.workstate import UNRESOLVED

# A lookup by stage names UNRESOLVED_SQL too: SQLite then reads the small partial index
# of unresolved calls (calls_unresolved) instead of every call.
_IN_FLIGHT = f"{UNRESOLVED_SQL} AND {IN_FLIGHT_SQL}"
#: How many ``/`` a budget path has (0: a root).
_DEPTH = "length(path) - length(replace(path, '/', ''))"


def _newest_by_hash(state: str, m: str, stage: str, many: bool = False) -> str:
    """The newest call of a budget root with a request hash, created since a time, whose
    ``stage`` (an SQL term) a retry matches (ledger/retries); with ``many``, the newest
    ones, as many as a last parameter (find_decided's ``limit``), in one read."""
    return (
        f"SELECT {state} FROM calls WHERE budget_root = {m} AND request_hash = {m} "
        f"AND {stage} AND created_at >= {m} ORDER BY created_at DESC LIMIT " + (m if many else "1")
    )


class Queries:
    """Every statement both stores send, in one dialect.

    ``mark`` is the placeholder, ``false`` the literal a boolean column compares
    with, and ``held`` the expression reading a call's held amount from its JSON.
    ``stage_counts`` gives each unresolved stage's oldest call too (``min(created_at)``),
    so metrics and the operator page read no call to count them.
    ``newest_first`` orders :meth:`list_calls` (SQLite: by call id, which starts with
    the time in ms, so the table's own key serves it and no index is written);
    ``state`` is what a read of a call state selects (SQLite: ``sqlitecalls.CALL_READ``)
    and ``index`` what a read of every call's indexed columns selects; ``spend`` reads a
    call's rows.SPEND_COLUMNS from ``spend_from``, for the spend chart and verify, with no
    state decoded (PostgreSQL: from its state's JSON, decoded once a row by a lateral
    ``json_to_record``); ``day`` is a call's UTC day as whole days since the epoch (the
    dialect's floor of ``created_at / 86400``). Parameters that name a call, a request
    hash or a worker are the store's own forms of them (SQLite: bytes and ids, ledger/sqlitecalls);
    ``workers_named`` turns a list of workers' names (``{}``: their placeholders) into a
    list of that form in SQL (default: the names themselves).
    """

    def __init__(
        self,
        *,
        mark: str,
        false: str,
        held: str,
        event_columns: str = EVENT_COLUMNS,
        event_insert: str = EVENT_COLUMNS,
        newest_first: str = "created_at DESC",
        state: str = "state",
        index: str = INDEX_COLUMNS,
        spend: str = SPEND_COLUMNS,
        spend_from: str = "calls",
        day: str = "CAST(created_at / 86400 AS INTEGER)",
        binary: str = "",
        key_kinds: str = KEY_KINDS_TEXT,
        workers_named: str = "({})",
    ) -> None:
        m = self.mark = mark
        self.newest_first, self.state, self.body = newest_first, state, BodyQueries.for_mark(m)
        ev = event_columns  # read ``SELECT {ev} FROM events e`` (the store's row layout)
        # -- point reads (the writer's and the readers')
        self.call = f"SELECT {state} FROM calls WHERE call_id = {m}"
        self.keyed_call = (
            f"SELECT {state} FROM calls WHERE budget_root = {m} AND idempotency_key = {m}"
        )
        self.unresolved_call = _newest_by_hash(state, m, UNRESOLVED_SQL)
        #: These read the partial indexes calls_decided (SQLite migration 16, PostgreSQL 9)
        #: and calls_not_applied (SQLite 21, PostgreSQL 14): each predicate must name its
        #: stage as its index does.
        applied, not_applied = "stage = 'reconciled_applied'", "stage = 'reconciled_not_applied'"
        self.decided_calls = _newest_by_hash(state, m, applied, many=True)
        self.not_applied_calls = _newest_by_hash(state, m, not_applied, many=True)
        #: find_decided's query, by the decision (applied or not).
        self.decided_by = {True: self.decided_calls, False: self.not_applied_calls}
        self.call_events = f"SELECT {ev} FROM events e WHERE e.call_id = {m} ORDER BY e.seq"
        self._workers(false, workers_named)
        #: Per-period counters; each store adds how it matches a list of (path, period).
        self.nodes = f"SELECT {NODE_COLUMNS} FROM budget_periods"
        #: Budget policies; each store adds how it matches a list of paths.
        self.policies = f"SELECT {POLICY_COLUMNS} FROM budgets"
        self.windows = f"SELECT {WINDOW_COLUMNS} FROM rate_windows"
        self.in_flight_under = (
            f"SELECT count(*) FROM calls WHERE {_IN_FLIGHT} AND {self.in_subtree('budget')}"
        )
        self.flying_under = (
            f"SELECT {state} FROM calls WHERE {_IN_FLIGHT} AND {self.in_subtree('budget')}"
        )
        # -- scans (operators, metrics, verify)
        self.events_after = f"SELECT {ev} FROM events e WHERE e.seq > {m} ORDER BY e.seq LIMIT {m}"
        self._budget_scans(binary)
        self._spends(index, spend, spend_from, day, newest_first)
        self._sweep_page(state)
        self._keys()
        self._kinds(ev, key_kinds)
        self.stage_counts = (
            f"SELECT provider, stage, count(*), coalesce(sum({held}), 0), min(created_at) "
            f"FROM calls WHERE {UNRESOLVED_SQL} GROUP BY provider, stage"
        )
        self._writes(event_insert)

    def _workers(self, false: str, named: str) -> None:
        """The reads of workers: one by id, the live ones (what a sweep reads), and all
        (``named``: :meth:`in_flight_except`'s list of workers by name, ``{}`` their marks)."""
        self._workers_named = named
        self.worker = f"SELECT {WORKER_COLUMNS} FROM workers WHERE worker = {self.mark}"
        self.live_workers = f"SELECT {WORKER_COLUMNS} FROM workers WHERE fenced = {false}"
        self.all_workers = f"SELECT {WORKER_COLUMNS} FROM workers"

    def in_flight_of(self, workers: int) -> str:
        """The calls in flight of ``workers`` workers, each a parameter in the store's form
        of a worker (a sweep's read of the workers it takes over, in one walk)."""
        marks = ",".join([self.mark] * workers) or "NULL"
        return f"SELECT {self.state} FROM calls WHERE {_IN_FLIGHT} AND worker IN ({marks})"

    def in_flight_except(self, workers: int) -> str:
        """A reader's page of the calls in flight of every worker but ``workers``, by name
        (a parameter each, then a limit), in one read: the operator page's look for calls
        whose owner is gone, fenced or never registered, given the workers it judged alive.
        On SQLite one walk of the partial index of unresolved calls (no index has the
        worker); on PostgreSQL a walk of the calls in flight in ``calls_stage``."""
        where = _IN_FLIGHT
        if workers:  # ``NOT IN (NULL)`` is never true: no names, no such condition
            marks = ",".join([self.mark] * workers)
            where += f" AND worker NOT IN {self._workers_named.format(marks)}"
        return f"SELECT {self.state} FROM calls WHERE {where} LIMIT {self.mark}"

    def _spends(self, index: str, spend: str, spend_from: str, day: str, newest_first: str) -> None:
        """The reads of calls' money (rows.SPEND_COLUMNS): verify's, and the spend page's."""
        m = self.mark
        # verify's pages, in the order of the table's own key (the call id).
        self.call_columns = (
            f"SELECT {index}, {spend} FROM {spend_from} "
            f"WHERE calls.call_id > {m} ORDER BY calls.call_id LIMIT {m}"
        )
        self.call_spend = (
            f"SELECT created_at, provider, {spend} FROM {spend_from} WHERE created_at >= {m} "
            f"ORDER BY {newest_first} LIMIT {m}"
        )
        # The window call_spend reads, summed: a row per UTC day, provider and model, with
        # the calls that carry money, every call read and the oldest (the page's notice).
        self.spend_sums = (
            f"SELECT {day} AS day, provider, model, sum(coalesce(cost, 0)), sum(held), "
            "sum(CASE WHEN coalesce(cost, 0) <> 0 OR held <> 0 THEN 1 ELSE 0 END), "
            f"count(*), min(created_at) FROM ({self.call_spend}) AS w GROUP BY 1, 2, 3"
        )

    def _kinds(self, ev: str, kinds: str) -> None:
        """Events of one kind, read without decoding the others (both kinds are stored as
        text in every format, each in a row of its own)."""
        #: Served by the partial index ``events_limits`` (the literal must match it).
        self.limit_events = (
            f"SELECT {ev} FROM events e WHERE kind = 'budget.limit_set' ORDER BY e.seq"
        )
        #: Key events after a seq, and the last one's seq: what a replica's copy of the key
        #: rows lacks. Served by the partial index ``events_keys`` (SQLite migration 20,
        #: PostgreSQL 13): the list of kinds must be the index's, literally.
        self.key_events = (
            f"SELECT {ev} FROM events e WHERE kind IN ({kinds}) AND e.seq > {self.mark} "
            "ORDER BY e.seq"
        )
        self.key_events_high = f"SELECT coalesce(max(seq), 0) FROM events WHERE kind IN ({kinds})"
        #: Events up to this seq may have been moved out by an archive (0: none).
        self.archived_through = (
            "SELECT coalesce(max(value), 0) FROM meta WHERE key = 'archived_through'"
        )
        #: The archive's checkpoints: few, so a scan of the kind column, with no index.
        self.checkpoint_events = (
            f"SELECT {ev} FROM events e WHERE kind = 'ledger.archived' ORDER BY e.seq"
        )

    def budget_nodes(
        self, depth: bool, periods: int | None, under: bool, policied: bool = False
    ) -> str:
        """Counter rows, by path and period, with a parameter for each filter asked for,
        in this order. ``depth``: of paths with fewer ``/`` than a parameter (a root has
        none), what the metrics label, read without the per-user nodes below them;
        ``periods``: of a path that has a policy, only the rows of that many period labels,
        so a view of one period does not read every past day of every node (a path with no
        policy keeps every row: see ``LedgerStore.budget_nodes``); ``under``: of a path and
        its descendants (:meth:`subtree`'s parameters); ``policied``: of paths that have a
        policy, with no parameter."""
        m = self.mark
        where = []
        if depth:
            where.append(f"{_DEPTH} < {m}")
        if policied:
            where.append("path IN (SELECT path FROM budgets)")
        if periods is not None:
            labels = ",".join([m] * periods) or "NULL"
            where.append(f"(period IN ({labels}) OR path NOT IN (SELECT path FROM budgets))")
        if under:
            where.append(self.in_subtree("path"))
        clause = f" WHERE {' AND '.join(where)}" if where else ""
        return f"SELECT {NODE_COLUMNS} FROM budget_periods{clause} ORDER BY path, period"

    def _budget_scans(self, binary: str) -> None:
        """Every policy; and the nodes no policy names, under a depth: the metrics' ranking
        reads the first few and one sum, however many clients made
        (``LedgerStore.policyless``), the operator page a page of them. ``binary`` is what
        makes a text column compare byte by byte."""
        m, self.binary = self.mark, binary
        self.all_policies = f"SELECT {POLICY_COLUMNS} FROM budgets ORDER BY path"
        self._policyless_from = policyless = (
            f"FROM budget_periods WHERE {_DEPTH} < {m} AND period = 'total' "
            "AND path NOT IN (SELECT path FROM budgets)"
        )
        self.policyless_top = (
            f"SELECT {NODE_COLUMNS} {policyless} "
            f"ORDER BY reserved + spent + held DESC, path LIMIT {m}"
        )
        self.policyless_sum = (
            "SELECT count(*), coalesce(sum(reserved), 0), coalesce(sum(spent), 0), "
            f"coalesce(sum(held), 0) {policyless}"
        )

    def policyless_page(self, under: bool) -> tuple[str, str]:
        """The first nodes no policy names in the tree's order, and how many there are
        (``LedgerStore.policyless_page``): parameters a depth, then :meth:`subtree`'s if
        ``under``, then (the first statement) a limit. The tree's order compares paths
        segment by segment: with ``/`` read as a space, below every character a path may
        hold, byte order is that order."""
        m = self.mark
        where = self._policyless_from + (f" AND {self.in_subtree('path')}" if under else "")
        order = f"replace(path, '/', ' '){self.binary}"
        page = f"SELECT {NODE_COLUMNS} {where} ORDER BY {order} LIMIT {m}"
        return page, f"SELECT count(*) {where}"

    def budget_rows(self, paths: int) -> str:
        """Every counter row of ``paths`` paths (a parameter each)."""
        marks = ",".join([self.mark] * paths) or "NULL"
        return f"SELECT {NODE_COLUMNS} FROM budget_periods WHERE path IN ({marks})"

    def _sweep_page(self, state: str) -> None:
        """The resolver's page of unknown calls: after a (created_at, call id) cursor, in
        that order, so each sweep reads its page and no more (``UNRESOLVED_SQL`` first:
        SQLite then reads the small partial index of unresolved calls); and verify's page
        of every call's state, in the order of the table's key."""
        m = self.mark
        self.states_after = (
            f"SELECT {state} FROM calls WHERE call_id > {m} ORDER BY call_id LIMIT {m}"
        )
        self.unknown_after = (
            f"SELECT {state} FROM calls WHERE {UNRESOLVED_SQL} AND stage = 'effect_unknown' "
            f"AND (created_at > {m} OR (created_at = {m} AND call_id > {m})) "
            f"ORDER BY created_at, call_id LIMIT {m}"
        )

    def _keys(self) -> None:
        """The reads of keys: a proxy key by name, every proxy key, an idempotency key an
        archive moved out with its call (the call id and request hash it named), and an
        ended operator-page session's token digest."""
        m = self.mark
        self.key = f"SELECT {KEY_COLUMNS} FROM keys WHERE name = {m}"
        self.all_keys = f"SELECT {KEY_COLUMNS} FROM keys ORDER BY name"
        self.archived_key = (
            "SELECT call_id, request_hash FROM archived_keys "
            f"WHERE budget_root = {m} AND idempotency_key = {m}"
        )
        # An operator-page login ended by a logout (ledger/endedsessions), by its digest.
        self.session_ended = f"SELECT 1 FROM ended_sessions WHERE token_sha256 = {m}"

    def _writes(self, event_insert: str) -> None:
        """The inserts and upserts (``event_insert``: the events' columns as written)."""
        m = self.mark
        self.insert_events = upsert("events", event_insert, m, None)
        self.upsert_calls = upsert("calls", CALL_COLUMNS, m, MUTABLE_CALL_COLUMNS)
        self.upsert_nodes = upsert("budget_periods", NODE_COLUMNS, m, names(NODE_COLUMNS)[2:], 2)
        self.upsert_windows = upsert("rate_windows", WINDOW_COLUMNS, m, names(WINDOW_COLUMNS)[1:])
        self.upsert_policies = upsert("budgets", POLICY_COLUMNS, m, names(POLICY_COLUMNS)[1:])
        self.upsert_workers = upsert("workers", WORKER_COLUMNS, m, names(WORKER_COLUMNS)[1:])
        self.upsert_keys = upsert("keys", KEY_COLUMNS, m, names(KEY_COLUMNS)[1:])

    def node_keys(self, count: int) -> str:
        """``WHERE`` matching ``count`` (path, period) pairs (parameters: path, period, …)."""
        pairs = ",".join([f"({self.mark},{self.mark})"] * count)
        return f"{self.nodes} WHERE (path, period) IN (VALUES {pairs})"

    def in_subtree(self, column: str) -> str:
        """``column`` is a path or one of its descendants (parameters: :meth:`subtree`).

        A prefix compared whole, not ``LIKE``: SQLite's ``LIKE`` ignores ASCII case, so
        ``team`` matched ``TEAM/x`` (a concurrency limit on one counted the other's
        calls), and a path's ``%`` and ``_`` would need escaping."""
        m = self.mark
        return f"({column} = {m} OR substr({column}, 1, {m}) = {m})"

    @staticmethod
    def subtree(path: str) -> list[Any]:
        """Parameters of :meth:`in_subtree` for ``path`` and its descendants."""
        prefix = path + "/"
        return [path, len(prefix), prefix]

    def list_calls(
        self,
        stage: str | None,
        budget: str | None,
        limit: int,
        *,
        provider: str | None = None,
        since: float | None = None,
        oldest_first: bool = False,
    ) -> tuple[str, list[Any]]:
        """The SQL and parameters listing calls, newest first (``oldest_first``: the
        other way round).

        ``budget`` selects the path and its subtree (:meth:`in_subtree`).
        ``provider`` and ``since`` (a creation time) filter on the rows' columns, so that a
        store that folds a call's state on read folds only the calls it lists.
        """
        m = self.mark
        where: list[str] = []
        params: list[Any] = []
        for column, value in (("provider =", provider), ("created_at >=", since)):
            if value is not None:
                where.append(f"{column} {m}")
                params.append(value)
        order = self.newest_first
        if stage is not None:
            if stage in UNRESOLVED:
                # Few calls are unresolved: find them in their partial index and sort
                # them, rather than walk every call newest first (``+`` keeps SQLite
                # from ordering by an index of every call).
                where.append(UNRESOLVED_SQL)
                order = "+created_at DESC"
            where.append(f"stage = {m}")
            params.append(stage)
        if budget is not None:
            where.append(self.in_subtree("budget"))
            params += self.subtree(budget)
        if oldest_first:
            order = order.replace(" DESC", " ASC")
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        sql = f"SELECT {self.state} FROM calls {clause} ORDER BY {order} LIMIT {m}"
        return sql, [*params, limit_param(limit)]


SQLITE = Queries(
    mark="?",
    false="0",
    # A state is an object, the array of rows.STATE_FIELDS (as stored before) or of
    # rows.SLIM_FIELDS; json_array_length is 0 for an object.
    held=f"coalesce(CASE json_array_length(state) "
    f"WHEN {len(STATE_FIELDS)} THEN json_extract(state, '$[{STATE_FIELDS.index('held')}]') "
    f"WHEN {len(SLIM_FIELDS)} THEN json_extract(state, '$[{SLIM_FIELDS.index('held')}]') END, "
    "json_extract(state, '$.held'))",
    state=sqlitecalls.CALL_READ,
    index=sqlitecalls.INDEX_READ,
    event_columns=sqliteevents.SELECT_COLUMNS,
    event_insert=sqliteevents.INSERT_COLUMNS,
    # Call ids made since new_call_id put the time first (ledger/operations.py, since
    # 2026-11-29) sort by creation to the millisecond. Older ids were random (uuid4):
    # in a ledger upgraded by migration 9 they list in id order, not by time. Their
    # index, calls_created, cost a b-tree page in every admission.
    newest_first="call_id DESC",
    key_kinds=KEY_KINDS_SQLITE,
    # A row's worker is its name's id (migration 11); a name never written matches none.
    workers_named="(SELECT id FROM worker_names WHERE name IN ({}))",
)
POSTGRES = Queries(
    mark="%s",
    false="false",
    # json, not jsonb: ->> on json reads the text as it is, where a cast to jsonb builds
    # the whole binary form first (the unknown-call totals of 100,000 such calls, on a
    # loaded machine: a median of 0.97-1.02 s against 1.30-1.46 s, effectguard_bench.gonebench).
    held="(state::json ->> 'held')::numeric",
    # Every state PostgreSQL stores is whole (rows.state_params), its money exact integers.
    # One decoding of the state a row: ``state::jsonb ->> …`` three times parsed it three
    # times (50,000 calls: 425 ms of the query's 430, against 144 ms this way).
    spend="s.model, s.cost, coalesce(s.held, 0) AS held",
    spend_from="calls CROSS JOIN LATERAL "
    "json_to_record(calls.state::json) AS s(model text, cost bigint, held bigint)",
    day="floor(created_at / 86400)::bigint",
    # A database's collation may order text by language (punctuation ignored); "C" is
    # byte order, which every PostgreSQL has.
    binary=' COLLATE "C"',
)
