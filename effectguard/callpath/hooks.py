"""The application's answer to "did it happen?": the reconcile hook (docs/contract.md §4).

A transport takes ``reconcile_hook=``, the proxy ``[guard] reconcile_hook =
"module:function"``: an async callable that gets a :class:`ReconcileQuestion` about a
call whose effect is unknown and returns :class:`Applied` (with the cost and,
optionally, the result to hand the client), :class:`NotApplied` or :class:`Unknown`.
A hook that raises, returns anything else or runs past its timeout counts as unknown, and
so does an :class:`Applied` whose cost is no USD amount in bounds (a float is refused) or
whose result is neither bytes nor a JSON value.
Its decisions are recorded as ``call.reconciled`` by ``hook``.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from effectguard.errors import ConfigError

__all__ = [
    "Applied",
    "HookAnswer",
    "NotApplied",
    "ReconcileHook",
    "ReconcileQuestion",
    "Unknown",
    "load_hook",
]


@dataclass(frozen=True, slots=True)
class ReconcileQuestion:
    """One call whose effect is unknown, as the application may recognise it."""

    provider: str
    endpoint: str
    method: str
    #: The request body as the client sent it.
    request: bytes
    #: The operation id effectguard wrote into the request (the call id).
    op_id: str
    idempotency_key: str | None


@dataclass(frozen=True, slots=True)
class Applied:
    """The effect happened. ``cost_usd`` (None: the held reservation) is what it cost;
    ``result``, if given, is handed to the client as a 200 (bytes, or a JSON value)."""

    cost_usd: Decimal | None = None
    result: bytes | Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class NotApplied:
    """The effect did not happen: the call may be sent again."""


@dataclass(frozen=True, slots=True)
class Unknown:
    """The application cannot tell."""


HookAnswer = Applied | NotApplied | Unknown
ReconcileHook = Callable[[ReconcileQuestion], Awaitable[HookAnswer]]


def load_hook(spec: str) -> ReconcileHook:
    """Import ``module:function`` (the proxy's ``[guard] reconcile_hook``)."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise ConfigError(f"guard.reconcile_hook: {spec!r} must be module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"guard.reconcile_hook: cannot import {module_name}: {exc}") from exc
    hook = getattr(module, name, None)
    if not callable(hook):
        raise ConfigError(f"guard.reconcile_hook: {spec!r} is not a callable")
    return hook  # type: ignore[no-any-return]
