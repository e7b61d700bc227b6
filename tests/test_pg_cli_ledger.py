"""The operator commands on a PostgreSQL ledger that is not there: refused, nothing created.

Every command but ``serve`` and ``migrate`` works on an existing ledger (README), so a
mistyped ``?schema=`` must be exit 2 naming it, as a mistyped SQLite path is, not a new
schema full of tables. Runs against ``EFFECTGUARD_TEST_PG_DSN``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from pgkit import DSN, NEEDS_PG, with_schema
from stagedkit import run

pytestmark = NEEDS_PG

COMMANDS = [
    ["calls"],
    ["show", "call-1"],
    ["budgets"],
    ["budget", "set", "team-a", "--limit", "1"],
    ["reconcile", "call-1", "--not-applied", "--note", "x"],
    ["verify"],
    ["verify", "--archived"],
    ["archive", "--before", "0d"],
    ["key", "list"],
    ["key", "new", "--name", "k", "--root", "team-a"],
    ["key", "revoke", "k"],
]


def _schema_exists(name: str) -> bool:
    import psycopg

    with psycopg.connect(DSN, autocommit=True) as conn:
        return (
            conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (name,)).fetchone()
            is not None
        )


def _tables(name: str) -> list[str]:
    import psycopg

    with psycopg.connect(DSN, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = %s", (name,)
        ).fetchall()
    return [r[0] for r in rows]


@pytest.fixture
def schema() -> Iterator[str]:
    """A schema name nobody made (dropped afterwards, should a command have made it)."""
    import psycopg

    name = f"eg_typo_{uuid.uuid4().hex[:12]}"
    try:
        yield name
    finally:
        with psycopg.connect(DSN, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(a[:2]) for a in COMMANDS])
def test_a_missing_schema_is_refused_and_not_created(schema: str, argv: list[str]) -> None:
    """A command given a DSN whose schema does not exist exits 2 naming the schema, and
    the schema still does not exist afterwards."""
    done = run(*argv, "--ledger", with_schema(DSN, schema))
    assert done.code == 2, (done.out, done.err)
    assert f"schema {schema} does not exist" in done.err
    assert not _schema_exists(schema)


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(a[:2]) for a in COMMANDS])
def test_an_empty_schema_is_not_made_a_ledger(schema: str, argv: list[str]) -> None:
    """A schema that exists but holds no effectguard tables is exit 2, and stays empty."""
    import psycopg

    with psycopg.connect(DSN, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    done = run(*argv, "--ledger", with_schema(DSN, schema))
    assert done.code == 2, (done.out, done.err)
    assert "is not an effectguard ledger" in done.err
    assert _tables(schema) == []


def test_migrate_makes_the_ledger_the_others_then_use(schema: str) -> None:
    """migrate creates the schema, and says so without printing a password in the URL;
    afterwards the commands read it."""
    url = with_schema(DSN, schema)
    secret = url.replace("://postgres@", "://postgres:s3cret-pw@", 1)  # trust auth
    made = run("migrate", "--ledger", secret)
    assert made.code == 0 and "created:" in made.out, made
    assert "s3cret-pw" not in made.out + made.err
    done = run("budgets", "--ledger", url)
    assert done.code == 0, done.err
