"""How one value of the config file is checked: numbers, ports, directories. Each refusal
is a ``ConfigError`` naming the key (``server.lease_s: must be above zero``)."""

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


def port(table: Mapping[str, Any], key: str) -> int | None:
    """A TCP port, 0 (any free one) to 65535, or None when the key is absent."""
    value = table.get(key)
    if value is None:
        return None
    # int() would take "80" and True (port 1), and the socket layer wraps 99999 to 34463.
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ConfigError(f"server.{key}: must be a TCP port from 0 to 65535, not {value!r}")
    return value


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
