"""How one value of the config file is checked: numbers, whole numbers, booleans, hosts,
ports, directories. Each refusal is a ``ConfigError`` naming the key (``server.lease_s:
must be above zero``).

A value is taken only in its own TOML type, never converted: ``bool("false")`` is true
and ``int(2.5)`` is 2, so a quoted boolean or a fractional count would silently mean
something else than what the file says.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from effectguard.config import defaults
from effectguard.errors import ConfigError


def number(table: Mapping[str, Any], key: str, default: float, where: str) -> float:
    """A finite, non-negative number (``default`` when the key is absent)."""
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ConfigError(f"{where}.{key}: must be a non-negative number")
    if not math.isfinite(value):  # TOML's inf (or 1e400), which no timer or int() takes
        raise ConfigError(f"{where}.{key}: must be a finite number")
    return float(value)


def positive(table: Mapping[str, Any], key: str, default: float, where: str) -> float:
    """A finite number above zero."""
    value = number(table, key, default, where)
    if value <= 0:
        raise ConfigError(f"{where}.{key}: must be above zero")
    return value


def whole(
    table: Mapping[str, Any], key: str, default: int, where: str, *, above_zero: bool = False
) -> int:
    """A non-negative TOML integer (above zero if asked); ``2.5``, ``2.0`` and ``1e6`` are
    refused, not cut to a whole number."""
    # number() first: a negative, infinite or non-numeric value keeps its own message.
    (positive if above_zero else number)(table, key, default, where)
    value = table.get(key, default)
    if not isinstance(value, int):
        raise ConfigError(f"{where}.{key}: must be a whole number (no point or exponent)")
    return value


def boolean(table: Mapping[str, Any], key: str, default: bool, where: str) -> bool:
    """A TOML boolean, ``true`` or ``false`` unquoted: the string ``"false"`` is refused."""
    value = table.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{where}.{key}: must be true or false (unquoted), not {value!r}")
    return value


def text(table: Mapping[str, Any], key: str, where: str) -> str:
    """A string the table must hold (``str()`` would make a name of ``5`` or ``true``)."""
    value = table[key]
    if not isinstance(value, str):
        raise ConfigError(f"{where}.{key}: must be a string, not {value!r}")
    return value


def host(table: Mapping[str, Any], key: str, default: str, where: str) -> str:
    """A host name or address to listen on: a non-empty string without spaces."""
    value = table.get(key, default)
    if (
        not isinstance(value, str)
        or not value
        or any(c.isspace() or not c.isprintable() for c in value)
    ):
        raise ConfigError(f"{where}.{key}: must be a host name or address as a string")
    return value


def port(table: Mapping[str, Any], key: str) -> int | None:
    """A TCP port, 0 (any free one) to 65535, or None when the key is absent."""
    value = table.get(key)
    if value is None:
        return None
    # int() would take "80" and True (port 1), and the socket layer wraps 99999 to 34463.
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ConfigError(f"server.{key}: must be a TCP port from 0 to 65535, not {value!r}")
    return value


def ports(table: Mapping[str, Any], key: str) -> dict[str, int]:
    """A table of names to TCP ports (``provider_ports = { postmark = 8788 }``)."""
    value = table.get(key, {})
    if not isinstance(value, Mapping):
        raise ConfigError(f"server.{key}: must be a table of NAME = PORT")
    return {str(name): _one_port(f"{key}.{name}", v) for name, v in value.items()}


def _one_port(key: str, value: Any) -> int:
    chosen = port({key: value}, key)
    if chosen is None:
        raise ConfigError(f"server.{key}: must be a TCP port from 0 to 65535")
    return chosen


def listen_port(server: Mapping[str, Any]) -> int:
    """``[server] port``, or the default."""
    chosen = port(server, "port")
    return defaults.PORT if chosen is None else chosen


def directory(table: Mapping[str, Any], key: str, where: str) -> str | None:
    """An existing directory's path, or None when the key is absent."""
    value = table.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not Path(value).is_dir():
        raise ConfigError(f"{where}.{key}: must name an existing directory")
    return value
