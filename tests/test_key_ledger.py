"""Proxy keys in the ledger, on every store: the key fold, its rules, and verify's own fold.

Runs on memory, SQLite and (with EFFECTGUARD_TEST_PG_DSN) PostgreSQL through the store
contract's fixtures; every ledger must verify at the end of every test.
"""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pytest
from test_store_contract import clock, ledger, ledger_url, ns, store_kind  # noqa: F401

from effectguard.errors import KeyChangeRefused
from effectguard.ledger import Ledger
from effectguard.ops.verify import verify_ledger
from effectguard.rules import keys
from effectguard.rules.events import KeyCreated


def created(name: str, root: str = "team-a", **kwargs: object) -> KeyCreated:
    """A ``key.created`` for ``name`` with the digest of a key made from its name."""
    digest = hashlib.sha256(f"key-of-{name}".encode()).hexdigest()
    return KeyCreated(name=name, sha256=digest, budget_root=root, **kwargs)  # type: ignore[arg-type]


async def test_a_created_key_is_a_row_with_its_hash_and_restrictions(
    ledger: Ledger,  # noqa: F811
    ns: str,  # noqa: F811
) -> None:
    """key.created folds into one row: digest, root, restrictions, expiry, time of the event."""
    row = await ledger.create_key(
        created(f"{ns}-a", models=["gpt-4o-mini"], providers=["openai"], expires_at=4e9)
    )
    stored = {k.name: k for k in await ledger.keys()}[f"{ns}-a"]
    assert stored == row
    assert row.sha256 == hashlib.sha256(f"key-of-{ns}-a".encode()).hexdigest()
    assert (row.budget_root, row.models, row.providers) == ("team-a", ("gpt-4o-mini",), ("openai",))
    assert (row.expires_at, row.revoked_at) == (4e9, None)
    events = await ledger.store.events_after(0, 100)
    assert [e.kind for e in events] == ["key.created"]
    assert events[0].at == row.created_at


async def test_revoking_marks_the_row_and_is_refused_twice(
    ledger: Ledger,  # noqa: F811
    ns: str,  # noqa: F811
) -> None:
    """key.revoked sets revoked_at; revoking it again, or an unknown name, is refused."""
    await ledger.create_key(created(f"{ns}-a"))
    revoked = await ledger.revoke_key(f"{ns}-a")
    assert revoked.revoked_at is not None and revoked.ended(revoked.revoked_at) == "revoked"
    with pytest.raises(KeyChangeRefused, match="already revoked"):
        await ledger.revoke_key(f"{ns}-a")
    with pytest.raises(KeyChangeRefused, match="no key named"):
        await ledger.revoke_key(f"{ns}-nobody")
    assert [e.kind for e in await ledger.store.events_after(0, 100)] == [
        "key.created",
        "key.revoked",
    ]


async def test_a_live_name_is_not_taken_twice_but_a_revoked_one_is_reused(
    ledger: Ledger,  # noqa: F811
    ns: str,  # noqa: F811
) -> None:
    """A name in use is refused; once revoked, a new key under that name replaces the row."""
    await ledger.create_key(created(f"{ns}-a"))
    with pytest.raises(KeyChangeRefused, match="in use"):
        await ledger.create_key(created(f"{ns}-a", root="team-b"))
    await ledger.revoke_key(f"{ns}-a")
    again = await ledger.create_key(created(f"{ns}-a", root="team-b"))
    assert (again.budget_root, again.revoked_at) == ("team-b", None)
    assert [k.budget_root for k in await ledger.keys()] == ["team-b"]


async def test_bad_key_changes_write_nothing(
    ledger: Ledger,  # noqa: F811
    ns: str,  # noqa: F811
) -> None:
    """An expiry in the past, a bad name, root or digest is refused and writes no event."""
    for event in (
        created(f"{ns}-a", expires_at=1.0),
        created("bad name"),
        created(f"{ns}-b", root="../up"),
        KeyCreated(name=f"{ns}-c", sha256="not-a-digest", budget_root="team-a"),
    ):
        with pytest.raises(KeyChangeRefused):
            await ledger.create_key(event)
    assert await ledger.store.events_after(0, 100) == []
    assert await ledger.keys() == []


