"""A PostgreSQL ledger for a test: a fresh schema of the database at
``EFFECTGUARD_TEST_PG_DSN``, dropped afterwards, so tests never see each other's rows.

Modules take the fixtures by importing them (``from pgkit import pg_url`` and
``_ = (pg_url,)  # fixtures``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

DSN = os.environ.get("EFFECTGUARD_TEST_PG_DSN", "")

#: A PostgreSQL test module's marks (``pytestmark = NEEDS_PG``): skipped without a server.
NEEDS_PG = [
    pytest.mark.postgres,
    pytest.mark.skipif(
        not DSN, reason="set EFFECTGUARD_TEST_PG_DSN=postgresql://… to run the PostgreSQL tests"
    ),
]


def server_port() -> int:
    """The port of the PostgreSQL server ``EFFECTGUARD_TEST_PG_DSN`` names."""
    return int(DSN.split("@", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])


def via(url: str, port: int) -> str:
    """``url`` with its host and port replaced by 127.0.0.1:``port`` (a relay's)."""
    host = url.split("@", 1)[1].split("/", 1)[0]
    return url.replace(host, f"127.0.0.1:{port}", 1)


def with_schema(dsn: str, schema: str) -> str:
    """``dsn`` with the ledger's ``schema`` parameter added."""
    return f"{dsn}{'&' if '?' in dsn else '?'}schema={schema}"


@contextmanager
def scratch_schema(prefix: str = "eg_test_") -> Iterator[str]:
    """A ledger URL in a schema of its own (named ``prefix`` + random hex), dropped on exit."""
    import psycopg  # only where PostgreSQL runs: SQLite-only machines need not have it

    schema = f"{prefix}{uuid.uuid4().hex[:12]}"
    try:
        yield with_schema(DSN, schema)
    finally:
        with psycopg.connect(DSN, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


@contextmanager
def scratch_role(options: str = "", *settings: str) -> Iterator[str]:
    """A ledger URL in a fresh schema, reached as a login role of its own created with
    ``options`` (``CONNECTION LIMIT 2``) and ``settings`` as its defaults
    (``statement_timeout = '200ms'``), as a DBA sets them; skipped where the test user
    cannot create roles. Schema and role are dropped on exit."""
    import psycopg

    role = f"eg_role_{uuid.uuid4().hex[:12]}"
    password = uuid.uuid4().hex
    with psycopg.connect(DSN, autocommit=True) as conn:
        try:
            conn.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{password}' {options}")
        except psycopg.errors.InsufficientPrivilege:
            pytest.skip("EFFECTGUARD_TEST_PG_DSN's user cannot create roles")
        conn.execute(f'GRANT CREATE ON DATABASE "{conn.info.dbname}" TO {role}')
        for setting in settings:
            conn.execute(f"ALTER ROLE {role} SET {setting}")
    try:
        with scratch_schema("eg_role_") as url:
            parts = urlsplit(url)
            netloc = f"{role}:{password}@{parts.netloc.rsplit('@', 1)[-1]}"
            yield urlunsplit(parts._replace(netloc=netloc))
    finally:
        with psycopg.connect(DSN, autocommit=True) as conn:
            conn.execute(f"DROP OWNED BY {role}")
            conn.execute(f"DROP ROLE {role}")


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A ledger URL in a fresh schema of the test database, dropped after the test
    (skipped without ``EFFECTGUARD_TEST_PG_DSN``)."""
    if not DSN:
        pytest.skip("needs EFFECTGUARD_TEST_PG_DSN")
    with scratch_schema() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgres"])
def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh ledger: a SQLite file, or a PostgreSQL schema of its own (dropped after;
    skipped without ``EFFECTGUARD_TEST_PG_DSN``)."""
    if request.param == "sqlite":
        yield str(tmp_path / "ledger.db")
        return
    if not DSN:
        pytest.skip("needs EFFECTGUARD_TEST_PG_DSN")
    with scratch_schema() as url:
        yield url


# Loaded by a ``serve`` started with :func:`shorter_waits`' environment (as ``sitecustomize``).
_SHORTER_WAITS = """
import effectguard.ledger.pgdeadline as deadline
import effectguard.ledger.pgreader as reader

reader.READ_WAIT_S = {read_s!r}
deadline.WRITE_WAIT_S = {write_s!r}
deadline.WriteDeadline.__init__.__defaults__ = ({write_s!r},)
"""


def shorter_waits(folder: Path, read_s: float = 10.0, write_s: float = 10.0) -> dict[str, str]:
    """The environment of a ``serve`` whose PostgreSQL reads and writes give up after
    ``read_s`` and ``write_s`` (60 s and 30 s in the product), for tests that wait for
    those bounds to pass: the same code path, at a third of the suite's time. A bound on
    a test, not a claim about timing; ``folder`` receives the ``sitecustomize.py``."""
    (folder / "sitecustomize.py").write_text(_SHORTER_WAITS.format(read_s=read_s, write_s=write_s))
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path}
