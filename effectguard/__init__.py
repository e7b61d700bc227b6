"""effectguard: a durable ledger between AI agents and the providers they pay for.

Every billable call is admitted (manifest, budget reservation, ``attempt.started``)
durably before it leaves, observed and settled durably before its response is
released, and never re-sent on a guess when its effect is unknown.

The names below are imported on first use, so that ``import effectguard`` (and
with it every ``effectguard`` command) stays light: the transports pull in httpx
and the call path, which ``effectguard calls`` never needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from effectguard.callpath.guard import Guard
    from effectguard.callpath.hooks import Applied, NotApplied, ReconcileQuestion, Unknown
    from effectguard.config.settings import GuardSettings
    from effectguard.errors import (
        CallNotFound,
        ConfigError,
        EffectguardError,
        FencedError,
        LedgerCorrupt,
        LedgerError,
        LedgerUnavailable,
        ReconcileError,
        Refusal,
    )
    from effectguard.ingress.transport import AsyncGuardTransport, GuardTransport
    from effectguard.ledger import Ledger
    from effectguard.providers import Provider, load_providers
    from effectguard.rules.workstate import WorkState, work_state

#: Where each public name lives.
_HOMES = {
    "Applied": "effectguard.callpath.hooks",
    "AsyncGuardTransport": "effectguard.ingress.transport",
    "CallNotFound": "effectguard.errors",
    "ConfigError": "effectguard.errors",
    "EffectguardError": "effectguard.errors",
    "FencedError": "effectguard.errors",
    "Guard": "effectguard.callpath.guard",
    "GuardSettings": "effectguard.config.settings",
    "GuardTransport": "effectguard.ingress.transport",
    "Ledger": "effectguard.ledger",
    "LedgerCorrupt": "effectguard.errors",
    "LedgerError": "effectguard.errors",
    "LedgerUnavailable": "effectguard.errors",
    "NotApplied": "effectguard.callpath.hooks",
    "Provider": "effectguard.providers",
    "ReconcileError": "effectguard.errors",
    "ReconcileQuestion": "effectguard.callpath.hooks",
    "Refusal": "effectguard.errors",
    "Unknown": "effectguard.callpath.hooks",
    "WorkState": "effectguard.rules.workstate",
    "load_providers": "effectguard.providers",
    "work_state": "effectguard.rules.workstate",
}

__all__ = [
    "Applied",
    "AsyncGuardTransport",
    "CallNotFound",
    "ConfigError",
    "EffectguardError",
    "FencedError",
    "Guard",
    "GuardSettings",
    "GuardTransport",
    "Ledger",
    "LedgerCorrupt",
    "LedgerError",
    "LedgerUnavailable",
    "NotApplied",
    "Provider",
    "ReconcileError",
    "ReconcileQuestion",
    "Refusal",
    "Unknown",
    "WorkState",
    "load_providers",
    "work_state",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'effectguard' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # the next lookup is a plain module attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
