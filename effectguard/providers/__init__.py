"""Provider declarations: the bundled TOML files (package data) and the loader that
validates them, with users' overrides, into frozen :class:`Provider` values."""

from effectguard.providers.declaration import (
    bundled_dir,
    load_provider,
    load_providers,
    upstream_argument,
)
from effectguard.providers.endpoints import Endpoint, IdempotencyGuarantee, Lookup, OpIdPlacement
from effectguard.providers.provider import Dialect, Provider, lookup_lag
from effectguard.providers.routing import provider_for
from effectguard.rules.prices import ModelPrice

__all__ = [
    "Dialect",
    "Endpoint",
    "IdempotencyGuarantee",
    "Lookup",
    "ModelPrice",
    "OpIdPlacement",
    "Provider",
    "bundled_dir",
    "load_provider",
    "load_providers",
    "lookup_lag",
    "provider_for",
    "upstream_argument",
]
