"""Provider declarations: what each upstream charges and which requests have effects.

Providers are declared in TOML files, not coded (docs/contract.md §2). The bundled files are
package data (``effectguard/providers/bundled/``, read with :mod:`importlib.resources`, so
they are there from a wheel too); ``openai.toml`` documents the file shape. This module
reads them; :mod:`.validation` checks them into frozen :class:`.provider.Provider`
values. Nothing here does other I/O.

Loading order (:func:`load_providers`): the bundled files, then each ``--providers`` directory
in order. A file whose provider name is already loaded replaces it; a file with
``extends = "NAME"`` is applied on top of the loaded ``NAME`` instead (its ``models`` merged
model by model, ``endpoints`` merged by method and path, every other field replaced). Within a
directory, plain declarations load before extensions. Last, ``upstreams`` override base URLs.
"""

from __future__ import annotations

import logging
import os
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from effectguard.errors import ConfigError
from effectguard.providers.advice import undeclared_5xx_warning
from effectguard.providers.baseurl import checked_base_url
from effectguard.providers.endpoints import path_shape
from effectguard.providers.provider import Provider
from effectguard.providers.validation import build_provider

__all__ = [
    "bundled_dir",
    "load_provider",
    "load_providers",
    "upstream_argument",
]

log = logging.getLogger("effectguard.providers")


def bundled_dir() -> Traversable:
    """The bundled declarations, as package data of :mod:`effectguard.providers`."""
    return resources.files("effectguard.providers") / "bundled"


def load_provider(path: Path) -> Provider:
    """Read and validate one standalone declaration (``extends`` needs :func:`load_providers`)."""
    raw = _read(path)
    if "extends" in raw:
        raise ConfigError(f"{path}: extends: only allowed in a --providers directory")
    return _advised(build_provider(raw, str(path), _stem(path)))


def upstream_argument(name: str) -> str:
    """How a library error names one entry of the ``upstreams`` argument."""
    return f"upstreams={{{name!r}: ...}}"


def load_providers(
    dirs: Sequence[Traversable | str | os.PathLike[str]] = (),
    upstreams: Mapping[str, str] | None = None,
    *,
    name_upstream: Callable[[str], str] = upstream_argument,
) -> dict[str, Provider]:
    """Load the bundled declarations, then each directory's, then the base URL overrides.

    An error about an override names it with ``name_upstream`` (the library's own
    argument by default; the CLI passes one that names its ``--upstream`` flag).
    """
    loaded: dict[str, Provider] = {}
    raws: dict[str, dict[str, Any]] = {}  # each loaded provider's declaration, for extends
    # A plain path (str, PathLike) is a directory on disk; a Traversable (package data,
    # a zip) is taken as it is.
    wanted = [Path(d) if isinstance(d, str | os.PathLike) else d for d in dirs]
    for directory in (bundled_dir(), *wanted):
        if not directory.is_dir():
            raise ConfigError(f"{directory}: not a directory of provider declarations")
        tomls = [p for p in directory.iterdir() if p.name.endswith(".toml")]
        files = [(p, _read(p)) for p in sorted(tomls, key=lambda p: p.name)]
        seen: dict[str, Traversable] = {}
        # Plain declarations first, so an extension may build on a file of the same directory.
        for path, raw in sorted(files, key=lambda item: "extends" in item[1]):
            full = _resolve(path, raw, raws)
            provider = _advised(build_provider(full, str(path), _stem(path)))
            if "extends" not in raw and provider.name in seen:
                other = seen[provider.name]
                raise ConfigError(f"{path}: name: {provider.name!r} also declared by {other}")
            seen[provider.name] = path
            loaded[provider.name] = provider
            raws[provider.name] = full
    for name, url in (upstreams or {}).items():
        if name not in loaded:
            known = ", ".join(sorted(loaded))
            raise ConfigError(f"{name_upstream(name)}: unknown provider (known: {known})")
        loaded[name] = replace(loaded[name], base_url=checked_base_url(url, name_upstream(name)))
    return loaded


def _advised(provider: Provider) -> Provider:
    """``provider``, once any load-time advice on it is logged (a warning, not an error)."""
    if (warning := undeclared_5xx_warning(provider)) is not None:
        log.warning("%s", warning)
    return provider


def _resolve(
    path: Traversable, raw: dict[str, Any], raws: Mapping[str, dict[str, Any]]
) -> dict[str, Any]:
    """The full declaration of ``raw``: itself, or merged onto the provider it extends."""
    if "extends" not in raw:
        return raw
    base_name = raw["extends"]
    if not isinstance(base_name, str) or base_name not in raws:
        raise ConfigError(f"{path}: extends: {base_name!r} is not a loaded provider")
    merged = _merge(dict(raws[base_name]), {k: v for k, v in raw.items() if k != "extends"})
    # Without a name of its own, an extension changes the provider it extends.
    merged.setdefault("name", base_name)
    return merged


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    for key, value in over.items():
        if key == "models" and isinstance(value, dict) and isinstance(base.get(key), dict):
            models = dict(base[key])
            for model, fields in value.items():
                old = models.get(model)
                # Field by field, so an override may change one price of a known model.
                if isinstance(old, dict) and isinstance(fields, dict):
                    fields = {**old, **fields}
                models[model] = fields
            base[key] = models
        elif key == "endpoints" and isinstance(value, list) and isinstance(base.get(key), list):
            keyed = {_endpoint_key(e): e for e in base[key]}
            keyed.update({_endpoint_key(e): e for e in value})
            base[key] = list(keyed.values())
        else:
            base[key] = value
    return base


def _endpoint_key(entry: object) -> tuple[str, str]:
    if not isinstance(entry, dict):
        return ("", repr(entry))
    return (str(entry.get("method", "POST")).upper(), path_shape(str(entry.get("path"))))


def _stem(path: Traversable) -> str:
    return path.name.removesuffix(".toml")


def _read(path: Traversable) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:  # TOML is UTF-8; tomllib.load decodes it unchecked
        raise ConfigError(f"{path}: not UTF-8 ({exc.reason} at byte {exc.start})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
