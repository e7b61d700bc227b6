"""A parsed declaration checked field by field into a :class:`~.provider.Provider`.

Every error names the file and the field (``models.x.input: required``), so a user can
fix a declaration from the message alone.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from datetime import date
from types import MappingProxyType
from typing import Any, cast

from effectguard.errors import ConfigError
from effectguard.providers.baseurl import checked_base_url
from effectguard.providers.endpoints import (
    HEADER_NAME,
    Endpoint,
    IdempotencyGuarantee,
    legacy_lookup,
    parse_endpoint,
    parse_idempotency,
    path_shape,
    usd_price,
)
from effectguard.providers.provider import Dialect, Provider, TransientEffect
from effectguard.providers.templates import fields_error, lookup_url_error
from effectguard.rules.counts import parse_count
from effectguard.rules.errorshape import ERROR_SHAPES, ErrorShape, shape_of_dialect
from effectguard.rules.money import Nanos
from effectguard.rules.prices import ModelPrice

_DIALECTS = ("openai", "anthropic", "flat")
_TRANSIENT_EFFECTS = ("none", "unknown")
_KEY_FORMATS = {"authorization": "Bearer {key}", "x-api-key": "{key}"}
_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

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

_Fail = Callable[[str, str], ConfigError]
"""Builds the error for a field: ``fail("models.x.input", "required")``."""

_MISSING: Any = object()


def build_provider(raw: Mapping[str, Any], source: str, default_name: str) -> Provider:
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
    if (why := fields_error(key_format, ("key",), "key")) is not None:
        raise fail("key_format", why)
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
        base_url=checked_base_url(_str(raw, "base_url", fail), f"{source}: base_url"),
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


def _lookup_template(raw: Mapping[str, Any], fail: _Fail) -> str | None:
    """The provider-level ``lookup`` URL template (by provider idempotency key), if any."""
    lookup: str | None = _str(raw, "lookup", fail, default=None)
    if lookup is not None:
        why = fields_error(lookup, ("base_url", "key"), "key") or lookup_url_error(lookup, "key")
        if why is not None:
            raise fail("lookup", why)
    return lookup


def _str(raw: Mapping[str, Any], key: str, fail: _Fail, default: Any = _MISSING) -> Any:
    value = raw.get(key, default)
    if value is _MISSING:
        raise fail(key, "required")
    if value is not None and not isinstance(value, str):
        raise fail(key, "must be a string")
    return value


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
    return usd_price(value, where, fail)


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
        shape = path_shape(endpoint.path)
        if any(e.method == endpoint.method and path_shape(e.path) == shape for e in result):
            raise fail(f"{where}.path", f"{endpoint.method} {endpoint.path} declared twice")
        result.append(endpoint)
    return tuple(result)
