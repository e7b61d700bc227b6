"""Shared pieces of the operator page tests: a configured proxy, an unknown call, the ledger.

``operator_stack`` runs the fake provider and ``effectguard serve`` with a config
file that sets an admin key named ``ana`` and a short upstream read timeout; an
``effect_unknown`` call is made by asking the fake provider to drop the connection
after it has received (and recorded) the request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from effectguard.config.settings import hash_key
from effectguard.ledger import Ledger
from effectguard.rules.events import StoredEvent
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
