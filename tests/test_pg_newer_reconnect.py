"""A running replica whose ledger a newer release migrated meanwhile, found out as its
writer reconnects, through a real ``effectguard serve``.

``serve`` refuses at start a ledger a newer release migrated (it would write beside that
release's rules), whether or not the migration raised the writer format. A replica
already running reconnects its writer after a failover or a restart of the server: it
used to skip that check then, and went on admitting and sending calls beside the newer
release. Now the reconnect refuses the ledger as the start does: every write is refused,
the client gets 503 ``ledger_unavailable`` (nothing sent) and the log says why.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psycopg
from pgkit import DSN, NEEDS_PG, pg_url, via
from test_pg_faults import (
    CHAT,
    Relay,
    _chat,
    _taken_over,
    _wait,
    provider,
    relay,
    relayed_beside_a_sweeper,
)

from effectguard.testing import FakeProvider, running_proxy
from effectguard.testing.fakebehaviour import BEHAVIOUR_HEADER

_ = (pg_url, provider, relay)  # fixtures

pytestmark = NEEDS_PG


def test_a_reconnect_to_a_ledger_a_newer_release_migrated_writes_nothing(
    pg_url: str, relay: Relay, provider: FakeProvider, tmp_path: Path
) -> None:
    with running_proxy(
        via(pg_url, relay.port),
        upstreams={"openai": provider.url},
        log_path=tmp_path / "proxy.log",
    ) as proxy:
        client = httpx.Client(base_url=proxy.url, timeout=60)
        body, headers = _chat("before")
        assert client.post(CHAT, json=body, headers=headers).status_code == 200
        schema = pg_url.rpartition("schema=")[2]
        with psycopg.connect(DSN, autocommit=True) as conn:
            conn.execute(f"INSERT INTO {schema}.migrations VALUES (9999, 'a later release', 0)")
        relay.cut_idle()  # a failover: the writer reconnects for its next batch
        body, headers = _chat("after")
        answer = client.post(CHAT, json=body, headers=headers)
        client.close()
        log = proxy.log()
    assert answer.status_code == 503, (answer.text, log)
    assert answer.json()["error"]["type"] == "ledger_unavailable"
    assert answer.headers["x-should-retry"] == "true"
    assert "newer effectguard (migration 9999" in answer.text, answer.text
    assert "migrated by a newer effectguard" in log, log
    assert len(provider.effects()) == 1  # the call before; nothing after


def _stage(url: str, key: str) -> str:
    """The stage of the call under idempotency key ``key``, as the ledger has it."""
    schema = url.rpartition("schema=")[2]
    with psycopg.connect(DSN) as conn:
        query = f"SELECT stage FROM {schema}.calls WHERE idempotency_key = %s"
        rows = conn.execute(query, (key,)).fetchall()
    return str(rows[0][0]) if rows else "none"


def _post_aside(client: httpx.Client, body: dict[str, Any], headers: dict[str, str]) -> None:
    """A call whose answer nobody waits for: the test ends (its client closed) first."""
    with contextlib.suppress(httpx.HTTPError):
        client.post(CHAT, json=body, headers=headers)


def test_a_replica_refusing_a_newer_ledger_lets_another_take_its_calls_over(
    pg_url: str, relay: Relay, provider: FakeProvider, tmp_path: Path
) -> None:
    """The replica whose writer refuses the ledger writes nothing more, so its call still in
    flight can never be recorded by it. Its lease used to be renewed all the same (on the
    heartbeat's own connection), and the call stayed ``in_flight`` until the replica was
    stopped. Now it stops renewing: its lease lapses, and the other replica's sweeper
    takes it over (``worker.taken_over``), the call ``effect_unknown`` (contract §7). The
    refused heartbeat is logged once when it starts and once when it ends."""
    with relayed_beside_a_sweeper(pg_url, relay, provider, tmp_path) as (refusing, client):
        body, headers = _chat("before")
        assert client.post(CHAT, json=body, headers=headers).status_code == 200
        body, headers = _chat("slow")
        headers[BEHAVIOUR_HEADER] = "delay=15"
        slow = threading.Thread(target=_post_aside, args=(client, body, headers), daemon=True)
        slow.start()
        _wait(lambda: len(provider.effects()) == 2, "the slow call sent")
        assert _stage(pg_url, "slow") == "in_flight"
        schema = pg_url.rpartition("schema=")[2]
        with psycopg.connect(DSN, autocommit=True) as conn:
            conn.execute(f"INSERT INTO {schema}.migrations VALUES (9999, 'a later release', 0)")
        relay.cut_idle()  # a failover: the writer reconnects for its next batch
        body, headers = _chat("after")
        assert client.post(CHAT, json=body, headers=headers).status_code == 503
        # Four leases: a lapsed lease is taken over within one lease and two sweeps. A
        # bound to wait out, well short of the slow call's answer, not a timing claim.
        deadline = time.monotonic() + 8.0
        while time.monotonic() < deadline and _stage(pg_url, "slow") == "in_flight":
            time.sleep(0.2)
        stage, taken = _stage(pg_url, "slow"), _taken_over(pg_url)
        log = refusing.log()
        assert stage == "effect_unknown", (stage, log)
        assert len(taken) == 1, taken
        assert len(provider.effects()) == 2  # nothing sent after the refusal
        # Seconds of refused heartbeats (every 0.5 s) are one line, not one each: it
        # used to be written at every heartbeat.
        assert log.count("ledger busy in heartbeat") == 1, log
        # The newer migration undone (an operator's rollback): the next reconnect takes the
        # ledger again, and the replica, fenced meanwhile, registers anew and serves.
        with psycopg.connect(DSN, autocommit=True) as conn:
            conn.execute(f"DELETE FROM {schema}.migrations WHERE version = 9999")
        relay.cut_idle()
        body, headers = _chat("again")
        _wait(
            lambda: client.post(CHAT, json=body, headers=headers).status_code == 200,
            "the replica serving again",
            bound_s=20,
        )
        # Its new registration's lease is renewed again: three leases later nothing more
        # was taken over (a bound to wait out, not a timing claim).
        time.sleep(6.0)
        log = refusing.log()
        assert len(_taken_over(pg_url)) == 1, log
        # ... and its end is said once too.
        assert log.count("ledger answers heartbeat again") == 1, log
    assert len(provider.effects()) == 3
