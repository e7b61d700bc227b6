"""Form-encoded and multipart/form-data bodies are guarded, not refused (issue #14, part 5).

One real ``effectguard serve`` (``max_body_bytes = 64 KiB``) in front of the real fake
provider, driven by the real openai SDK (``files.create``, ``audio.transcriptions.create``,
``batches.create``) and by raw HTTP for what an SDK never sends (malformed framing, a
Stripe-like form). The provider's own receipts count the effects.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import httpx
import openai
import pytest

from effectguard.testing import FakeProvider, Proxy, fake_provider, running_proxy

pytestmark = pytest.mark.slow

MAX_BODY = 64 * 1024
CHARGES = """
name = "charges"
base_url = "http://127.0.0.1:9"
dialect = "flat"
prices_taken = "2026-12-01"

[[endpoints]]
path = "/v1/charges"
effect = "at_most_once"
op_id = { form = "metadata[effectguard_op]" }

[[endpoints]]
path = "/v1/upload"
effect = "at_most_once"
op_id = { form = "metadata[effectguard_op]" }

[models.default]
per_call = "0.01"
max_output_tokens = 0
"""


class Env:
    """The module's proxy, fake provider and clients."""

    def __init__(self, proxy: Proxy, provider: FakeProvider) -> None:
        self.proxy = proxy
        self.provider = provider
        self.http = httpx.Client(base_url=proxy.url, timeout=10)

    def sdk(self, key: str | None = None) -> openai.OpenAI:
        """The openai SDK through the proxy, sending ``key`` as Idempotency-Key."""
        headers = {"Idempotency-Key": key} if key else {}
        return openai.OpenAI(
            api_key="sk-test", base_url=self.proxy.url + "/openai/v1", default_headers=headers
        )

    def receipts(self, path: str) -> list[dict[str, Any]]:
        """The provider's own receipts of effects on ``path``."""
        return [r for r in self.provider.receipts() if r["path"] == path]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """One proxy for the module, in front of the fake provider."""
    tmp = tmp_path_factory.mktemp("bodies")
    declarations = tmp / "providers"
    declarations.mkdir()
    (declarations / "charges.toml").write_text(CHARGES)
    config = tmp / "config.toml"
    config.write_text(f"[server]\nmax_body_bytes = {MAX_BODY}\n")
    with (
        fake_provider(tmp / "receipts.jsonl") as provider,
        running_proxy(
            tmp / "ledger.db",
            upstreams={"openai": provider.url, "charges": provider.url},
            args=["--config", str(config), "--providers", str(declarations)],
        ) as proxy,
    ):
        environment = Env(proxy, provider)
        try:
            yield environment
        finally:
            environment.http.close()