async def test_keys_live_beside_calls_and_budgets_in_one_chain(
    ledger: Ledger,  # noqa: F811
    ns: str,  # noqa: F811
) -> None:
    """Key events interleave with limits in the hash chain and the ledger still verifies."""
    await ledger.set_limit(f"{ns}", 10_000)
    await ledger.create_key(created(f"{ns}-a", root=ns))
    await ledger.set_limit(f"{ns}", 20_000)
    await ledger.revoke_key(f"{ns}-a")
    report = await verify_ledger(ledger)
    assert report.ok, report.problems
    assert report.events == 4


@pytest.mark.parametrize(
    ("column", "value"),
    [("revoked_at", None), ("budget_root", "team-b"), ("models", '["gpt-4o"]')],
)
async def test_verify_refuses_a_keys_row_that_is_not_the_fold(
    tmp_path: object, column: str, value: object
) -> None:
    """verify folds key events itself: a keys row changed behind the chain's back is caught."""
    path = str(tmp_path) + "/l.db"  # type: ignore[operator]
    async with Ledger.open(path) as led:
        await led.create_key(created("k1", models=["gpt-4o-mini"]))
        await led.revoke_key("k1")
        assert (await verify_ledger(led)).ok
    with sqlite3.connect(path) as conn:
        conn.execute(f"UPDATE keys SET {column} = ? WHERE name = 'k1'", (value,))
    async with Ledger.open(path) as led:
        report = await verify_ledger(led)
    assert not report.ok
    assert any("key 'k1'" in p and column in p for p in report.problems), report.problems
    digest = hashlib.sha256(b"key-of-k1").hexdigest()
    assert not any(digest in p for p in report.problems)


async def test_verify_refuses_a_revocation_of_a_key_never_created(tmp_path: object) -> None:
    """The verifier's own rules: a key.revoked with no live key.created is a broken event."""
    path = str(tmp_path) + "/l.db"  # type: ignore[operator]
    async with Ledger.open(path) as led:
        await led.create_key(created("k1"))
        await led.revoke_key("k1")
    from effectguard.ops.audit import Verifier

    async with Ledger.open(path) as led:
        events = await led.store.events_after(0, 10)
    verifier = Verifier()
    verifier.feed(events[1])  # the revocation alone: its key was never created
    assert any("not live" in p for p in verifier.report.problems), verifier.report.problems


async def test_the_key_events_since_a_seq_fold_into_the_rows(
    ledger: Ledger,  # noqa: F811
    ns: str,  # noqa: F811
) -> None:
    """What a replica's key refresh reads after its first: the key events after a seq, in
    ledger order, which folded over the rows read before them give the rows as the ledger
    has them, and folded again over those rows change nothing."""
    high = await ledger.key_events_high()
    before = {k.name: k for k in await ledger.keys()}
    await ledger.create_key(created(f"{ns}-r1"))
    await ledger.set_limit(f"{ns}-other", 10)  # not a key event: not read
    await ledger.create_key(created(f"{ns}-r2"))
    await ledger.revoke_key(f"{ns}-r1")
    await ledger.create_key(created(f"{ns}-r1", root="team-b"))  # a revoked name made again
    events = await ledger.key_events_since(high)
    assert [(e.kind, e.data["name"]) for e in events] == [
        ("key.created", f"{ns}-r1"),
        ("key.created", f"{ns}-r2"),
        ("key.revoked", f"{ns}-r1"),
        ("key.created", f"{ns}-r1"),
    ]
    assert [e.seq for e in events] == sorted({e.seq for e in events})
    assert await ledger.key_events_high() == events[-1].seq
    assert await ledger.key_events_since(events[-1].seq) == []
    after = {k.name: k for k in await ledger.keys()}
    assert keys.folded(before, events) == after
    assert keys.folded(after, events) == after


def test_the_key_events_are_read_through_their_index(tmp_path: Path) -> None:
    """SQLite reads both key-event queries through ``events_keys`` (migration 20), not by
    a scan of every event: the queries' list of kinds is the index's, literally."""
    from effectguard.ledger.queries import SQLITE
    from effectguard.ledger.sqliteconnect import connect
    from effectguard.ledger.sqliteschema import migrate

    conn = connect(str(tmp_path / "ledger.db"))
    migrate(conn)
    for sql, params in ((SQLITE.key_events, (0,)), (SQLITE.key_events_high, ())):
        plan = " ".join(str(r[-1]) for r in conn.execute(f"EXPLAIN QUERY PLAN {sql}", params))
        assert "INDEX events_keys" in plan, plan
    conn.close()
