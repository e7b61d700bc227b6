"""Provider declarations: what each upstream charges and which requests have effects.

Providers are declared in TOML files, not coded (docs/contract.md §2). The bundled files are
package data (``effectguard/providers/bundled/``, read with :mod:`importlib.resources`, so
they are there from a wheel too); ``openai.toml`` documents the file shape. This module
reads and validates them into frozen values; it does no other I/O.

Loading order (:func:`load_providers`): the bundled files, then each ``--providers`` directory
in order. A file whose provider name is already loaded replaces it; a file with
``extends = "NAME"`` is applied on top of the loaded ``NAME`` instead (its ``models`` merged
model by model, ``endpoints`` merged by method and path, every other field replaced). Within a
directory, plain declarations load before extensions. Last, ``upstreams`` override base URLs.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import date
from decimal import Decimal, InvalidOperation
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, cast
from urllib.parse import urlsplit

from effectguard.errors import ConfigError
from effectguard.providers.endpoints import (
    HEADER_NAME,
    Endpoint,
    IdempotencyGuarantee,
    Lookup,
    default_endpoint,
    legacy_lookup,
    parse_endpoint,
    parse_idempotency,
)
from effectguard.rules.counts import parse_count
from effectguard.rules.errorshape import ERROR_SHAPES, ErrorShape, shape_of_dialect
from effectguard.rules.money import Nanos, usd_to_nanos
from effectguard.rules.prices import ModelPrice

__all__ = [
    "AnswerEffect",
    "Dialect",
    "Endpoint",
    "IdempotencyGuarantee",
    "ModelPrice",
    "Provider",
    "TransientEffect",
    "bundled_dir",
    "load_provider",
    "load_providers",
]

Dialect = Literal["openai", "anthropic", "flat"]
#: What a declared transient status means for the effect: "none" (the request was not
#: worked on; resend) or "unknown" (it may have been; hold and reconcile).
TransientEffect = Literal["none", "unknown"]
#: What an answer's status means for the effect, by the declaration.
AnswerEffect = Literal["applied", "none", "unknown"]

_DIALECTS = ("openai", "anthropic", "flat")
_TRANSIENT_EFFECTS = ("none", "unknown")
_KEY_FORMATS = {"authorization": "Bearer {key}", "x-api-key": "{key}"}
_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# A dated snapshot suffix: OpenAI "-2024-07-18", Anthropic "-20250929", or the "-latest" alias.
_SNAPSHOT = re.compile(r"\d{4}-\d{2}-\d{2}|\d{8}|latest")

_TOP_KEYS = frozenset(
    {
        "name", "extends", "base_url", "dialect", "api_key_env", "key_header", "key_format",
        "prices_taken", "not_processed", "retry_statuses", "transient", "lookup",
        "idempotency", "endpoints", "models", "error_shape",
    }
)  # fmt: skip
#: A model's optional prices (USD strings), beside the required input and output.
_EXTRA_PRICES = (
    "cached_input", "cache_write", "cache_write_1h", "per_call", "web_search", "audio_minute"
)  # fmt: skip
_MODEL_KEYS = frozenset({"input", "output", "max_output_tokens", *_EXTRA_PRICES})


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
        return next((e for e in self.endpoints if e.matches(method, path)), None)

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


def bundled_dir() -> Traversable:
    """The bundled declarations, as package data of :mod:`effectguard.providers`."""
    return resources.files("effectguard.providers") / "bundled"


def load_provider(path: Path) -> Provider:
    """Read and validate one standalone declaration (``extends`` needs :func:`load_providers`)."""
    raw = _read(path)
    if "extends" in raw:
        raise ConfigError(f"{path}: extends: only allowed in a --providers directory")
    return _build(raw, str(path), _stem(path))


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
            provider = _build(full, str(path), _stem(path))
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
        loaded[name] = replace(loaded[name], base_url=_url(url, name_upstream(name)))
    return loaded


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
    return (str(entry.get("method", "POST")).upper(), str(entry.get("path")))


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


def _build(raw: Mapping[str, Any], source: str, default_name: str) -> Provider:
    """Validate a parsed declaration; every error names ``source`` and the field."""

    def fail(where: str, why: str) -> ConfigError:
        return ConfigError(f"{source}: {where}: {why}")

    unknown = sorted(set(raw) - _TOP_KEYS)
    if unknown:
        raise fail(unknown[0], "unknown field")
    name = _str(raw, "name", fail, default=default_name)
    if not _NAME.fullmatch(name):
        raise fail("name", "must be lowercase letters, digits, '_', '.' or '-'")
    dialect = _str(raw, "dialect", fail)
    if dialect not in _DIALECTS:
        raise fail("dialect", f"must be one of {', '.join(_DIALECTS)}")
    api_key_env = _str(raw, "api_key_env", fail, default=None)
    if api_key_env is not None and not _ENV_NAME.fullmatch(api_key_env):
        raise fail("api_key_env", "must be an environment variable NAME, never the key")
    key_header = _str(raw, "key_header", fail, default="authorization").lower()
    if not HEADER_NAME.fullmatch(key_header):
        raise fail("key_header", "must be an HTTP header name")
    key_format = _str(raw, "key_format", fail, default=_KEY_FORMATS.get(key_header, "{key}"))
    if "{key}" not in key_format:
        raise fail("key_format", "must contain {key}")
    not_processed = _statuses(raw, "not_processed", fail)
    transient = _transient(raw, fail)
    both = sorted(not_processed & set(transient))
    if both:
        raise fail(f"transient.{both[0]}", "also in not_processed: a status has one meaning")
    retry = _statuses(raw, "retry_statuses", fail)
    # Only an answer that proves nothing happened may be retried automatically (contract.md §3.4).
    no_effect = not_processed | {s for s, e in transient.items() if e == "none"}
    if not retry <= no_effect:
        extra = ", ".join(str(s) for s in sorted(retry - no_effect))
        raise fail("retry_statuses", f'{extra} not in not_processed (or transient "none")')
    lookup = _lookup_template(raw, fail)
    idempotency = parse_idempotency(raw.get("idempotency"), "idempotency", fail)
    return Provider(
        name=name,
        base_url=_url(_str(raw, "base_url", fail), f"{source}: base_url"),
        dialect=cast(Dialect, dialect),
        api_key_env=api_key_env,
        key_header=key_header,
        key_format=key_format,
        models=MappingProxyType(_models(raw, fail)),
        endpoints=_endpoints(raw, fail, idempotency, lookup),
        not_processed=not_processed,
        retry_statuses=retry,
        idempotency=idempotency,
        lookup=lookup,
        prices_taken=_prices_taken(raw, fail),
        source=source,
        transient=MappingProxyType(transient),
        error_shape=_error_shape(raw, fail, dialect),
    )


def _error_shape(raw: Mapping[str, Any], fail: _Fail, dialect: str) -> ErrorShape:
    shape = _str(raw, "error_shape", fail, default=shape_of_dialect(dialect))
    if shape not in ERROR_SHAPES:
        raise fail("error_shape", f"must be one of {', '.join(ERROR_SHAPES)}")
    return cast(ErrorShape, shape)


_Fail = Callable[[str, str], ConfigError]


def _lookup_template(raw: Mapping[str, Any], fail: _Fail) -> str | None:
    """The provider-level ``lookup`` URL template (by provider idempotency key), if any."""
    lookup: str | None = _str(raw, "lookup", fail, default=None)
    if lookup is not None:
        try:
            lookup.format(base_url="", key="")
        except (KeyError, IndexError, ValueError) as exc:
            raise fail("lookup", "only {base_url} and {key} may be used") from exc
        if "{key}" not in lookup:
            raise fail("lookup", "must contain {key}")
    return lookup


"""Builds the error for a field: ``fail("models.x.input", "required")``."""

_MISSING: Any = object()


def _str(raw: Mapping[str, Any], key: str, fail: _Fail, default: Any = _MISSING) -> Any:
    value = raw.get(key, default)
    if value is _MISSING:
        raise fail(key, "required")
    if value is not None and not isinstance(value, str):
        raise fail(key, "must be a string")
    return value


def _url(url: object, where: str) -> str:
    if not isinstance(url, str):
        raise ConfigError(f"{where}: must be a string")
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # e.g. an unclosed IPv6 bracket
        raise ConfigError(f"{where}: must be an http(s) URL, got {url!r} ({exc})") from exc
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"{where}: must be an http(s) URL, got {url!r}")
    if parts.query or parts.fragment:
        raise ConfigError(f"{where}: must not have a query or fragment")
    return url.rstrip("/")


def _statuses(raw: Mapping[str, Any], key: str, fail: _Fail) -> frozenset[int]:
    value = raw.get(key, [])
    if not isinstance(value, list):
        raise fail(key, "must be a list of HTTP statuses")
    for status in value:
        if isinstance(status, bool) or not isinstance(status, int) or not 100 <= status <= 599:
            raise fail(key, f"{status!r} is not an HTTP status (an integer 100-599)")
    return frozenset(value)


def _transient(raw: Mapping[str, Any], fail: _Fail) -> dict[int, TransientEffect]:
    """``[transient]``: documented transient statuses and what each means for the effect."""
    table = raw.get("transient", {})
    if not isinstance(table, dict):
        raise fail("transient", 'must be a table of statuses: 500 = "unknown"')
    result: dict[int, TransientEffect] = {}
    for key, effect in table.items():
        where = f"transient.{key}"
        status = parse_count(str(key), 599)
        if status is None or not 100 <= status <= 599:
            raise fail(where, "is not an HTTP status (an integer 100-599)")
        if effect not in _TRANSIENT_EFFECTS:
            raise fail(where, f"must be one of {', '.join(_TRANSIENT_EFFECTS)}")
        result[status] = cast(TransientEffect, effect)
    return result


def _prices_taken(raw: Mapping[str, Any], fail: _Fail) -> str:
    value = raw.get("prices_taken", _MISSING)
    if value is _MISSING:
        raise fail("prices_taken", "required (the date the prices were taken, YYYY-MM-DD)")
    if isinstance(value, date):
        return value.isoformat()
    try:
        return date.fromisoformat(value).isoformat()
    except (TypeError, ValueError) as exc:
        raise fail("prices_taken", "must be a date, YYYY-MM-DD") from exc


def _usd(value: object, where: str, fail: _Fail) -> Nanos:
    if isinstance(value, float):
        raise fail(
            where, f'must be a decimal USD string such as "{value}" (TOML floats are not exact)'
        )
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise fail(where, "must be a decimal USD string")
    try:
        amount = Decimal(value)
    except InvalidOperation as exc:
        raise fail(where, f"must be a decimal USD string, got {value!r}") from exc
    if not amount.is_finite() or amount < 0:
        raise fail(where, f"must be a non-negative decimal USD string, got {value!r}")
    return usd_to_nanos(amount)


def _models(raw: Mapping[str, Any], fail: _Fail) -> dict[str, ModelPrice]:
    table = raw.get("models", {})
    if not isinstance(table, dict):
        raise fail("models", "must be a table of models")
    models: dict[str, ModelPrice] = {}
    for model, spec in table.items():
        where = f"models.{model}"
        if not isinstance(spec, dict):
            raise fail(where, "must be a table")
        unknown = sorted(set(spec) - _MODEL_KEYS)
        if unknown:
            raise fail(f"{where}.{unknown[0]}", "unknown field")
        per_call = spec.get("per_call")
        # A per-call priced tool may leave the token prices out (they are then zero).
        token_default = "0" if per_call is not None else _MISSING
        prices: dict[str, Nanos | None] = {}
        for key in ("input", "output", *_EXTRA_PRICES):
            value = spec.get(key, token_default if key in ("input", "output") else None)
            if value is _MISSING:
                raise fail(f"{where}.{key}", "required")
            prices[key] = None if value is None else _usd(value, f"{where}.{key}", fail)
        max_out = spec.get("max_output_tokens", 4096)
        if isinstance(max_out, bool) or not isinstance(max_out, int) or max_out < 0:
            raise fail(f"{where}.max_output_tokens", "must be a non-negative integer")
        models[model] = ModelPrice(
            input=cast(int, prices["input"]),
            output=cast(int, prices["output"]),
            cached_input=prices["cached_input"],
            cache_write=prices["cache_write"],
            cache_write_1h=prices["cache_write_1h"],
            max_output_tokens=max_out,
            per_call=prices["per_call"],
            web_search=prices["web_search"],
            audio_minute=prices["audio_minute"],
        )
    return models


def _endpoints(
    raw: Mapping[str, Any],
    fail: _Fail,
    idempotency: IdempotencyGuarantee | None,
    lookup: str | None,
) -> tuple[Endpoint, ...]:
    entries = raw.get("endpoints", [])
    if not isinstance(entries, list):
        raise fail("endpoints", "must be an array of tables ([[endpoints]])")
    default_lookup = None if lookup is None else legacy_lookup(lookup)
    result: list[Endpoint] = []
    for i, entry in enumerate(entries):
        where = f"endpoints[{i}]"
        endpoint = parse_endpoint(entry, where, fail, idempotency, default_lookup)
        if any(e.method == endpoint.method and e.path == endpoint.path for e in result):
            raise fail(f"{where}.path", f"{endpoint.method} {endpoint.path} declared twice")
        result.append(endpoint)
    return tuple(result)
