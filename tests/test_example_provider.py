"""The bundled example tool provider (send_email) as users copy it, and the load-time
warning for a copy that leaves a provider's 5xx undeclared.

An idempotent provider's undeclared 5xx is booked ``failed`` (applied) and its stored
answer replayed to every keyed resend (docs/contract.md §2, ``[transient]``): the client's
Idempotency-Key is spent on an answer that proves nothing. The example declares its 5xx
``unknown``, so a keyed resend goes back to the provider under the same provider key.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from effectguard import AsyncGuardTransport
from effectguard.providers import load_providers
from effectguard.testing import fake_provider

MakeTransport = Callable[..., AsyncGuardTransport]
Finish = Callable[[AsyncGuardTransport], Awaitable[None]]

EMAIL = {"to": "ops@example.com", "subject": "hello", "text": "hi"}


@pytest.mark.slow
async def test_example_providers_502_then_keyed_resend_reaches_the_provider_again(
    tmp_path: Path, make_transport: MakeTransport, finish: Finish
) -> None:
    """A 502 from send_email is of unknown effect: the keyed resend is sent again, under the
    same provider key, instead of the 502 being replayed from the ledger."""
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        t = make_transport(upstreams={"send_email": fake.url})
        headers = {"Idempotency-Key": "mail-502", "x-fake-behaviour": "status=502;id=m;times=1"}
        client = httpx.AsyncClient(transport=t, headers=headers)
        first = await client.post(fake.url + "/v1/send", json=EMAIL)
        again = await client.post(fake.url + "/v1/send", json=EMAIL)
        assert first.status_code == 502, first.text
        assert (again.status_code, again.headers.get("effectguard-replayed")) == (200, None)
        receipts = fake.receipts()
        assert [r["status"] for r in receipts] == [502, 200]
        call_id = first.headers["effectguard-call-id"]
        assert [r["idempotency_key"] for r in receipts] == [call_id, call_id]
        await finish(t)


_COPY = """
name = "mailer"
base_url = "http://127.0.0.1:9"
dialect = "flat"
prices_taken = "2026-12-05"
not_processed = {not_processed}
{extra}
[idempotency]
header = "Idempotency-Key"
window_seconds = 86400

[models.default]
input = "0"
output = "0"
per_call = "0.001"
"""


def _declare(tmp_path: Path, extra: str = "", not_processed: str = "[400, 429]") -> Path:
    folder = tmp_path / "providers"
    folder.mkdir()
    (folder / "mailer.toml").write_text(_COPY.format(extra=extra, not_processed=not_processed))
    return folder


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_an_idempotent_provider_without_a_declared_5xx_is_warned_about_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One line naming the file and the missing [transient] entries."""
    folder = _declare(tmp_path)
    with caplog.at_level(logging.WARNING):
        load_providers([folder])
    (line,) = _warnings(caplog)
    assert "mailer.toml" in line and "[transient]" in line and "\n" not in line


@pytest.mark.parametrize(
    ("extra", "not_processed"),
    [('[transient]\n500 = "unknown"', "[400, 429]"), ("", "[400, 429, 503]")],
)
def test_a_declared_5xx_or_the_bundled_files_give_no_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, extra: str, not_processed: str
) -> None:
    """A 5xx in [transient] or in not_processed is a decision made; the bundled files too."""
    folder = _declare(tmp_path, extra, not_processed)
    with caplog.at_level(logging.WARNING):
        load_providers()
        load_providers([folder])
    assert _warnings(caplog) == []
