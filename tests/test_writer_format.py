"""A ledger refuses writes from a release older than the events it holds (writer format).

The release that made a resend's ``budget.held`` turn a call effect_unknown again also
made older releases unsafe beside it: they fold that call as ``not_processed`` and would
send it again, and their ``verify`` reports an honest ledger as BROKEN. An older release
ignores migrations it does not know, so nothing but the ledger itself can stop it. These
tests write as such a release does (a connection that declares no writer format: the
statements its registration, heartbeat and admissions run) and check that the migrated
ledger refuses each with a message that says to upgrade, while this release writes and
verifies as before (docs/operations.md, "Upgrades and migrations").
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import respx
from pgkit import DSN, ledger_url, pg_url
from test_store_contract import register
from toolkit import cli_run as run

from effectguard import AsyncGuardTransport, GuardTransport
from effectguard.errors import ConfigError
from effectguard.ledger import Ledger, open_store, writerformat
from effectguard.ledger.pgschema import Target

_ = (ledger_url, pg_url)  # fixtures

#: What an older release is told (part of the message, as its logs show it).
TOLD = f"requires effectguard writer format {writerformat.WRITER_FORMAT} or later"


def cli(command: str, ledger: str) -> None:
    """``effectguard COMMAND --ledger LEDGER``, as an operator runs it; it must exit 0."""
    done = run(command, "--ledger", ledger)
    assert done.returncode == 0, done.stdout + done.stderr


async def new_release_writes(ledger_url: str) -> None:
    """This release registers a worker (an event and a worker row) and verifies."""
    ledger = Ledger(open_store(ledger_url))
    await ledger.store.open()
    try:
        await register(ledger, "new-replica")
    finally:
        await ledger.store.close()
    cli("verify", ledger_url)


OLD_WRITES = [
    # An older replica starting: its worker row (and the event beside it).
    "INSERT INTO workers(worker, generation, host, pid, lease_expires, fenced) "
    "VALUES ('old-replica', 99, 'h', 1, 0, {false})",
    # An older replica already running: its heartbeat renews its lease.
    "UPDATE workers SET lease_expires = lease_expires + 30 WHERE worker = 'new-replica'",
]


async def test_an_older_release_cannot_write_a_migrated_sqlite_ledger(tmp_path: Path) -> None:
    path = str(tmp_path / "ledger.db")
    cli("migrate", path)
    await new_release_writes(path)
    old = sqlite3.connect(path, isolation_level=None)  # as a release before format 1 connects
    try:
        for statement in OLD_WRITES:
            with pytest.raises(sqlite3.OperationalError, match="effectguard_writer_format"):
                old.execute(statement.format(false=0))
        with pytest.raises(sqlite3.OperationalError, match="effectguard_writer_format"):
            old.execute("INSERT INTO events(seq, kind) SELECT max(seq) + 1, 0 FROM events")
    finally:
        old.close()
    cli("verify", path)  # nothing the refused writer tried got in


#: The formats before this release's, each refused by the migration that raised it past it.
OLDER_FORMATS = [1, 2, 3, 4, 5]


@pytest.mark.parametrize("declared", OLDER_FORMATS)
async def test_a_release_of_an_older_format_cannot_write_a_migrated_ledger(
    tmp_path: Path, declared: int
) -> None:
    """A release of writer format 1 neither records nor starts the rate window a
    declaration gives a node mid-minute (rate_windows.since, contract §5.6), so its writes
    would leave windows verify cannot re-derive: migration 18 refuses them. A release of
    format 2 cannot read an attempt.started that records where it was sent (sent_to,
    key_digest): migration 19 refuses it. A release of format 3 lets a [[keys]] entry whose
    ledger key was revoked spend, and believes usage far past a request's output cap:
    migration 21 refuses it. A release of format 4 counts a step back of the clock in a
    rate window without recording where (contract §5.6): migration 22 refuses it. A release
    of format 5 neither writes nor tracks the highest minute a rate window reached, so a
    window it starts over beside this one would not be the events' fold: migration 23
    refuses it. Each is told to upgrade."""
    path = str(tmp_path / "ledger.db")
    cli("migrate", path)
    await new_release_writes(path)
    old = sqlite3.connect(path, isolation_level=None)
    old.create_function(writerformat.FUNCTION, 0, lambda: declared, deterministic=True)
    try:
        for statement in OLD_WRITES:
            with pytest.raises(sqlite3.IntegrityError, match=TOLD):
                old.execute(statement.format(false=0))
    finally:
        old.close()
    cli("verify", path)


@pytest.mark.postgres
@pytest.mark.skipif(not DSN, reason="set EFFECTGUARD_TEST_PG_DSN to run the PostgreSQL tests")
async def test_an_older_release_cannot_write_a_migrated_postgres_ledger(pg_url: str) -> None:
    import psycopg

    cli("migrate", pg_url)
    await new_release_writes(pg_url)
    target = Target.parse(pg_url)
    # As a release before format 1 connects: its schema, no writer format declared.
    with psycopg.connect(target.conninfo, autocommit=True) as old:
        old.execute(f"SET search_path = {target.schema}")
        for statement in [
            *OLD_WRITES,
            "INSERT INTO events(seq, kind, call_id, data, worker, generation, at, "
            "prev_digest, digest) VALUES (999999, 'worker.registered', NULL, '{}', "
            "'old-replica', 99, 0, '', '')".replace("{}", "{{}}"),
        ]:
            with pytest.raises(psycopg.errors.RaiseException, match=TOLD):
                old.execute(statement.format(false="false"))
    cli("verify", pg_url)


@pytest.mark.postgres
@pytest.mark.skipif(not DSN, reason="set EFFECTGUARD_TEST_PG_DSN to run the PostgreSQL tests")
@pytest.mark.parametrize("declared", OLDER_FORMATS)
async def test_a_release_of_an_older_format_cannot_write_a_migrated_postgres_ledger(
    pg_url: str, declared: int
) -> None:
    """As on SQLite: a connection declaring an older format (PostgreSQL migrations 11, 12,
    14, 15 and 16 raised it past 1, 2, 3, 4 and 5) is refused each write, and told to
    upgrade."""
    import psycopg

    cli("migrate", pg_url)
    await new_release_writes(pg_url)
    target = Target.parse(pg_url)
    with psycopg.connect(target.conninfo, autocommit=True) as old:
        old.execute(f"SET search_path = {target.schema}")
        old.execute(f"SET {writerformat.SETTING} = '{declared}'")
        for statement in OLD_WRITES:
            with pytest.raises(psycopg.errors.RaiseException, match=TOLD):
                old.execute(statement.format(false="false"))
    cli("verify", pg_url)


async def test_a_format_3_transport_sends_nothing_through_a_ledger_at_format_4(
    ledger_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A release of format 3 started beside this one served by its own rules: a
    ``[[keys]]`` entry whose ledger key was revoked still spent there, and usage far past a
    request's output cap was believed (migration 20 raised no format). From SQLite's
    migration 21 (PostgreSQL's 14) it fails at start-up: this release's transport,
    declaring format 3 as that release does, sends nothing and is told to upgrade."""
    cli("migrate", ledger_url)
    monkeypatch.setattr(writerformat, "WRITER_FORMAT", 3)  # every connection declares 3
    with respx.mock(assert_all_called=False) as mock:
        route = mock.post("https://api.openai.com/v1/chat/completions").mock(
            return_value=httpx.Response(200, json={"choices": []})
        )
        transport = AsyncGuardTransport(ledger=ledger_url)
        async with httpx.AsyncClient(transport=transport, timeout=30) as client:
            with pytest.raises(Exception, match=TOLD) as refused:
                await client.post(
                    "https://api.openai.com/v1/chat/completions",
                    json={"model": "gpt-4o-mini", "messages": [], "max_tokens": 5},
                )
        assert not route.called, refused.value
    monkeypatch.undo()
    cli("verify", ledger_url)


