"""A backup or an archive of a SQLite ledger is as private as the ledger.

The ledger file is created owner-only (0600, docs/contract.md §12) because it holds the
prompts, the answers and the uploads. ``effectguard backup`` and ``effectguard archive``
write files that hold the same (an archive holds the very bodies it takes out of the
ledger), so under a common umask (022) they must not come out readable by every local
user, as they did before (0644).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from effectguard.ops.cli import main
from effectguard.testing import fake_provider, running_proxy

pytestmark = pytest.mark.slow

CHAT = "/openai/v1/chat/completions"
SECRET = "the prompt only the ledger's owner may read"


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    """The process's umask set to ``mask`` for the block (operators' shells vary)."""
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path | str) -> int:
    """The permission bits of ``path``."""
    return stat.S_IMODE(os.stat(path).st_mode)


def test_backup_and_archive_files_are_owner_only_like_the_ledger(tmp_path: Path) -> None:
    """A call's prompt goes into the ledger; the backup and the archive file that carry it
    are 0600 like the ledger, under umask 022."""
    ledger = tmp_path / "ledger.db"
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": SECRET}]}
    with (
        umask(0o022),
        fake_provider(tmp_path / "receipts.jsonl") as fake,
        running_proxy(ledger, upstreams={"openai": fake.url}) as proxy,
    ):
        answer = httpx.post(proxy.url + CHAT, json={**body, "max_tokens": 8}, timeout=30)
        assert answer.status_code == 200, answer.text
        backup, archive = tmp_path / "copy.db", tmp_path / "archive.jsonl.gz"
        assert main(["backup", str(backup), "--ledger", str(ledger)]) == 0
        later = (dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)).isoformat()
        argv = ["archive", "--ledger", str(ledger), "--before", later, "--out", str(archive)]
        assert main(argv) == 0
    assert mode(ledger) == 0o600
    assert SECRET.encode() in backup.read_bytes()
    assert mode(backup) == 0o600
    assert archive.exists()
    assert mode(archive) == 0o600
