"""Typed settings for ``effectguard serve``, read once at the edge.

Sources, later ones winning: defaults, the ``--config`` TOML file, flags. The
environment is read here only (provider keys by the names declarations give).

Config file reference (every table optional)::

    [server]
    host = "127.0.0.1"
    port = 8787
    max_body_bytes = 10485760   # larger bodies get 413 before being read
    drain_timeout_s = 30        # on SIGTERM: how long in-flight calls may finish

    [guard]
    retry_window_s = 600        # key-less declared retries match calls this recent
    max_retries = 2             # automatic retries of provably-null attempts
    create_budgets = true       # false: an unknown budget path is refused (403)

    [upstream]
    connect_timeout_s = 10
    read_timeout_s = 600

    [budgets]                   # limits in USD (decimal strings)
    "team-a" = "50.00"

    [[keys]]                    # proxy keys; with any, every request needs one
    name = "team-a"
    sha256 = "<hex digest of the key>"   # `effectguard key new` prints one
    budget_root = "team-a"
"""

from __future__ import annotations

import hashlib
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from effectguard import budget as budgets
from effectguard.errors import ConfigError
from effectguard.money import usd_to_nanos
from effectguard.prepare import GuardSettings
from effectguard.providers import Provider, load_providers


@dataclass(frozen=True, slots=True)
class ProxyKey:
    """An effectguard key, stored only as its SHA-256, fixing a budget root."""

    name: str
    sha256: str
    budget_root: str


def hash_key(key: str) -> str:
    """The stored form of a proxy key."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class ServeSettings:
    """Everything ``effectguard serve`` needs."""

    ledger: str = "effectguard.db"
    host: str = "127.0.0.1"
    port: int = 8787
    providers: Mapping[str, Provider] = field(default_factory=dict)
    provider_keys: Mapping[str, str] = field(default_factory=dict)
    guard: GuardSettings = field(default_factory=GuardSettings)
    budget_limits: Mapping[str, int] = field(default_factory=dict)
    keys: tuple[ProxyKey, ...] = ()
    max_body_bytes: int = 10 * 1024 * 1024
    drain_timeout_s: float = 30.0
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 600.0
    lease_s: float = 15.0
    heartbeat_s: float = 3.0
    sweep_s: float = 5.0

    def key_root(self, presented: str) -> ProxyKey | None:
        """The proxy key matching ``presented``, if any."""
        digest = hash_key(presented)
        return next((k for k in self.keys if k.sha256 == digest), None)


def _table(raw: Mapping[str, Any], name: str, source: str) -> Mapping[str, Any]:
    value = raw.get(name, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: [{name}] must be a table")
    return value


def _number(table: Mapping[str, Any], key: str, default: float, where: str) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ConfigError(f"{where}.{key}: must be a non-negative number")
    return float(value)


def load_settings(
    *,
    config: Path | None = None,
    ledger: str | None = None,
    host: str | None = None,
    port: int | None = None,
    provider_dirs: Sequence[Path] = (),
    upstreams: Mapping[str, str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> ServeSettings:
    """Build settings from a config file, flags and the environment."""
    env = os.environ if environ is None else environ
    raw: dict[str, Any] = {}
    source = str(config) if config else "<flags>"
    if config is not None:
        try:
            raw = tomllib.loads(config.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{config}: {exc}") from exc
    server = _table(raw, "server", source)
    guard = _table(raw, "guard", source)
    upstream = _table(raw, "upstream", source)
    providers = load_providers(list(provider_dirs), upstreams)
    limits: dict[str, int] = {}
    for path, value in _table(raw, "budgets", source).items():
        try:
            budgets.validate_path(path)
            limits[path] = usd_to_nanos(str(value) if isinstance(value, int) else value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: budgets.{path}: {exc}") from exc
    keys = []
    for i, entry in enumerate(raw.get("keys", [])):
        where = f"{source}: keys[{i}]"
        if not isinstance(entry, dict) or not {"sha256", "budget_root"} <= entry.keys():
            raise ConfigError(f"{where}: needs sha256 and budget_root")
        digest = str(entry["sha256"]).lower()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ConfigError(f"{where}.sha256: must be a hex SHA-256 digest")
        try:
            root = budgets.validate_path(str(entry["budget_root"]))
        except ValueError as exc:
            raise ConfigError(f"{where}.budget_root: {exc}") from exc
        keys.append(ProxyKey(str(entry.get("name", root)), digest, root))
    provider_keys = {
        name: env[p.api_key_env]
        for name, p in providers.items()
        if p.api_key_env and env.get(p.api_key_env)
    }
    defaults = GuardSettings()
    return ServeSettings(
        ledger=ledger or str(raw.get("ledger", env.get("EFFECTGUARD_LEDGER", "effectguard.db"))),
        host=host or str(server.get("host", "127.0.0.1")),
        port=port if port is not None else int(server.get("port", 8787)),
        providers=providers,
        provider_keys=provider_keys,
        guard=GuardSettings(
            retry_window_s=_number(guard, "retry_window_s", defaults.retry_window_s, "guard"),
            max_retries=int(_number(guard, "max_retries", defaults.max_retries, "guard")),
            retry_wait_s=_number(guard, "retry_wait_s", defaults.retry_wait_s, "guard"),
            create_budgets=bool(guard.get("create_budgets", True)),
        ),
        budget_limits=limits,
        keys=tuple(keys),
        max_body_bytes=int(_number(server, "max_body_bytes", 10 * 1024 * 1024, "server")),
        drain_timeout_s=_number(server, "drain_timeout_s", 30.0, "server"),
        connect_timeout_s=_number(upstream, "connect_timeout_s", 10.0, "upstream"),
        read_timeout_s=_number(upstream, "read_timeout_s", 600.0, "upstream"),
        lease_s=_number(server, "lease_s", 15.0, "server"),
        heartbeat_s=_number(server, "heartbeat_s", 3.0, "server"),
        sweep_s=_number(server, "sweep_s", 5.0, "server"),
    )
