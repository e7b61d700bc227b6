"""Shared pieces of the operator page tests: a configured proxy, an unknown call, the ledger.

``operator_stack`` runs the fake provider and ``effectguard serve`` with a config
file that sets an admin key named ``ana`` and a short upstream read timeout; an
``effect_unknown`` call is made by asking the fake provider to drop the connection
after it has received (and recorded) the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from effectguard.config.settings import hash_key
from effectguard.ledger import Ledger, Writer, operations
from effectguard.ledger.sqlitesession import SqliteSession
from effectguard.rules.events import (
    AttemptStarted,
    BudgetReserved,
    CallManifest,
    Event,
    StoredEvent,
)
from effectguard.rules.workstate import WorkState
from effectguard.testing import FakeProvider, Proxy, fake_provider, running_proxy

ADMIN_KEY = "eg-admin-" + "k" * 32
ADMIN_NAME = "ana"
PAGE = "/_effectguard/"
CHAT = "/openai/v1/chat/completions"
MODEL = "gpt-4o-mini"
TIMEOUT = 30.0


@dataclass
class Stack:
    """A running fake provider and proxy sharing one ledger."""

    provider: FakeProvider
    proxy: Proxy

    @property
    def url(self) -> str:
        """The proxy's base URL."""
        return self.proxy.url


def config_text(*, admin: bool = True, extra: str = "") -> str:
    """A config file: a short read timeout, one budget limit and (optionally) the admin key."""
    text = '[upstream]\nread_timeout_s = 5\n[budgets]\n"ops" = "5.00"\n' + extra
    if admin:
        text += f'[[admin.keys]]\nname = "{ADMIN_NAME}"\nsha256 = "{hash_key(ADMIN_KEY)}"\n'
    return text


@contextlib.contextmanager
def operator_stack(tmp: Path, *, admin: bool = True) -> Iterator[Stack]:
    """The fake provider and ``effectguard serve --config`` for the duration of a block."""
    config = tmp / "effectguard.toml"
    config.write_text(config_text(admin=admin))
    with (
        fake_provider(tmp / "receipts.jsonl") as provider,
        running_proxy(
            tmp / "ledger.db", upstreams={"openai": provider.url}, args=["--config", str(config)]
        ) as proxy,
    ):
        yield Stack(provider, proxy)


def chat_body(content: str = "hello") -> dict[str, Any]:
    """An OpenAI chat completion request."""
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 16}


def send_chat(
    stack: Stack, key: str, *, drop: bool = False, content: str = "hello"
) -> httpx.Response:
    """One chat call through the proxy under idempotency key ``key`` (``drop``: no answer)."""
    headers = {"idempotency-key": key, "effectguard-budget": "ops/agents"}
    if drop:
        headers["x-fake-behaviour"] = "drop"
    return httpx.post(stack.url + CHAT, json=chat_body(content), headers=headers, timeout=TIMEOUT)


def unknown_call(stack: Stack, key: str, content: str = "hello") -> str:
    """Make an ``effect_unknown`` call and return its id."""
    response = send_chat(stack, key, drop=True, content=content)
    assert response.status_code in (502, 504), response.text
    assert response.json()["error"]["type"] == "effect_unknown"
    return response.headers["effectguard-call-id"]


def ledger_view(stack: Stack, call_id: str) -> tuple[WorkState, list[StoredEvent]]:
    """A call's state and events, read through the ledger API the CLI uses."""

    async def read() -> tuple[WorkState, list[StoredEvent]]:
        async with Ledger.open(stack.proxy.ledger) as ledger:
            return await ledger.call(call_id), await ledger.events(call_id)

    return asyncio.run(read())


def reconciliations(stack: Stack, call_id: str) -> list[dict[str, Any]]:
    """The data of the call's ``call.reconciled`` events."""
    _, events = ledger_view(stack, call_id)
    return [e.data for e in events if e.kind == "call.reconciled"]


def write_unknown_calls(path: Path, count: int, *, first_at: float, rest_at: float) -> list[str]:
    """Write ``count`` ``effect_unknown`` calls of budget ``ops`` straight to a SQLite
    ledger, as a crashed proxy's sweep leaves them, and return their ids: the first
    admitted at ``first_at``, the others at ``rest_at`` (each holding 10,000 nano-dollars)."""
    now = [first_at]
    ids = []
    session = SqliteSession(str(path), clock=lambda: now[0])
    try:
        session.begin()
        writer = operations.register_worker(
            session, worker="gone", host="gone-host", pid=0, lease_s=0
        )
        for n in range(count):
            now[0] = first_at if n == 0 else rest_at
            call_id = operations.new_call_id()
            ids.append(call_id)
            interrupted(session, writer, call_id, _admitted(call_id, writer, now[0], n))
        session.commit()
    finally:
        session.close()
    return ids


def interrupted(session: SqliteSession, writer: Writer, call_id: str, events: list[Event]) -> None:
    """Append ``call_id``'s admission ``events`` and mark its attempt interrupted, as a
    sweep does once its worker is gone."""
    operations.append(session, writer, events)
    state = session.get_call(call_id)
    assert state is not None
    operations.interrupt(session, writer, state, "the test's worker is gone")


def _admitted(call_id: str, writer: Writer, at: float, n: int) -> list[Event]:
    """A call's admission events: manifest, reservation, attempt 1 started."""
    return [
        CallManifest(
            call=call_id,
            request_hash=f"{n:064x}",
            provider="openai",
            endpoint="/v1/chat/completions",
            method="POST",
            model=MODEL,
            idempotency_key=f"unknown-{n}",
            budget="ops",
            budget_root="ops",
            effect_kind="billable",
            body=json.dumps(chat_body(f"call {n}")),
            at=at,
        ),
        BudgetReserved(call=call_id, budget="ops", amount=10_000),
        AttemptStarted(
            call=call_id, attempt=1, worker=writer.worker, generation=writer.generation, at=at
        ),
    ]