def _as_before_format_1(path: str) -> None:
    """Make a migrated SQLite ledger what the previous release left: no migration 15."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        for trigger in writerformat.sqlite_require(1)[::2]:  # the DROP TRIGGER statements
            conn.execute(trigger)
        conn.execute("DELETE FROM migrations WHERE version = 15")
    finally:
        conn.close()


def _older_ledger(tmp_path: Path) -> str:
    """A SQLite ledger under ``tmp_path`` as the previous release left it migrated."""
    path = str(tmp_path / "ledger.db")
    cli("migrate", path)
    _as_before_format_1(path)
    return path


def _versions(path: str) -> set[int]:
    conn = sqlite3.connect(path)
    try:
        return {row[0] for row in conn.execute("SELECT version FROM migrations")}
    finally:
        conn.close()


# Not the commands that only read (verify, calls, show, budgets): they read a migrated
# copy of such a ledger (tests/test_verify_older_ledger.py, tests/test_read_older_ledger.py).
@pytest.mark.parametrize(
    "command",
    [
        ["budget", "set", "team", "--limit", "5"],
        ["reconcile", "call_x", "--not-applied", "--note", "checked"],
    ],
)
def test_a_command_does_not_migrate_a_ledger_on_the_side(
    tmp_path: Path, command: list[str]
) -> None:
    """An operator tries this release's CLI on the ledger an older fleet still serves. It
    used to migrate it (every command opens a store, and opening one migrates), which now
    locks every older replica out at once. A command that changes the ledger is refused,
    exit 2, naming `migrate`, and the ledger is left as it was; after `effectguard migrate`
    the command runs."""
    path = _older_ledger(tmp_path)
    done = run(*command, "--ledger", path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "migration 15 pending" in done.stderr and "effectguard migrate" in done.stderr
    assert 15 not in _versions(path)
    cli("migrate", path)
    cli("verify", path)


@pytest.mark.parametrize("command", [["calls"], ["budgets"], ["show", "call_x"]])
def test_a_command_that_only_reads_leaves_an_older_ledger_as_it_was(
    tmp_path: Path, command: list[str]
) -> None:
    """The same ledger read by a command that only reads: it reads a migrated copy, and
    the ledger the older fleet serves keeps its migrations (exit 3 for `show`: no such call)."""
    path = _older_ledger(tmp_path)
    done = run(*command, "--ledger", path)
    assert done.returncode == (3 if command[0] == "show" else 0), done.stdout + done.stderr
    assert "migration 15" in done.stderr and "reading a copy" in done.stderr, done.stderr
    assert 15 not in _versions(path)


def test_a_ledger_a_newer_release_migrated_is_refused_by_commands(tmp_path: Path) -> None:
    """This release would misread what a newer one writes: its commands say so, exit 2."""
    path = str(tmp_path / "ledger.db")
    cli("migrate", path)
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("INSERT INTO migrations VALUES (99, 'a later release', 0)")
    finally:
        conn.close()
    done = run("calls", "--ledger", path)
    assert done.returncode == 2 and "newer effectguard" in done.stderr, done.stderr


def test_the_backup_before_an_upgrade_copies_the_older_ledger(tmp_path: Path) -> None:
    """Step 1 of an upgrade, with the new release installed: `backup` copies the older
    ledger as it is (it migrates nothing, so it is not refused as the others are)."""
    path = _older_ledger(tmp_path)
    copy = tmp_path / "copy.db"
    done = run("backup", "--ledger", path, str(copy))
    assert done.returncode == 0, done.stdout + done.stderr
    assert 15 not in _versions(str(copy)) and 15 not in _versions(path)


@pytest.mark.parametrize("command", [["migrate"], ["serve", "--port", "0"]])
def test_serve_and_migrate_refuse_a_ledger_a_newer_release_migrated(
    tmp_path: Path, command: list[str]
) -> None:
    """A rollback: this release started on a ledger a later one migrated. `migrate` said
    `up to date at migration 99; nothing applied` (exit 0) and `serve` listened and wrote
    beside the later release's rules wherever that migration raised no writer format (and
    failed with a traceback, exit 3, where it did). Both refuse it, exit 2, writing nothing."""
    path = str(tmp_path / "ledger.db")
    cli("migrate", path)
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("INSERT INTO migrations VALUES (99, 'a later release', 0)")
        before = conn.execute("SELECT count(*), coalesce(max(seq), 0) FROM events").fetchone()
    finally:
        conn.close()
    proc = subprocess.Popen(
        [sys.executable, "-m", "effectguard", *command, "--ledger", path],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    assert proc.returncode == 2, out + err
    assert "newer effectguard" in err and "migration 99" in err, err
    conn = sqlite3.connect(path)
    try:
        after = conn.execute("SELECT count(*), coalesce(max(seq), 0) FROM events").fetchone()
    finally:
        conn.close()
    assert after == before


def _as_migrated_by_a_newer_release(path: str) -> tuple[int, int]:
    """Mark a migrated SQLite ledger as a later release left it (migration 99); its events'
    count and last seq, to show later that nothing was written."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("INSERT INTO migrations VALUES (99, 'a later release', 0)")
        return conn.execute("SELECT count(*), coalesce(max(seq), 0) FROM events").fetchone()
    finally:
        conn.close()


