"""Large multipart uploads are spooled to a file, stored by reference and sent from the file
(issue #14, part 5: "a large multipart body is spooled to disk rather than held in memory").

One real ``effectguard serve`` with ``spool_body_bytes = 16 KiB`` (so a 64 KiB upload is
"large") and its own ``spool_dir``, in front of the real fake provider. The provider's
receipts say what it received; the spool directory must be empty after every request,
whatever became of it.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web

from effectguard.testing import FakeProvider, Proxy, fake_provider, running_proxy
from effectguard_bench import uploadmemory

SPOOL_OVER = 16 * 1024
MAX_BODY = 256 * 1024
BOUNDARY = "sp00l"


class Env:
    """The module's proxy, fake provider, spool directory and client."""

    def __init__(self, proxy: Proxy, provider: FakeProvider, spool: Path) -> None:
        self.proxy = proxy
        self.provider = provider
        self.spool = spool
        self.http = httpx.Client(base_url=proxy.url, timeout=10)

    def receipts(self) -> list[dict[str, Any]]:
        """The provider's own receipts of uploads."""
        return [r for r in self.provider.receipts() if r["path"] == "/v1/files"]

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """An ``effectguard`` command on the proxy's ledger."""
        command = [sys.executable, "-m", "effectguard", *args, "--ledger", self.proxy.ledger]
        return subprocess.run(command, capture_output=True, text=True, timeout=60)

    def spool_is_empty(self) -> bool:
        """Whether every spool file is gone (waiting a little for a request's cleanup)."""
        deadline = time.monotonic() + 5
        while any(self.spool.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return not any(self.spool.iterdir())


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("spooled")
    spool = tmp / "spool"
    spool.mkdir()
    config = tmp / "config.toml"
    config.write_text(
        f"[server]\nmax_body_bytes = {MAX_BODY}\nspool_body_bytes = {SPOOL_OVER}\n"
        f'spool_dir = "{spool}"\n'
    )
    with (
        fake_provider(tmp / "receipts.jsonl") as provider,
        running_proxy(
            tmp / "ledger.db", upstreams={"openai": provider.url}, args=["--config", str(config)]
        ) as proxy,
    ):
        environment = Env(proxy, provider, spool)
        try:
            yield environment
        finally:
            environment.http.close()


def multipart(content: bytes, preamble: bytes = b"") -> bytes:
    """A ``/v1/files`` body with one file part; a preamble (ignored, RFC 2046) pads it."""
    return (
        (preamble + b"\r\n" if preamble else b"")
        + f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="a.bin"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n".encode()
        + content
        + f"\r\n--{BOUNDARY}--\r\n".encode()
    )


def post(env: Env, body: bytes, key: str) -> httpx.Response:
    headers = {
        "Content-Type": f"multipart/form-data; boundary={BOUNDARY}",
        "Idempotency-Key": key,
    }
    return env.http.post("/openai/v1/files", content=body, headers=headers)


def manifest(env: Env, call_id: str) -> dict[str, Any]:
    """The call's ``call.manifest`` event data, from ``effectguard show --json``."""
    done = env.cli("show", call_id, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    events = json.loads(done.stdout)["events"]
    (found,) = [e for e in events if e["kind"] == "call.manifest"]
    data: dict[str, Any] = found["data"]
    return data


@pytest.mark.slow
def test_sdk_upload_over_the_threshold_is_spooled_stored_by_reference_and_sent_exact(
    env: Env,
) -> None:
    """The openai SDK uploads 64 KiB: the provider receives the exact bytes once, the
    manifest names them by SHA-256, ``verify`` passes and no spool file is left."""
    content = os.urandom(64 * 1024)
    client = openai.OpenAI(
        api_key="sk-test",
        base_url=env.proxy.url + "/openai/v1",
        default_headers={"Idempotency-Key": "sdk-big"},
        max_retries=0,
    )
    request = env.http.build_request(
        "POST",
        "/openai/v1/files",
        data={"purpose": "batch"},
        files={"file": ("big.bin", content, "application/octet-stream")},
        headers={"Idempotency-Key": "raw-big"},
    )
    sent = request.read()
    response = env.http.send(request)
    assert response.status_code == 200, response.text
    assert response.json()["bytes"] == len(content)
    receipt = env.receipts()[-1]
    assert receipt["body_sha256"] == hashlib.sha256(sent).hexdigest()
    data = manifest(env, response.headers["effectguard-call-id"])
    assert data["body_encoding"] == "sha256"
    created = client.files.create(file=("sdk.bin", content), purpose="batch")
    again = client.files.create(file=("sdk.bin", content), purpose="batch")
    assert again.id == created.id and created.bytes == len(content)
    verified = env.cli("verify")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert env.spool_is_empty()


@pytest.mark.slow
def test_spooled_and_in_memory_bodies_of_the_same_parts_are_one_request(env: Env) -> None:
    """A body under the threshold and the same parts behind a preamble that pushes it over
    hash alike: the second is a replay of the first, not a 422 or a second upload."""
    content = os.urandom(1024)
    small = multipart(content)
    padded = multipart(content, preamble=b"p" * (SPOOL_OVER * 2))
    assert len(small) < SPOOL_OVER < len(padded)
    first = post(env, small, "same-parts")
    second = post(env, padded, "same-parts")
    assert (first.status_code, second.status_code) == (200, 200)
    assert second.headers["effectguard-call-id"] == first.headers["effectguard-call-id"]
    assert manifest(env, first.headers["effectguard-call-id"])["body_encoding"] != "sha256"
    other = post(env, multipart(os.urandom(1024), preamble=b"p" * (SPOOL_OVER * 2)), "same-parts")
    assert other.status_code == 422
    assert env.spool_is_empty()


@pytest.mark.slow
def test_malformed_spooled_upload_is_400_never_sent_and_its_file_removed(env: Env) -> None:
    """A spooled body is parsed from its file: bad framing is 400, sent nowhere, removed."""
    before = len(env.receipts())
    body = multipart(os.urandom(SPOOL_OVER * 2))[:-8]  # the final boundary cut off
    response = post(env, body, "malformed-big")
    assert response.status_code == 400
    assert "final boundary" in response.json()["error"]["message"]
    assert len(env.receipts()) == before
    assert env.spool_is_empty()


@pytest.mark.slow
def test_upload_over_max_body_bytes_while_spooling_is_413_and_its_file_removed(
    env: Env,
) -> None:
    """Without a Content-Length the cap is met while spooling: 413, nothing sent or kept."""
    before = len(env.receipts())
    body = multipart(os.urandom(MAX_BODY))

    def chunks() -> Iterator[bytes]:  # no Content-Length: the proxy finds out while reading
        for at in range(0, len(body), 8192):
            yield body[at : at + 8192]

    headers = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
    response = env.http.post("/openai/v1/files", content=chunks(), headers=headers)
    assert response.status_code == 413
    assert len(env.receipts()) == before
    assert env.spool_is_empty()


@pytest.mark.slow
def test_client_gone_mid_upload_leaves_no_spool_file_and_no_effect(env: Env) -> None:
    """A body past the threshold goes to a file while it arrives; when the client goes
    away mid-body the file is removed, nothing is sent, and the proxy serves on."""
    before = len(env.receipts())
    host, port = env.proxy.url.removeprefix("http://").split(":")
    head = (
        "POST /openai/v1/files HTTP/1.1\r\nHost: x\r\n"
        f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n"
        f"Content-Length: {MAX_BODY}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head + multipart(os.urandom(SPOOL_OVER * 3))[: SPOOL_OVER * 2])
        deadline = time.monotonic() + 5
        while not any(env.spool.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.02)
        spooling = [p.name for p in env.spool.iterdir()]
    assert len(spooling) == 1, "the body past the threshold is written to a file as it comes"
    assert env.spool_is_empty()
    assert len(env.receipts()) == before
    assert env.http.get("/healthz").status_code == 200


# -- memory, in this process (no server) ----------------------------------------------


@pytest.mark.parametrize("spooled", [True, False])
async def test_a_spooled_upload_never_holds_its_body_in_the_heap(
    tmp_path: Path, spooled: bool
) -> None:
    """Reading, parsing, hashing, sealing the manifest of and storing a 4 MiB upload
    spooled past 64 KiB peaks under 1 MiB of Python heap at every step; held in memory
    (the control), the same steps peak above its size."""
    size = 4 * 2**20
    spool = tmp_path / "spool"
    spool.mkdir()
    steps = await uploadmemory.measure(
        size,
        spool_over=64 * 1024 if spooled else None,
        spool_dir=str(spool),
        ledger=str(tmp_path / "ledger.db"),
    )
    assert len(steps) == 4, "the fourth step stores the body in the ledger"
    peak = max(step[2] for step in steps)
    if spooled:
        assert peak < 2**20, steps
    else:
        assert peak > size, steps
    assert not any(spool.iterdir()), "the spool file is removed"


@pytest.mark.slow
def test_start_up_removes_only_spool_files_nobody_holds(tmp_path: Path) -> None:
    """A proxy killed mid-upload leaves its spool file behind, unlocked; the next one to
    start removes it. It never removes a file a live process holds locked (a replica
    sharing the directory, whatever its pid namespace), a file younger than the grace
    period, a directory, or anything that is not a spool file, and such odd entries
    never stop it from starting."""
    spool = tmp_path / "spool"
    spool.mkdir()
    old = time.time() - 60
    dead = spool / "effectguard-body-99999999999999999999-abc"  # no such pid, unlocked
    live = spool / f"effectguard-body-{os.getpid()}-def"
    young = spool / "effectguard-body-1-young"
    other = spool / "notes.txt"
    folder = spool / "effectguard-body-2-dir"
    for path in (dead, live, young, other):
        path.write_bytes(b"x")
    folder.mkdir()
    for path in (dead, live, other, folder):
        os.utime(path, (old, old))
    config = tmp_path / "config.toml"
    config.write_text(f'[server]\nspool_dir = "{spool}"\n')
    with open(live, "rb") as holder:
        fcntl.flock(holder.fileno(), fcntl.LOCK_EX)  # as a live request holds its file
        with running_proxy(tmp_path / "ledger.db", args=["--config", str(config)]) as proxy:
            assert httpx.get(proxy.url + "/healthz").status_code == 200
    assert sorted(p.name for p in spool.iterdir()) == sorted(
        [live.name, young.name, other.name, folder.name]
    )
    assert "removed 1 upload spool files" in proxy.log()


@pytest.mark.slow
def test_an_upstream_that_answers_before_reading_the_upload_still_gets_all_of_it(
    tmp_path: Path,
) -> None:
    """An upstream may start its answer before it has read the upload (streaming progress,
    a front end answering early): the proxy keeps sending the spooled file until the end,
    the upstream receives every byte, and the call completes (before the fix the file was
    closed under aiohttp's writer when the answer's head came, and the call hung)."""
    received: list[str] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        answer = web.StreamResponse(status=200, headers={"content-type": "application/json"})
        await answer.prepare(request)  # the answer's head first, then the upload
        body = await request.read()
        received.append(hashlib.sha256(body).hexdigest())
        await answer.write(json.dumps({"id": "file-1", "bytes": len(body)}).encode())
        await answer.write_eof()
        return answer

    port = _serve_in_thread(handler)
    spool = tmp_path / "spool"
    spool.mkdir()
    config = tmp_path / "config.toml"
    config.write_text(f'[server]\nspool_body_bytes = {SPOOL_OVER}\nspool_dir = "{spool}"\n')
    body = multipart(os.urandom(2 * 2**20))
    upstreams = {"openai": f"http://127.0.0.1:{port}"}
    args = ["--config", str(config)]
    with running_proxy(tmp_path / "ledger.db", upstreams=upstreams, args=args) as proxy:
        headers = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
        answer = httpx.post(
            proxy.url + "/openai/v1/files", content=body, headers=headers, timeout=20
        )
    assert answer.status_code == 200, answer.text
    assert answer.json()["bytes"] == len(body)
    assert received == [hashlib.sha256(body).hexdigest()]
    assert not any(spool.iterdir())


def _serve_in_thread(handler: Any) -> int:
    """An aiohttp server with one POST /v1/files route, on its own loop in a thread."""
    loop = asyncio.new_event_loop()

    async def start() -> int:
        app = web.Application(client_max_size=2**30)
        app.router.add_post("/v1/files", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return int(runner.addresses[0][1])

    port = loop.run_until_complete(start())
    threading.Thread(target=loop.run_forever, daemon=True).start()
    return port
