"""The crash matrix for spooled uploads (docs/contract.md §2.5, §3): real SIGKILLs at every
non-streaming crash point while a large multipart upload is in flight through the proxy.

A proxy with a small ``spool_body_bytes`` receives a keyed ``/v1/files`` upload well past
it and kills itself at the point; a fresh proxy on the same ledger and spool directory
receives the same upload again. Judged from the fake provider's own receipts (the SHA-256
of the exact bytes it received) and the ledger:

* the provider received the upload at most once, and exactly once where the kill came
  after dispatch; each receipt is covered by an earlier durable ``attempt.started`` of a
  call whose manifest names those very bytes by their SHA-256;
* the resend is a replay where the observation was durable, else 409 ``effect_unknown``;
* the killed process's spool file is gone once the fresh proxy has started;
* nothing is left in flight, and ``verify`` passes: the stored chunks of every upload
  hash to its manifest's digest.

The transport never spools (it gets the client's body in memory), so only the proxy runs.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
import uuid
from pathlib import Path

import httpx
import pytest
from test_crash_matrix import KILL_TIMEOUT, cli, cli_json, effect_problems

from effectguard.testing import FakeProvider, fake_provider, start_proxy

pytestmark = pytest.mark.slow

POINTS = ["after:admit", "after:dispatch", "after:upstream-response", "after:observe"]
DISPATCHED = {"after:dispatch", "after:upstream-response", "after:observe"}
SPOOL_OVER = 16 * 1024
BOUNDARY = "crashsp00l"


def upload_body(tag: str) -> bytes:
    """A ``/v1/files`` multipart body of about 96 KiB, unique to ``tag``."""
    content = tag.encode() + os.urandom(96 * 1024)
    return (
        (
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="f.bin"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        + content
        + f"\r\n--{BOUNDARY}--\r\n".encode()
    )


def send(url: str, body: bytes, key: str) -> httpx.Response | None:
    """POST the upload; None when the proxy died under it."""
    headers = {
        "Content-Type": f"multipart/form-data; boundary={BOUNDARY}",
        "Idempotency-Key": key,
    }
    try:
        return httpx.post(url + "/openai/v1/files", content=body, headers=headers, timeout=30)
    except httpx.HTTPError:
        return None


@pytest.mark.parametrize("point", POINTS)
def test_spooled_upload_survives_a_kill_at_every_point(tmp_path: Path, point: str) -> None:
    ledger, spool = tmp_path / "ledger.db", tmp_path / "spool"
    spool.mkdir()
    config = tmp_path / "config.toml"
    config.write_text(f'[server]\nspool_body_bytes = {SPOOL_OVER}\nspool_dir = "{spool}"\n')
    args = ["--config", str(config)]
    tag = f"{point}-{uuid.uuid4().hex[:8]}"
    body, key = upload_body(tag), f"key-{tag}"
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        upstreams = {"openai": fake.url}
        env = {"EFFECTGUARD_CRASH_AT": point}
        dying = start_proxy(ledger, upstreams=upstreams, args=args, env=env)
        try:
            first = send(dying.url, body, key)
            assert dying.process.wait(KILL_TIMEOUT) == -signal.SIGKILL, dying.log()
        finally:
            dying.kill()
        assert first is None or first.status_code >= 500, first
        left = list(spool.iterdir())
        assert len(left) == 1, "the killed proxy could not remove its spool file"
        aged = time.time() - 60  # past the sweep's grace for files still being created
        os.utime(left[0], (aged, aged))
        fresh = start_proxy(ledger, upstreams=upstreams, args=args)
        try:
            assert not any(spool.iterdir()), "the fresh proxy removes the dead one's file"
            again = send(fresh.url, body, key)
        finally:
            fresh.stop()
        assert again is not None and again.status_code != 500, fresh.log()
        _judge(point, again, ledger, fake, body)


def _judge(
    point: str, again: httpx.Response, ledger: Path, fake: FakeProvider, body: bytes
) -> None:
    (call,) = cli_json("calls", "--ledger", str(ledger))
    received = [r for r in fake.effects() if r["path"] == "/v1/files"]
    assert len(received) == (1 if point in DISPATCHED else 0), received
    if point == "after:observe":
        assert again.status_code == 200, again.text
        assert again.headers.get("effectguard-replayed") == "true"
    else:
        assert again.status_code == 409, again.text
        assert again.json()["error"]["type"] == "effect_unknown"
        assert call["stage"] == "effect_unknown"
    assert all(r["body_sha256"] == hashlib.sha256(body).hexdigest() for r in received)
    assert effect_problems(ledger, fake) == []
    # Uploads are priced at zero (openai.toml), so "charged in full" holds nothing here;
    # the chat matrix checks that. What is left: nothing in flight, and verify.
    assert cli_json("calls", "--ledger", str(ledger), "--state", "in_flight") == []
    code, out = cli("verify", "--ledger", str(ledger))
    assert code == 0, out
