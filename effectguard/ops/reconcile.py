"""``effectguard reconcile --auto``: ask each unknown call's declared lookup.

For each effect-unknown call whose endpoint declares a lookup (its own, or its
provider's ``lookup`` template), the lookup is sent with the provider's own
credentials (its ``api_key_env``) and its answer read as declared: applied, not
applied (only past the declared freshness) or unknown. Decisions are recorded as
``call.reconciled`` by ``lookup:<provider>`` with the evidence's digest; unknown
calls are left as they are. Calls whose endpoint declares no lookup wait for a person.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import httpx

from effectguard.callpath.crash import NO_CRASH, CrashPoints
from effectguard.callpath.httpxshape import httpx_send
from effectguard.callpath.resolve import Resolver, facts_of
from effectguard.config.settings import keys_from_environment
from effectguard.ledger import Ledger
from effectguard.providers import Provider


async def reconcile_auto(
    ledger: Ledger,
    providers: Mapping[str, Provider],
    transport: httpx.AsyncBaseTransport | None = None,
    crash: CrashPoints = NO_CRASH,
    environ: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Ask the lookup of every effect-unknown call that has one; one result per call."""
    credentials = keys_from_environment(providers, os.environ if environ is None else environ)
    results: list[dict[str, Any]] = []
    async with httpx.AsyncClient(transport=transport, timeout=10, follow_redirects=False) as client:

        async def send(request: httpx.Request) -> httpx.Response:
            return await client.send(request, stream=True)

        resolver = Resolver(ledger, providers, credentials=credentials, send=httpx_send(send))
        for state in await ledger.calls(stage="effect_unknown", limit=100_000):
            facts = await facts_of(ledger, state.call_id)
            endpoint = None if facts is None else resolver.endpoint(facts)
            if facts is None or endpoint is None or endpoint.lookup is None:
                continue
            evidence = await resolver.decide(facts)
            if evidence.verdict != "unknown":
                crash.hit("after:reconcile")
            results.append(
                {"call_id": state.call_id, "result": evidence.verdict, "note": evidence.note}
            )
    return results


async def undeclared_providers(ledger: Ledger, providers: Mapping[str, Provider]) -> dict[str, int]:
    """Effect-unknown calls whose provider no loaded declaration names: provider -> count.

    :func:`reconcile_auto` cannot tell whether such a call's endpoint declares a lookup,
    so it passes over it; the command says so, since a provider declared only in
    ``serve``'s ``--providers`` is exactly the one this command was run without."""
    counts: dict[str, int] = {}
    for state in await ledger.calls(stage="effect_unknown", limit=100_000):
        if state.provider not in providers:
            counts[state.provider] = counts.get(state.provider, 0) + 1
    return counts
