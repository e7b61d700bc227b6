"""PostgreSQL workers' host lock files: they do not pile up, and are never required.

Each PostgreSQL worker (each ``serve`` start, each transport, each ``reconcile`` that
takes a call over) flocks a file of its own in the user's runtime directory (contract
§7). A worker that stopped cleanly left its file behind, so one file stayed for ever per
start whose worker no sweeper on this host took over. And a directory where the file
could not be made (not writable, disk full) kept ``serve`` from starting at all, though
on PostgreSQL the lock only spares a restart the wait for the lease: it now starts,
with one warning, and its workers are known gone by their lease alone.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from pgkit import NEEDS_PG, pg_url
from test_reconcile_auto import SEND, email, upstreams

import effectguard
from effectguard.callpath import hostlocks
from effectguard.testing import fake_provider, start_proxy

pytestmark = [*NEEDS_PG]
_ = (pg_url,)  # fixtures


def runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A runtime directory of the user's own, set for this process and its children."""
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    return runtime


def lock_files(runtime: Path) -> list[str]:
    return sorted(p.name for p in (runtime / "effectguard").glob("pg-*/*.lock"))


def test_clean_stops_of_serve_and_transports_leave_no_lock_file(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = runtime_dir(tmp_path, monkeypatch)
    with fake_provider(tmp_path / "receipts.jsonl", idempotent=True) as fake:
        for n in range(3):
            proxy = start_proxy(pg_url, upstreams=upstreams(fake), log_path=tmp_path / "p.log")
            try:
                answer = httpx.post(proxy.url + SEND, json=email(f"{n}@x"), timeout=30)
                assert answer.status_code == 200, answer.text
                assert len(lock_files(runtime)) == 1, "a running serve holds its lock"
            finally:
                proxy.stop()
        for n in range(3):
            transport = effectguard.GuardTransport(
                ledger=pg_url, upstreams={"send_email": fake.url}
            )
            with httpx.Client(transport=transport) as client:
                answer = client.post(fake.url + "/v1/send", json=email(f"t{n}@x"), timeout=30)
                assert answer.status_code == 200, answer.text
        left = lock_files(runtime)
        assert left == [], f"{len(left)} lock files left after 6 clean stops: {left}"


def test_serve_starts_without_its_lock_file_and_says_so_once(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = runtime_dir(tmp_path, monkeypatch)
    (runtime / "effectguard").mkdir(mode=0o700)
    # A file where the per-boot directory should be: no lock file can be made in it
    # (root ignores permission bits, so a read-only directory would not do).
    (runtime / "effectguard" / f"pg-{hostlocks._boot()}").write_text("")
    log = tmp_path / "serve.log"
    with fake_provider(tmp_path / "receipts.jsonl", idempotent=True) as fake:
        proxy = start_proxy(pg_url, upstreams=upstreams(fake), log_path=log)
        try:
            answer = httpx.post(proxy.url + SEND, json=email("a@x"), timeout=30)
            assert answer.status_code == 200, answer.text
        finally:
            proxy.stop()
        assert len(fake.receipts()) == 1
    warnings = [line for line in log.read_text().splitlines() if "host_lock_unavailable" in line]
    assert len(warnings) == 1, log.read_text()[-3000:]