def _events(path: str) -> tuple[int, int]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT count(*), coalesce(max(seq), 0) FROM events").fetchone()
    finally:
        conn.close()


CHAT = "https://api.openai.com/v1/chat/completions"
CHAT_BODY = {"model": "gpt-4o-mini", "messages": [], "max_tokens": 5}
NEWER = r"was migrated by a newer effectguard \(migration 99 "


async def test_the_async_transport_refuses_a_ledger_a_newer_release_migrated(
    tmp_path: Path,
) -> None:
    """A rollback in-process: the transport's first call on a ledger a later release
    migrated raises ConfigError naming the newer release, as serve and migrate refuse it;
    nothing is sent, nothing written, and the ledger keeps the later release's migrations."""
    path = str(tmp_path / "ledger.db")
    cli("migrate", path)
    before = _as_migrated_by_a_newer_release(path)
    with respx.mock(assert_all_called=False) as mock:
        route = mock.post(CHAT).mock(return_value=httpx.Response(200, json={"choices": []}))
        transport = AsyncGuardTransport(ledger=path)
        async with httpx.AsyncClient(transport=transport, timeout=30) as client:
            with pytest.raises(ConfigError, match=NEWER):
                await client.post(CHAT, json=CHAT_BODY)
        assert not route.called
    assert _events(path) == before and 99 in _versions(path)


