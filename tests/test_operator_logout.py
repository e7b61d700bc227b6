"""Logging out of the operator page ends the session on every replica, over HTTP.

A session is a signed token every replica accepts; before logouts were recorded, "Log
out" only cleared the browser's cookie, and a copy of it taken before (a shared machine,
a proxy's log, a laptop's backup) still opened the page and decided calls until it
expired. Now the logout is recorded in the ledger, and a copy is refused (401, the login
form) on the replica that logged out and on every other one at once, before anything is
written. A ledger that cannot say whether a session ended answers 503, never the page.
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from operatorkit import (
    ADMIN_KEY,
    PAGE,
    Stack,
    config_text,
    ledger_view,
    operator_stack,
    unknown_call,
)
from pgkit import DSN, ledger_url

from effectguard.testing import Proxy, fake_provider, running_proxy

pytestmark = pytest.mark.slow
_ = (ledger_url,)  # fixtures


def login(url: str) -> dict[str, str]:
    """Log in through the form at ``url``; the ``Cookie`` header that carries the session."""
    answer = httpx.post(
        url + PAGE + "login", data={"key": ADMIN_KEY, "next": PAGE}, headers={"origin": url}
    )
    assert answer.status_code == 303, answer.text
    return {"cookie": f"effectguard_admin={answer.cookies['effectguard_admin']}"}


def csrf_of(url: str, session: dict[str, str]) -> str:
    """The CSRF token of ``session``'s forms, from the page at ``url``."""
    page = httpx.get(url + PAGE, headers=session)
    assert page.status_code == 200, page.text
    found = re.search(r'name="csrf" value="([0-9a-f]+)"', page.text)
    assert found, "no CSRF field on the page"
    return found.group(1)


def log_out(url: str, session: dict[str, str]) -> None:
    """Press "Log out" on the page at ``url``: the cookie is cleared and the page reopens."""
    token = csrf_of(url, session)
    answer = httpx.post(
        url + PAGE + "logout", data={"csrf": token}, headers=session | {"origin": url}
    )
    assert answer.status_code == 303, answer.text
    assert answer.headers["set-cookie"].startswith("effectguard_admin=;")


def reconcile(url: str, call_id: str, session: dict[str, str], csrf: str) -> httpx.Response:
    """POST the not-applied decision of ``call_id`` as the page's form does."""
    return httpx.post(
        f"{url}{PAGE}calls/{call_id}/reconcile",
        data={"decision": "not_applied", "note": "nothing at the provider", "csrf": csrf},
        headers=session | {"origin": url},
    )


def assert_refused(url: str, call_id: str, copy: dict[str, str], csrf: str, stack: Stack) -> None:
    """The copied cookie opens no page and decides nothing at ``url``: 401 and the login
    form, the call's events as they were."""
    for path in ("", f"calls/{call_id}"):
        page = httpx.get(url + PAGE + path, headers=copy)
        assert page.status_code == 401, (path, page.text)
        assert 'name="key"' in page.text and "gpt-4o" not in page.text
    _, before = ledger_view(stack, call_id)
    refused = reconcile(url, call_id, copy, csrf)
    assert refused.status_code == 401 and 'name="key"' in refused.text
    state, after = ledger_view(stack, call_id)
    assert state.stage == "effect_unknown" and after == before


def test_a_copy_of_the_cookie_is_refused_after_logging_out(tmp_path: Path) -> None:
    """After "Log out", a copy of the cookie kept from before gets 401 on a page and on a
    reconcile (nothing written); a fresh login works, and so does the admin key as a
    bearer token, which no logout concerns."""
    with operator_stack(tmp_path) as stack:
        call_id = unknown_call(stack, "logout-1")
        session = login(stack.url)
        csrf = csrf_of(stack.url, session)
        copy = dict(session)
        log_out(stack.url, session)
        assert_refused(stack.url, call_id, copy, csrf, stack)
        fresh = login(stack.url)
        assert httpx.get(stack.url + PAGE, headers=fresh).status_code == 200
        decided = reconcile(stack.url, call_id, fresh, csrf_of(stack.url, fresh))
        assert decided.status_code == 303, decided.text
        bearer = {"authorization": f"Bearer {ADMIN_KEY}"}
        assert httpx.get(stack.url + PAGE, headers=bearer).status_code == 200
    assert "operator ana logged out" in stack.proxy.log()


@contextlib.contextmanager
def two_replicas(ledger: str, tmp: Path) -> Iterator[tuple[Stack, Proxy]]:
    """The fake provider and two ``effectguard serve`` replicas on one ledger, with the
    same config: the first with the provider (a Stack), and the second."""
    config = tmp / "effectguard.toml"
    config.write_text(config_text())
    args = ["--config", str(config)]
    with (
        fake_provider(tmp / "receipts.jsonl") as provider,
        running_proxy(
            ledger, upstreams={"openai": provider.url}, args=args, log_path=tmp / "a.log"
        ) as a,
        running_proxy(
            ledger, upstreams={"openai": provider.url}, args=args, log_path=tmp / "b.log"
        ) as b,
    ):
        yield Stack(provider, a), b


def test_logging_out_on_one_replica_ends_the_session_on_the_other(
    ledger_url: str, tmp_path: Path
) -> None:
    """Two replicas on one ledger (a SQLite file; a PostgreSQL schema): a session logged
    out on A is refused on B at once, page and reconcile, and on A; a fresh login on B works."""
    with two_replicas(ledger_url, tmp_path) as (stack, b):
        call_id = unknown_call(stack, "logout-2")
        session = login(stack.url)
        copy = dict(session)
        csrf = csrf_of(b.url, copy)  # the session opens B too: one signing secret
        log_out(stack.url, session)
        assert_refused(b.url, call_id, copy, csrf, stack)
        assert_refused(stack.url, call_id, copy, csrf, stack)
        fresh = login(b.url)
        assert httpx.get(b.url + PAGE, headers=fresh).status_code == 200
        assert httpx.get(stack.url + PAGE, headers=fresh).status_code == 200


def _lose_the_ended_sessions_table(ledger: str) -> None:
    """Drop ``ended_sessions`` under the running proxy: every read of it then fails."""
    if "schema=" in ledger:
        import psycopg

        with psycopg.connect(DSN, autocommit=True) as conn:
            conn.execute(f"DROP TABLE {ledger.rsplit('schema=', 1)[1]}.ended_sessions")
    else:
        with contextlib.closing(sqlite3.connect(ledger)) as conn:
            conn.execute("DROP TABLE ended_sessions")
            conn.commit()


def test_a_ledger_that_cannot_say_whether_a_session_ended_answers_503(
    ledger_url: str, tmp_path: Path
) -> None:
    """When the ledger cannot answer whether a cookie's session was ended, the page is
    refused with 503 (fail closed, never open); a bearer request reads no such record."""
    config = tmp_path / "effectguard.toml"
    config.write_text(config_text())
    args = ["--config", str(config)]
    with running_proxy(ledger_url, args=args, log_path=tmp_path / "p.log") as proxy:
        session = login(proxy.url)
        assert httpx.get(proxy.url + PAGE, headers=session).status_code == 200
        _lose_the_ended_sessions_table(ledger_url)
        page = httpx.get(proxy.url + PAGE, headers=session)
        assert page.status_code == 503 and "ledger is unavailable" in page.text
        assert "gpt-4o" not in page.text
        bearer = {"authorization": f"Bearer {ADMIN_KEY}"}
        assert httpx.get(proxy.url + PAGE, headers=bearer).status_code == 200
