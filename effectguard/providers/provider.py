"""A provider as declared: its prices, its endpoints and what its answers mean.

:class:`Provider` is the frozen value a declaration file becomes
(:mod:`effectguard.providers.declaration` reads the files, :mod:`.validation` checks them).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from effectguard.providers.endpoints import (
    Endpoint,
    EndpointIndex,
    IdempotencyGuarantee,
    Lookup,
    default_endpoint,
    legacy_lookup,
)
from effectguard.rules.errorshape import ErrorShape
from effectguard.rules.prices import ModelPrice

Dialect = Literal["openai", "anthropic", "flat"]
#: What a declared transient status means for the effect: "none" (the request was not
#: worked on; resend) or "unknown" (it may have been; hold and reconcile).
TransientEffect = Literal["none", "unknown"]
#: What an answer's status means for the effect, by the declaration.
AnswerEffect = Literal["applied", "none", "unknown"]

# A dated snapshot suffix: OpenAI "-2024-07-18", Anthropic "-20250929", or the "-latest" alias.
_SNAPSHOT = re.compile(r"\d{4}-\d{2}-\d{2}|\d{8}|latest")


@dataclass(frozen=True, slots=True)
class Provider:
    """A validated provider declaration."""

    name: str
    base_url: str
    dialect: Dialect
    api_key_env: str | None
    key_header: str
    key_format: str
    models: Mapping[str, ModelPrice]
    endpoints: tuple[Endpoint, ...]
    not_processed: frozenset[int]
    retry_statuses: frozenset[int]
    idempotency: IdempotencyGuarantee | None
    lookup: str | None
    prices_taken: str
    source: str
    transient: Mapping[int, TransientEffect] = field(default_factory=lambda: MappingProxyType({}))
    #: How refusals on this provider's routes are shaped (default: its dialect's; contract §9).
    error_shape: ErrorShape = "openai"
    #: ``endpoints`` indexed for :meth:`endpoint_for`, built with the value.
    _index: EndpointIndex = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", EndpointIndex.of(self.endpoints))

    @property
    def no_effect_statuses(self) -> frozenset[int]:
        """Statuses that prove the request did nothing: not processed, or transient "none"."""
        return self.not_processed | {s for s, e in self.transient.items() if e == "none"}

    def answer_effect(self, status: int) -> AnswerEffect:
        """What an answer with ``status`` means for the effect, as the provider documents it:
        "none" for a declared not-processed status or a transient one declared "none";
        "unknown" for a transient status declared "unknown"; else "applied" (a success, or
        an error the provider does not declare unprocessed: stage ``failed``).
        """
        if status in self.not_processed:
            return "none"
        return self.transient.get(status, "applied")

    def endpoint_for(self, method: str, path: str) -> Endpoint | None:
        """The declared endpoint for ``method path`` (path without query), or None."""
        return self._index.find(method, path)

    def effect_for(self, method: str, path: str) -> Endpoint:
        """The endpoint ``method path`` is treated as: its declaration; undeclared, a HEAD
        is its GET where that is read-only (a GET without the body, RFC 9110 §9.3.2), and
        else billable, with the provider's default idempotency and lookup."""
        declared = self.endpoint_for(method, path)
        if declared is None and method.upper() == "HEAD":
            read = self.endpoint_for("GET", path)
            declared = read if read is not None and read.effect == "read_only" else None
        if declared is not None:
            return declared
        return default_endpoint(path, method, self.idempotency, self.default_lookup)

    @property
    def default_lookup(self) -> Lookup | None:
        """The provider-level ``lookup`` (the default of its billable endpoints)."""
        return None if self.lookup is None else legacy_lookup(self.lookup)

    def price_for(self, model: str | None) -> ModelPrice | None:
        """The price of ``model``: an exact name, else the base model of a dated snapshot.

        ``gpt-4o-mini-2024-07-18`` is priced as ``gpt-4o-mini`` (the longest declared name
        followed by ``-`` and a date), never as ``gpt-4o``. A request without a model is
        priced as ``default`` on flat providers. None means unpriced.
        """
        if model is None:
            return self.models.get("default") if self.dialect == "flat" else None
        if model in self.models:
            return self.models[model]
        snapshots = [
            name
            for name in self.models
            if model.startswith(name + "-") and _SNAPSHOT.fullmatch(model[len(name) + 1 :])
        ]
        best = max(snapshots, key=len, default=None)
        return None if best is None else self.models[best]


def lookup_lag(
    providers: Mapping[str, Provider], provider: str, method: str, path: str
) -> float | None:
    """The search lag (``freshness_s``) of the lookup a call of ``provider`` to ``method
    path`` would be asked by, as ``reconcile --auto`` picks it (None: no lookup is
    declared for it, or no declaration of ``provider`` is loaded)."""
    declared = providers.get(provider)
    if declared is None:
        return None
    lookup = declared.effect_for(method, path).lookup
    return None if lookup is None else lookup.freshness_s
