"""Keys in the configuration: proxy keys (``[[keys]]``) and the operator page's
(``[admin]``), each stored only as the SHA-256 digest of the key."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from effectguard.config import defaults, values
from effectguard.errors import ConfigError
from effectguard.rules import budget as budgets
from effectguard.rules import notes


@dataclass(frozen=True, slots=True)
class ProxyKey:
    """An effectguard key, stored only as its SHA-256, fixing a budget root."""

    name: str
    sha256: str
    budget_root: str
    #: May read ``/metrics`` (which shows every tenant's budgets).
    metrics: bool = False


@dataclass(frozen=True, slots=True)
class AdminKey:
    """An operator's key for the operator page, stored only as its SHA-256."""

    name: str
    sha256: str


@dataclass(frozen=True, slots=True)
class AdminSettings:
    """The operator page: on only when ``keys`` is not empty.

    ``secret`` (from ``EFFECTGUARD_ADMIN_SECRET``) is mixed into the session signing
    secret, so that reading the config file's digests is not enough to forge a login.
    """

    keys: tuple[AdminKey, ...] = ()
    session_s: float = defaults.ADMIN_SESSION_S
    secret: str = field(default="", repr=False)  # a repr ends up in logs and tracebacks

    @property
    def enabled(self) -> bool:
        """Whether the operator page is served at all."""
        return bool(self.keys)

    def key_for(self, presented: str) -> AdminKey | None:
        """The admin key matching ``presented``, if any."""
        digest = hash_key(presented)
        return next((k for k in self.keys if hmac.compare_digest(k.sha256, digest)), None)


def hash_key(key: str) -> str:
    """The stored form of a proxy key."""
    return hashlib.sha256(key.encode()).hexdigest()


def _digest(entry: Mapping[str, Any], where: str) -> str:
    digest = values.text(entry, "sha256", where).lower()
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise ConfigError(f"{where}.sha256: must be a hex SHA-256 digest")
    return digest


def _once(digest: str, seen: dict[str, str], where: str, label: str) -> str:
    """``digest``, refused if an earlier entry (``seen``: digest to its label) has it: one
    secret is one key. Two [[keys]] entries with one digest left the proxy with the last
    (the other's budget root silently lost), and an admin key that is also a proxy key
    could spend, where the two are meant apart."""
    if digest in seen:
        raise ConfigError(
            f"{where}.sha256: the same key as {seen[digest]}; give each entry its own key "
            "(effectguard key new)"
        )
    seen[digest] = label
    return digest


def admin_settings(
    table: Mapping[str, Any],
    source: str,
    env: Mapping[str, str],
    proxy: list[ProxyKey] | tuple[ProxyKey, ...] = (),
) -> AdminSettings:
    """``[admin]`` (``table``): the operator page's keys (each named: the name signs
    decisions), none of them one of the ``proxy`` keys (an admin key cannot spend)."""
    entries = table.get("keys", [])
    if not isinstance(entries, list):
        raise ConfigError(f"{source}: admin.keys must be an array of tables")
    keys: list[AdminKey] = []
    seen = {key.sha256: f"keys[{i}]" for i, key in enumerate(proxy)}
    for i, entry in enumerate(entries):
        where = f"{source}: admin.keys[{i}]"
        if not isinstance(entry, Mapping) or not {"name", "sha256"} <= entry.keys():
            raise ConfigError(f"{where}: needs name and sha256")
        name = notes.name_text(values.text(entry, "name", where))
        if name is None:
            raise ConfigError(f"{where}.name: must be a printable, non-empty name")
        keys.append(AdminKey(name, _once(_digest(entry, where), seen, where, f"admin.keys[{i}]")))
    hours = values.number(table, "session_hours", defaults.ADMIN_SESSION_S / 3600, "admin")
    # A minute at least (shorter, a login's cookie is stale before the next page), a year
    # at most (longer, the cookie's Max-Age overflows and every login fails).
    if not 1 / 60 <= hours <= 24 * 366:
        raise ConfigError(
            f"{source}: admin.session_hours must be between 0.0167 (a minute) and 8784 (a year)"
        )
    return AdminSettings(tuple(keys), hours * 3600, env.get(defaults.ADMIN_SECRET_ENV, ""))


def proxy_keys(raw: Mapping[str, Any], source: str) -> list[ProxyKey]:
    """``[[keys]]``: each a SHA-256 digest of a proxy key and the budget root it fixes."""
    entries = raw.get("keys", [])
    if not isinstance(entries, list):  # keys = 5, or [keys] where [[keys]] was meant
        raise ConfigError(f"{source}: keys must be an array of tables ([[keys]])")
    keys = []
    seen: dict[str, str] = {}
    for i, entry in enumerate(entries):
        where = f"{source}: keys[{i}]"
        if not isinstance(entry, Mapping) or not {"sha256", "budget_root"} <= entry.keys():
            raise ConfigError(f"{where}: needs sha256 and budget_root")
        digest = _once(_digest(entry, where), seen, where, f"keys[{i}]")
        try:
            root = budgets.validate_path(values.text(entry, "budget_root", where))
        except ValueError as exc:
            raise ConfigError(f"{where}.budget_root: {exc}") from exc
        name = notes.name_text(values.text(entry, "name", where)) if "name" in entry else root
        if name is None:  # it names the key in access lines and the operator page
            raise ConfigError(f"{where}.name: must be a printable, non-empty name")
        keys.append(ProxyKey(name, digest, root, values.boolean(entry, "metrics", False, where)))
    return keys
