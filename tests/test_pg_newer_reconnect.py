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

from pathlib import Path

import httpx
import psycopg
from pgkit import DSN, NEEDS_PG, pg_url, via
from test_pg_faults import CHAT, Relay, _chat, provider, relay

from effectguard.testing import FakeProvider, running_proxy

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