def show(env: Env, call_id: str) -> dict[str, Any]:
    """``effectguard show CALL --json`` (the real command)."""
    command = [sys.executable, "-m", "effectguard", "show", call_id, "--json"]
    done = subprocess.run(
        [*command, "--ledger", env.proxy.ledger],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    shown: dict[str, Any] = json.loads(done.stdout)
    return shown.get("call", shown)


def upload(env: Env, key: str, content: bytes) -> Any:
    """``client.files.create`` through the proxy, with its raw response."""
    files = env.sdk(key).files.with_raw_response
    return files.create(file=("batch.jsonl", content, "application/jsonl"), purpose="batch")


def test_sdk_file_upload_is_guarded_priced_and_received_once(env: Env) -> None:
    """files.create through the proxy: 200, one receipt, a completed call charged per call."""
    before = len(env.receipts("/v1/files"))
    raw = upload(env, "upload-1", b'{"custom_id": "a"}\n')
    assert raw.status_code == 200
    created = raw.parse()
    assert created.object == "file" and created.filename == "batch.jsonl"
    assert len(env.receipts("/v1/files")) == before + 1
    call = show(env, raw.headers["effectguard-call-id"])
    assert call["stage"] == "completed"
    assert Decimal(call["cost_usd"]) == 0  # the bundled per_call price of an upload


def test_identical_upload_replays_and_different_content_is_422(env: Env) -> None:
    """Same key and bytes replay without a second receipt; same key, other file: 422."""
    first = upload(env, "upload-2", b'{"custom_id": "b"}\n')
    before = len(env.receipts("/v1/files"))
    again = upload(env, "upload-2", b'{"custom_id": "b"}\n')
    assert again.status_code == 200
    assert again.headers["effectguard-call-id"] == first.headers["effectguard-call-id"]
    assert again.parse().id == first.parse().id
    assert len(env.receipts("/v1/files")) == before
    with pytest.raises(openai.UnprocessableEntityError):
        upload(env, "upload-2", b'{"custom_id": "c"}\n')
    assert len(env.receipts("/v1/files")) == before


def test_sdk_transcription_is_priced_by_its_model(env: Env) -> None:
    """audio.transcriptions.create (whisper-1): completed at whisper-1's per-call price,
    received exactly once (the module's provider is shared: new receipts are counted)."""
    before = len(env.receipts("/v1/audio/transcriptions"))
    client = env.sdk("transcribe-1").audio.transcriptions.with_raw_response
    raw = client.create(model="whisper-1", file=("a.wav", b"RIFF" + bytes(256), "audio/wav"))
    assert raw.status_code == 200
    assert raw.parse().text.startswith("fake transcript")
    call = show(env, raw.headers["effectguard-call-id"])
    assert call["stage"] == "completed"
    assert Decimal(call["cost_usd"]) == Decimal("0.006")  # one minute of whisper-1
    assert len(env.receipts("/v1/audio/transcriptions")) == before + 1


def test_sdk_transcription_with_usage_is_priced_from_the_answers_usage(env: Env) -> None:
    """audio.transcriptions.create (gpt-4o-transcribe): the fake answers with token usage,
    as OpenAI does; the call settles at that usage at the declared prices (audio input 6,
    output 10 USD per million), not at its reservation, and is received exactly once."""
    before = len(env.receipts("/v1/audio/transcriptions"))
    client = env.sdk("transcribe-4o").audio.transcriptions.with_raw_response
    audio = ("a.wav", b"RIFF" + bytes(16_000), "audio/wav")
    raw = client.create(model="gpt-4o-transcribe", file=audio)
    assert raw.status_code == 200
    usage = json.loads(raw.content)["usage"]
    assert (usage["input_tokens"], usage["output_tokens"]) == (1000, 6)
    call = show(env, raw.headers["effectguard-call-id"])
    assert call["stage"] == "completed" and not call.get("flagged"), call
    expected = (Decimal(1000) * Decimal("6.00") + Decimal(6) * Decimal("10.00")) / 10**6
    assert Decimal(call["cost_usd"]) == expected  # 0.00606: not the 0.02 reservation
    assert len(env.receipts("/v1/audio/transcriptions")) == before + 1


def test_batch_creation_is_recorded_at_zero_and_flagged_deferred(env: Env) -> None:
    """batches.create: completed at 0 USD, flagged: the batch's own cost is billed later."""
    raw = env.sdk("batch-1").batches.with_raw_response.create(
        input_file_id="file-fake1", endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert raw.status_code == 200
    call = show(env, raw.headers["effectguard-call-id"])
    assert (call["stage"], Decimal(call["cost_usd"])) == ("completed", 0)
    assert "cost deferred" in call["flagged"]


def test_multipart_hash_ignores_boundary_but_not_part_headers(env: Env) -> None:
    """Same parts under another boundary replay; another filename is another request (422)."""

    def send(boundary: str, filename: str) -> httpx.Response:
        body = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
            f'filename="{filename}"\r\nContent-Type: application/jsonl\r\n\r\n'
            f"{{}}\n\r\n--{boundary}--\r\n"
        ).encode()
        headers = {
            "Content-Type": f"multipart/form-data; boundary={boundary}",
            "Idempotency-Key": "boundary-1",
        }
        return env.http.post("/openai/v1/files", content=body, headers=headers)

    first = send("aaa", "x.jsonl")
    assert first.status_code == 200
    before = len(env.receipts("/v1/files"))
    again = send("bbb", "x.jsonl")
    assert again.status_code == 200
    assert again.headers["effectguard-call-id"] == first.headers["effectguard-call-id"]
    assert send("ccc", "y.jsonl").status_code == 422
    assert len(env.receipts("/v1/files")) == before


@pytest.mark.parametrize(
    "body",
    [
        b'--b\r\nContent-Disposition: form-data; name="file"\r\n\r\nno closing boundary',
        b"no boundary at all",
        b"--b\r\nContent-Type: text/plain\r\n\r\nx\r\n--b--\r\n",  # no form-data name
    ],
)
def test_malformed_multipart_is_400_and_never_sent(env: Env, body: bytes) -> None:
    """Multipart framing that does not parse is refused 400 invalid_request, nothing sent."""
    before = len(env.provider.receipts())
    response = env.http.post(
        "/openai/v1/files",
        content=body,
        headers={"Content-Type": "multipart/form-data; boundary=b"},
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request"
    assert len(env.provider.receipts()) == before


def test_multipart_over_max_body_bytes_is_413_and_never_sent(env: Env) -> None:
    """An upload bigger than max_body_bytes is refused 413 while it is read, nothing sent."""
    before = len(env.provider.receipts())
    with pytest.raises(openai.APIStatusError) as refused:
        upload(env, "too-big", b"x" * (MAX_BODY + 1))
    assert refused.value.status_code == 413
    assert len(env.provider.receipts()) == before


def test_form_body_is_guarded_and_carries_the_operation_id(env: Env) -> None:
    """A Stripe-like form POST: 200, the call id in the declared form field, hashed by fields."""
    form = {"amount": "500", "currency": "usd"}
    headers = {"Idempotency-Key": "charge-1"}
    first = env.http.post("/charges/v1/charges", data=form, headers=headers)
    assert first.status_code == 200
    call_id = first.headers["effectguard-call-id"]
    assert first.json()["metadata"] == {"effectguard_op": call_id}
    (receipt,) = env.receipts("/v1/charges")
    assert receipt["op"] == call_id
    # The same fields, percent-encoded differently, are the same request: replayed.
    same = env.http.post(
        "/charges/v1/charges",
        content=b"amount=%35%30%30&currency=usd",
        headers={**headers, "Content-Type": "application/x-www-form-urlencoded"},
    )
    assert same.headers["effectguard-call-id"] == call_id
    assert len(env.receipts("/v1/charges")) == 1
    other = env.http.post("/charges/v1/charges", data={**form, "amount": "600"}, headers=headers)
    assert other.status_code == 422
    assert Decimal(show(env, call_id)["cost_usd"]) == Decimal("0.01")


def test_form_op_id_endpoint_refuses_a_multipart_body(env: Env) -> None:
    """An endpoint that takes the operation id in a form field refuses multipart with 400."""
    response = env.http.post(
        "/charges/v1/upload", files={"file": ("a.txt", b"hi")}, headers={"Idempotency-Key": "u"}
    )
    assert response.status_code == 400
    assert "application/x-www-form-urlencoded" in response.json()["error"]["message"]


def test_a_bad_form_body_is_400(env: Env) -> None:
    """A form body that is not UTF-8 or not key=value pairs is refused 400 invalid_request."""
    response = env.http.post(
        "/charges/v1/charges",
        content=b"amount",
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request"


def test_upload_body_reaches_the_provider_byte_exact(env: Env) -> None:
    """The multipart bytes the provider receives are the client's, unchanged."""
    request = env.http.build_request(
        "POST",
        "/openai/v1/files",
        data={"purpose": "batch"},
        files={"file": ("blob.bin", os.urandom(4096), "application/octet-stream")},
        headers={"Idempotency-Key": "exact-1"},
    )
    sent = request.read()
    response = env.http.send(request)
    assert response.status_code == 200
    assert response.json()["bytes"] == 4096
    assert env.receipts("/v1/files")[-1]["body_sha256"] == hashlib.sha256(sent).hexdigest()


# -- the transport ------------------------------------------------------------------


async def test_transport_guards_sdk_uploads_and_replays_identical_ones(
    env: Env, make_transport: Any, finish: Any
) -> None:
    """The openai SDK over AsyncGuardTransport: an upload completes once; the same upload
    under the same key replays, another file under it is 422; a transcription is priced."""
    transport = make_transport(upstreams={"openai": env.provider.url})
    async with httpx.AsyncClient(transport=transport) as http:
        client = openai.AsyncOpenAI(
            api_key="sk-test", base_url=env.provider.url + "/v1", http_client=http, max_retries=0
        )
        keyed = client.with_options(default_headers={"Idempotency-Key": "t-upload"})
        before = len(env.receipts("/v1/files"))
        first = await keyed.files.create(file=("t.jsonl", b"{}\n"), purpose="batch")
        again = await keyed.files.create(file=("t.jsonl", b"{}\n"), purpose="batch")
        assert again.id == first.id
        assert len(env.receipts("/v1/files")) == before + 1
        with pytest.raises(openai.UnprocessableEntityError):
            await keyed.files.create(file=("t.jsonl", b"[]\n"), purpose="batch")
        await client.audio.transcriptions.create(model="whisper-1", file=("a.wav", b"RIFF"))
        calls = {c.model: c for c in await transport.ledger.calls()}
        assert calls[None].stage == "completed"  # the upload (a refused 422 is no call)
        assert calls["whisper-1"].cost == 6_000_000
        assert len(env.receipts("/v1/files")) == before + 1
        await finish(transport)
