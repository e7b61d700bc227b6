"""A DBA's ``statement_timeout`` on the ledger's role (common on managed PostgreSQL) does not
cut effectguard's own waits short.

effectguard bounds its statements itself: ``lock_timeout`` (5 s) for a lock another
session holds, and the reader's and writer's own deadlines for a connection that went
silent (docs/operations.md, hung replicas). A role or database default of
``statement_timeout = 200ms`` used to apply on top: a read waiting behind a table lock
failed after 200 ms (``calls`` exit 4, the sweeper "ledger busy"), an admission waiting
for the batch lock answered 503, and a replica starting while another migrated the
ledger exited 3 (``canceling statement due to statement timeout``). Each test runs as a
role of its own with that default, waiting behind a lock held a little longer than it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from pgkit import DSN, NEEDS_PG, scratch_role
from stagedkit import run

from effectguard.testing import fake_provider, running_proxy

pytestmark = NEEDS_PG

#: Longer than the role's statement_timeout, far shorter than effectguard's lock_timeout.
HOLD_S = 1.5
CHAT = "/openai/v1/chat/completions"


@pytest.fixture
def role_url() -> Iterator[str]:
    """A fresh ledger reached as a role whose default ``statement_timeout`` is 200 ms."""
    with scratch_role("", "statement_timeout = '200ms'") as url:
        yield url


def _schema(url: str) -> str:
    return url.rsplit("schema=", 1)[1]


@contextmanager
def _locked(url: str, table: str, mode: str) -> Iterator[None]:
    """``table`` locked by another session from now until ``HOLD_S`` later (not before:
    what runs in the block waits for it)."""
    import psycopg

    conn = psycopg.connect(DSN, autocommit=False)
    conn.execute(f"LOCK TABLE {_schema(url)}.{table} IN {mode} MODE")
    release = threading.Timer(HOLD_S, conn.commit)
    release.start()
    try:
        yield
    finally:
        release.join()
        conn.close()


def test_a_read_behind_a_lock_waits_for_it_not_for_the_roles_statement_timeout(
    role_url: str,
) -> None:
    assert run("migrate", "--ledger", role_url).code == 0
    with _locked(role_url, "calls", "ACCESS EXCLUSIVE"):
        listed = run("calls", "--ledger", role_url)
    assert listed.code == 0, listed.err


def test_an_admission_behind_a_lock_is_sent_not_refused(role_url: str, tmp_path: Path) -> None:
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
    with (
        fake_provider(tmp_path / "receipts.jsonl") as fake,
        running_proxy(
            role_url, upstreams={"openai": fake.url}, log_path=tmp_path / "serve.log"
        ) as proxy,
    ):
        with _locked(role_url, "events", "EXCLUSIVE"):
            answer = httpx.post(proxy.url + CHAT, json=body, timeout=30)
        assert answer.status_code == 200, answer.text
        assert len(fake.effects()) == 1
    assert run("verify", "--ledger", role_url).code == 0


def test_a_replica_starting_while_the_ledger_is_migrated_waits_for_it(
    role_url: str, tmp_path: Path
) -> None:
    assert run("migrate", "--ledger", role_url).code == 0
    # Another replica's migrations hold this table while they run.
    with (
        _locked(role_url, "migrations", "ACCESS EXCLUSIVE"),
        running_proxy(role_url, log_path=tmp_path / "serve.log") as proxy,
    ):
        assert httpx.get(proxy.url + "/healthz", timeout=30).status_code == 200