def test_the_sync_transport_refuses_a_ledger_a_newer_release_migrated(tmp_path: Path) -> None:
    """The same through GuardTransport (its own loop and threads)."""
    path = str(tmp_path / "ledger.db")
    cli("migrate", path)
    before = _as_migrated_by_a_newer_release(path)
    with respx.mock(assert_all_called=False) as mock:
        route = mock.post(CHAT).mock(return_value=httpx.Response(200, json={"choices": []}))
        with (
            httpx.Client(transport=GuardTransport(ledger=path), timeout=30) as client,
            pytest.raises(ConfigError, match=NEWER),
        ):
            client.post(CHAT, json=CHAT_BODY)
        assert not route.called
    assert _events(path) == before and 99 in _versions(path)


async def test_the_transport_refuses_a_postgres_ledger_a_newer_release_migrated(
    pg_url: str,
) -> None:
    """PostgreSQL's store refuses it the same way at the transport's first call."""
    cli("migrate", pg_url)
    conn = Target.parse(pg_url).connect()
    try:
        conn.execute("INSERT INTO migrations VALUES (99, 'a later release', 0)")
        conn.commit()
        before = conn.execute("SELECT count(*), coalesce(max(seq), 0) FROM events").fetchone()
    finally:
        conn.close()
    with respx.mock(assert_all_called=False) as mock:
        route = mock.post(CHAT).mock(return_value=httpx.Response(200, json={"choices": []}))
        transport = AsyncGuardTransport(ledger=pg_url)
        async with httpx.AsyncClient(transport=transport, timeout=30) as client:
            with pytest.raises(ConfigError, match=NEWER):
                await client.post(CHAT, json=CHAT_BODY)
        assert not route.called
    conn = Target.parse(pg_url).connect()
    try:
        after = conn.execute("SELECT count(*), coalesce(max(seq), 0) FROM events").fetchone()
    finally:
        conn.close()
    assert after == before
