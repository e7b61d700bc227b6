"""Shared pieces of the tool-effect tests: a Stripe-like ``payments`` declaration whose
``/v1/send`` endpoint is at-most-once, carries the call id in a header and is looked up
through the fake provider's lagging, key-checked ``/v1/search``; and a guard transport
whose first send is lost on the way, leaving that call ``effect_unknown``; the real CLI,
and waiting for a call the provider holds while it is in flight."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from effectguard import AsyncGuardTransport, GuardSettings
from effectguard.testing import FakeProvider
from effectguard.testing.payments import declaration

KEY = "sk-payments-test"
#: Settings under which an answer that takes 3 s times out upstream after 0.5 s (so the
#: call is effect_unknown): a client's own httpx timeout ends only its wait (contract §3.8).
SLOW_ANSWER_TIMES_OUT = GuardSettings(
    retry_wait_s=0, retry_wait_max_s=0, upstream_read_timeout_s=0.5
)
AUTH = {"Authorization": f"Bearer {KEY}"}
SEND = "/v1/send"


def declare(tmp_path: Path, freshness: float | None, retention: float | None = None) -> Path:
    """A --providers directory declaring ``payments`` with the given search freshness
    (None: no lookup at all, as for a tool that cannot be searched) and, if given, the
    retention past which its search has forgotten an operation."""
    folder = tmp_path / "providers"
    folder.mkdir(exist_ok=True)
    text = declaration(freshness or 0)
    if retention is not None:
        text = text.replace("timeout_s = 5\n", f"timeout_s = 5\nretention_s = {retention}\n")
    if freshness is None:
        start, end = text.index("[endpoints.lookup]"), text.index("[models.default]")
        text = text[:start] + text[end:]
    (folder / "payments.toml").write_text(text)
    return folder


def charge(amount: int) -> dict[str, Any]:
    """A payments request body."""
    return {"amount": amount, "currency": "usd"}


def charges(fake: FakeProvider) -> list[dict[str, Any]]:
    """The provider's own receipts of effects on /v1/send (what was charged)."""
    return [r for r in fake.effects() if r["path"] == SEND]


class DropFirstSend(httpx.AsyncBaseTransport):
    """A network that loses the first POST /v1/send before it reaches the provider,
    after the request was written (so effectguard cannot know it never arrived)."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.dropped = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.path == SEND and not self.dropped:
            self.dropped = True
            raise httpx.ReadError("connection reset after the request was written")
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def lossy_transport(
    make_transport: Callable[..., AsyncGuardTransport],
    folder: Path,
    fake: FakeProvider,
    **kwargs: Any,
) -> AsyncGuardTransport:
    """A guard transport to ``fake`` as the ``payments`` provider declared in ``folder``,
    over a :class:`DropFirstSend` network; ``kwargs`` go to ``make_transport``."""
    return make_transport(
        inner=DropFirstSend(httpx.AsyncHTTPTransport()),
        providers=[folder],
        upstreams={"payments": fake.url},
        **kwargs,
    )


async def lost_send(client: httpx.AsyncClient, url: str, body: Any, **kwargs: Any) -> str:
    """POST ``body`` where :class:`DropFirstSend` loses it: the guard answers 502
    ``effect_unknown``. Returns the call's id."""
    first = await client.post(url, json=body, **kwargs)
    assert first.status_code == 502, first.text
    assert first.json()["error"]["type"] == "effect_unknown", first.text
    call_id: str = first.headers["effectguard-call-id"]
    return call_id


def cli_run(*args: str) -> subprocess.CompletedProcess[str]:
    """The real ``effectguard`` command, whatever it exits with (bounded in time)."""
    return subprocess.run(
        [sys.executable, "-m", "effectguard", *args], capture_output=True, text=True, timeout=60
    )


def cli_json(*args: str) -> Any:
    """The real ``effectguard`` command with ``--json``: assert exit 0, parse its output."""
    done = cli_run(*args, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def held_in_flight(ledger: str, fake: FakeProvider) -> str:
    """Wait (10 s at most) until ``ledger`` holds one call in flight and ``fake`` has
    received it; that call's id."""
    deadline = time.monotonic() + 10
    calls: list[Any] = []
    while not calls and time.monotonic() < deadline:
        calls = cli_json("calls", "--ledger", ledger, "--state", "in_flight")
        time.sleep(0.05)
    (call,) = calls
    while not fake.receipts() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert fake.receipts(), "the call never reached the provider"
    call_id: str = call["call_id"]
    return call_id
