"""``effectguard reconcile --auto``: ask providers' declared lookup paths.

For each effect-unknown call whose provider declares a lookup (a URL template
answering "was operation K applied?"), ask it and record the answer as
``call.reconciled`` by ``auto:<provider>``. Calls of providers without a lookup
are left for a person.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

from effectguard.callpath.crash import NO_CRASH, CrashPoints
from effectguard.errors import EffectguardError
from effectguard.ledger import Ledger
from effectguard.providers import Provider


def lookup_key(ledger_events: list[Any]) -> str | None:
    """The provider idempotency key the call's last attempt was sent with."""
    for stored in reversed(ledger_events):
        if stored.kind == "attempt.started":
            key = stored.data.get("provider_idempotency_key")
            return str(key) if key else None
    return None


async def reconcile_auto(
    ledger: Ledger,
    providers: Mapping[str, Provider],
    transport: httpx.AsyncBaseTransport | None = None,
    crash: CrashPoints = NO_CRASH,
) -> list[dict[str, Any]]:
    """Reconcile every effect-unknown call that has a lookup path; one result per call."""
    results: list[dict[str, Any]] = []
    async with httpx.AsyncClient(transport=transport, timeout=10, follow_redirects=False) as client:
        for state in await ledger.calls(stage="effect_unknown", limit=100_000):
            provider = providers.get(state.provider)
            if provider is None or provider.lookup is None:
                continue
            key = lookup_key(await ledger.events(state.call_id))
            if key is None:
                results.append({"call_id": state.call_id, "result": "no provider key recorded"})
                continue
            url = provider.lookup.format(base_url=provider.base_url, key=key)
            try:
                response = await client.get(url)
                response.raise_for_status()
                applied = response.json().get("applied")
            except (httpx.HTTPError, ValueError) as exc:
                results.append({"call_id": state.call_id, "result": f"lookup failed: {exc}"})
                continue
            if not isinstance(applied, bool):
                results.append({"call_id": state.call_id, "result": "lookup gave no answer"})
                continue
            try:
                await ledger.reconcile(
                    state.call_id,
                    applied=applied,
                    note=f"lookup {url} answered applied={applied}",
                    by=f"auto:{provider.name}",
                )
            except EffectguardError as exc:
                results.append({"call_id": state.call_id, "result": f"not recorded: {exc}"})
                continue
            crash.hit("after:reconcile")
            results.append(
                {"call_id": state.call_id, "result": "applied" if applied else "not_applied"}
            )
    return results
