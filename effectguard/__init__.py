"""effectguard: a durable ledger between AI agents and the providers they pay for.

Every billable call is admitted (manifest, budget reservation, ``attempt.started``)
durably before it leaves, observed and settled durably before its response is
released, and never re-sent on a guess when its effect is unknown.
"""

from effectguard.callpath.guard import Guard
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

__all__ = [
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
    "Provider",
    "ReconcileError",
    "Refusal",
    "WorkState",
    "load_providers",
    "work_state",
]
