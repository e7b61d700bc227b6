"""A child process for the crash tests: requests through ``AsyncGuardTransport``.

Usage::

    python transport_call.py LEDGER PROVIDER UPSTREAM_URL REQUESTS_JSON [PROVIDERS_DIR]

``REQUESTS_JSON`` is a list of ``{"path": ..., "body": {...}, "headers": {...}}`` (or
``"form"`` instead of ``"body"``, sent form-encoded),
sent one after the other through one transport (one worker). The crash point
comes from ``EFFECTGUARD_CRASH_AT`` (read here, at the edge). For request ``i``
the child prints one JSON line per chunk (``{"i", "chunk"}``, flushed at once,
so the parent sees what arrived before a kill), then one result line:
``{"i", "status", "headers", "body"}``, or ``{"i", "error"}`` for a transport error.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import httpx

import effectguard.callpath.crash
from effectguard import AsyncGuardTransport


def emit(obj: dict[str, Any]) -> None:
    """Write one JSON line and flush it before anything else can happen."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def send(client: httpx.AsyncClient, url: str, i: int, spec: dict[str, Any]) -> None:
    """Send one request and report what the client saw."""
    try:
        # A spec's ``form`` is sent form-encoded (as Stripe takes it), its ``body`` as JSON.
        body = {"data": spec["form"]} if "form" in spec else {"json": spec["body"]}
        async with client.stream(
            "POST", url + spec["path"], headers=spec.get("headers") or {}, **body
        ) as response:
            chunks = []
            async for chunk in response.aiter_bytes():
                chunks.append(chunk)
                emit({"i": i, "chunk": chunk.decode("utf-8", "replace")})
            body = b"".join(chunks).decode("utf-8", "replace")
            emit(
                {
                    "i": i,
                    "status": response.status_code,
                    "headers": dict(response.headers),
                    "body": body,
                }
            )
    except httpx.HTTPError as exc:
        emit({"i": i, "error": f"{type(exc).__name__}: {exc}"})


async def main(
    ledger: str, provider: str, upstream: str, specs: list[dict[str, Any]], providers: list[str]
) -> None:
    """Send every request through one guarded client (with the bundled declarations and any
    ``PROVIDERS_DIR`` over them), then close it."""
    transport = AsyncGuardTransport(
        ledger=ledger,
        providers=providers or None,
        upstreams={provider: upstream},
        crash=effectguard.callpath.crash.from_environment(),
    )
    async with httpx.AsyncClient(transport=transport, timeout=30) as client:
        for i, spec in enumerate(specs):
            await send(client, upstream, i, spec)


if __name__ == "__main__":
    ledger_arg, provider_arg, upstream_arg, specs_arg = sys.argv[1:5]
    asyncio.run(main(ledger_arg, provider_arg, upstream_arg, json.loads(specs_arg), sys.argv[5:6]))
