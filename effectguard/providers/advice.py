"""Load-time advice on a declaration that is valid but likely to surprise its user.

A pure check on a built :class:`~.provider.Provider`; :mod:`.declaration` logs what it
finds, so a copy of the example declaration that drops its ``[transient]`` table is
named once, when it is loaded.
"""

from __future__ import annotations

from effectguard.providers.provider import Provider

__all__ = ["undeclared_5xx_warning"]


def undeclared_5xx_warning(provider: Provider) -> str | None:
    """A one-line warning when a provider with an idempotency guarantee declares no 5xx.

    Why: an undeclared 5xx is booked ``failed`` (effect applied) and its answer replayed
    to every keyed resend (docs/contract.md §2), so the client's Idempotency-Key is spent
    on an answer that proves nothing, where a resend under the provider's key was safe.
    """
    guaranteed = provider.idempotency is not None or any(
        e.idempotency is not None for e in provider.endpoints
    )
    declared = provider.not_processed | set(provider.transient)
    if not guaranteed or any(500 <= status <= 599 for status in declared):
        return None
    return (
        f"{provider.source}: declares an idempotency guarantee but no 5xx in [transient] "
        "or not_processed: an undeclared 5xx is booked failed (applied) and replayed to "
        'every keyed resend; declare e.g. [transient] 500 = "unknown" (docs/contract.md §2)'
    )
