"""The SQL both stores share: stage lists come from workstate and keep their indexes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from effectguard.ledger import pgschema, sqliteconnect, sqliteschema
from effectguard.ledger.queries import SQLITE
from effectguard.ledger.sqlparts import UNRESOLVED_SQL, stage_list
from effectguard.rules.workstate import UNRESOLVED


def _squeeze(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def test_unresolved_stage_list_is_the_workstate_set() -> None:
    """The SQL stage list names exactly the stages workstate calls unresolved."""
    assert set(re.findall(r"'(\w+)'", UNRESOLVED_SQL)) == set(UNRESOLVED)


def test_stage_list_refuses_names_that_are_not_stages() -> None:
    """Only stage names from workstate reach SQL text, never a typo or an input."""
    with pytest.raises(ValueError, match="not stages"):
        stage_list(["in_flight", "x'; DROP TABLE calls; --"])  # type: ignore[list-item]


@pytest.mark.parametrize("schema", [sqliteschema, pgschema], ids=["sqlite", "postgres"])
def test_migrations_index_the_stage_list_the_queries_use(schema: object) -> None:
    """The partial index on unresolved calls has the very predicate the retry lookup uses."""
    migrations = schema.MIGRATIONS  # type: ignore[attr-defined]
    statements = [_squeeze(s) for _, _, batch in migrations for s in batch if isinstance(s, str)]
    indexes = [s for s in statements if "INDEX calls_unresolved" in s]
    assert indexes and all(index.endswith(f"WHERE {UNRESOLVED_SQL}") for index in indexes)


@pytest.mark.parametrize(
    ("sql", "params"),
    [
        (SQLITE.in_flight_of(2), (1, 2)),
        (SQLITE.in_flight_except(2), ("w1", "w2", 10)),
        (SQLITE.in_flight_except(0), (10,)),
        (SQLITE.in_flight_under, SQLITE.subtree("team")),
        (SQLITE.list_calls("effect_unknown", None, 10)[0], ("effect_unknown", 10)),
        (SQLITE.list_calls("in_flight", "team", 10)[0], ("in_flight", *SQLITE.subtree("team"), 10)),
        (SQLITE.stage_counts, ()),
    ],
)
def test_lookups_by_stage_read_only_unresolved_calls(
    tmp_path: Path, sql: str, params: tuple[object, ...]
) -> None:
    """Every lookup of calls by stage reads the partial index of unresolved calls, not
    every call (there is no index of all calls by stage)."""
    conn = sqliteconnect.connect(str(tmp_path / "l.db"))
    try:
        sqliteschema.migrate(conn)
        plan = conn.execute("EXPLAIN QUERY PLAN " + sql, params)
        details = " ".join(str(row[-1]) for row in plan)
    finally:
        conn.close()
    assert "INDEX calls_unresolved" in details, details


@pytest.mark.parametrize(
    ("sql", "index"),
    [
        (SQLITE.unresolved_call, "calls_unresolved"),
        (SQLITE.decided_calls, "calls_decided"),
        (SQLITE.not_applied_calls, "calls_not_applied"),
    ],
)
def test_retry_lookups_use_their_partial_index(tmp_path: Path, sql: str, index: str) -> None:
    """SQLite answers a retry's lookups by hash (an unresolved call, a call decided
    applied or not applied) from small partial indexes, not by a scan of every call."""
    conn = sqliteconnect.connect(str(tmp_path / "l.db"))
    try:
        sqliteschema.migrate(conn)
        limit = (16,) if sql.endswith("LIMIT ?") else ()  # find_decided's limit
        plan = conn.execute("EXPLAIN QUERY PLAN " + sql, ("r", "h", 0.0, *limit))
        details = " ".join(str(row[-1]) for row in plan)
    finally:
        conn.close()
    assert f"USING INDEX {index}" in details, details


@pytest.mark.parametrize(
    ("sql", "params"),
    [
        (SQLITE.list_calls(None, None, 10)[0], (10,)),
        (SQLITE.list_calls(None, "team", 10)[0], (*SQLITE.subtree("team"), 10)),
    ],
)
def test_listing_calls_newest_first_walks_the_calls_key(
    tmp_path: Path, sql: str, params: tuple[object, ...]
) -> None:
    """Calls list newest first by walking the calls table's own key (call ids start with
    their time) backwards: no sort of every call, and no index of every call to write."""
    conn = sqliteconnect.connect(str(tmp_path / "l.db"))
    try:
        sqliteschema.migrate(conn)
        plan = conn.execute("EXPLAIN QUERY PLAN " + sql, params)
        details = " ".join(str(row[-1]) for row in plan)
        indexes = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='index'")]
    finally:
        conn.close()
    assert "SCAN calls" in details and "TEMP B-TREE" not in details, details
    assert not [
        i
        for i in indexes
        if i.startswith("calls_")
        # partial: unresolved calls, keyed calls, calls decided; not every call
        and i not in ("calls_unresolved", "calls_key", "calls_decided", "calls_not_applied")
        and not i.startswith("sqlite_")
    ], indexes
