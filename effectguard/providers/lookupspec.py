"""Lookup declarations: how to ask a provider whether an operation was applied, and how
its answer reads (``[endpoints.lookup]``, docs/contract.md §2.2).

Parsed and validated into frozen :class:`Lookup` values; no I/O. The templates a lookup
sends (its URL, query and form fields) are checked by :mod:`effectguard.providers.templates`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

from effectguard.errors import ConfigError
from effectguard.providers.templates import (
    MAX_LOOKUP_TIMEOUT_S,
    fields_error,
    lookup_url_error,
    uses_field,
)

__all__ = [
    "HEADER_NAME",
    "JSON_FIELD",
    "METHOD",
    "Lookup",
    "OpSource",
    "legacy_lookup",
    "parse_lookup",
]

OpSource = Literal["call_id", "idempotency_key"]
Fail = Callable[[str, str], ConfigError]

#: An HTTP header name (RFC 9110 token); declarations name headers with it.
HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")
METHOD = re.compile(r"[A-Z]+")
#: A JSON (or form) field path: ``metadata.effectguard_op``, ``data[0]``.
JSON_FIELD = re.compile(r"[A-Za-z0-9_\-\[\]]+(\.[A-Za-z0-9_\-\[\]]+)*")
_LOOKUP_KEYS = frozenset(
    {
        "method",
        "url",
        "query",
        "form",
        "applied",
        "results",
        "match",
        "not_found",
        "freshness_s",
        "retention_s",
        "op",
        "timeout_s",
        "scope_headers",
    }
)


@dataclass(frozen=True, slots=True)
class Lookup:
    """A request that asks the provider "was operation ``{op}`` applied?", and its reading.

    ``url`` may use ``{base_url}`` and ``{op}``; ``query`` and ``form`` values may use
    ``{op}`` (``form`` fields go form-encoded in the body of a POST). An answer
    in which the JSON path ``applied`` is present (and not null, false or empty) means
    applied, and its value is the recovered object where it is a JSON object; otherwise a
    status in ``not_found`` means "not found", but a success status only when its body is
    JSON whose result collection (the path ``results``) is present and empty (an HTML
    error page answered 200 proves nothing); anything else is unknown. "Not found"
    proves "not applied" only once the call's last attempt is older than ``freshness_s``
    (search indexes lag); before that it is unknown too, and so it is again once the call
    is older than ``retention_s`` (None: the provider never forgets an operation). A
    success that is not strictly the declared shape reads unknown (rules/lookups).
    """

    url: str
    applied: str
    not_found: frozenset[int]
    freshness_s: float
    method: str = "GET"
    query: tuple[tuple[str, str], ...] = ()
    op: OpSource = "call_id"
    timeout_s: float = 5.0
    retention_s: float | None = None
    #: The JSON path of the answer's result collection (``data``): a success reads "not
    #: found" only when it is there and empty. Required where a success is ``not_found``.
    results: str | None = None
    #: Form fields sent form-encoded as the request's body (a POST search); values may
    #: use ``{op}``.
    form: tuple[tuple[str, str], ...] = ()
    #: The JSON path, inside the found object, of the operation id it carries
    #: (``metadata.effectguard_op``): an object whose value there is not the op looked
    #: for is another operation's, and proves nothing. None: the search is trusted to
    #: answer only for the op it was asked about.
    match: str | None = None
    #: Request headers (lowercase) that name the account an operation acts in (Stripe's
    #: ``Stripe-Account``): recorded with the call and sent with its lookup, which would
    #: otherwise search another account and find nothing.
    scope_headers: tuple[str, ...] = ()


def parse_lookup(table: object, where: str, fail: Fail, has_op_id: bool) -> Lookup:
    """A ``lookup`` table (see :class:`Lookup`)."""
    if not isinstance(table, dict):
        raise fail(where, "must be a table")
    unknown = sorted(set(table) - _LOOKUP_KEYS)
    if unknown:
        raise fail(f"{where}.{unknown[0]}", "unknown field")
    url, method, query, form = _lookup_request(table, where, fail)
    op = table.get("op", "call_id" if has_op_id else "idempotency_key")
    if op not in ("call_id", "idempotency_key"):
        raise fail(f"{where}.op", "must be call_id or idempotency_key")
    if op == "call_id" and not has_op_id:
        raise fail(f"{where}.op", "call_id needs the endpoint's op_id (where the id is written)")
    applied, not_found, results = _lookup_reading(table, where, fail)
    match = table.get("match")
    if match is not None and (not isinstance(match, str) or not JSON_FIELD.fullmatch(match)):
        raise fail(f"{where}.match", "must be a JSON path such as metadata.effectguard_op")
    return Lookup(
        url=url,
        applied=applied,
        not_found=not_found,
        freshness_s=_seconds(table, "freshness_s", where, fail, required=True),
        method=method,
        query=query,
        op=cast(OpSource, op),
        timeout_s=_timeout(table, where, fail),
        retention_s=(
            _seconds(table, "retention_s", where, fail) if "retention_s" in table else None
        ),
        results=results,
        form=form,
        match=match,
        scope_headers=_scope_headers(
            table.get("scope_headers", []), f"{where}.scope_headers", fail
        ),
    )


def _scope_headers(value: object, where: str, fail: Fail) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(
        isinstance(h, str) and HEADER_NAME.fullmatch(h) for h in value
    ):
        raise fail(where, "must be a list of header names")
    return tuple(h.lower() for h in value)


Fields = tuple[tuple[str, str], ...]


def _lookup_request(
    table: Mapping[str, Any], where: str, fail: Fail
) -> tuple[str, str, Fields, Fields]:
    """The lookup request's URL template, method, query fields and form fields."""
    url = table.get("url")
    if not isinstance(url, str):
        raise fail(f"{where}.url", "must be a URL template starting with {base_url} or http(s)")
    why = lookup_url_error(url, "op")
    if why is not None:
        raise fail(f"{where}.url", why)
    method = table.get("method", "GET")
    if not isinstance(method, str) or not METHOD.fullmatch(method.upper()):
        raise fail(f"{where}.method", "must be an HTTP method")
    fields: dict[str, Fields] = {}
    for key in ("query", "form"):
        given = table.get(key, {})
        if not isinstance(given, dict) or not all(isinstance(v, str) for v in given.values()):
            raise fail(f"{where}.{key}", "must be a table of strings")
        for text in given.values():
            # Formatted with the op alone when the lookup is sent (callpath/resolve.py).
            why = fields_error(text, ("op",), None)
            if why is not None:
                raise fail(f"{where}.{key}", why)
        fields[key] = tuple((str(k), v) for k, v in given.items())
    if fields["form"] and method.upper() in ("GET", "HEAD"):
        raise fail(f"{where}.form", 'form fields are a request body: declare method = "POST"')
    values = [url] + [v for _, v in fields["query"] + fields["form"]]
    if not any(uses_field(text, "op") for text in values):
        raise fail(
            f"{where}.url",
            "the url, a query field or a form field must contain {op} (a doubled brace, "
            "{{op}}, is literal text)",
        )
    return url, method.upper(), fields["query"], fields["form"]


def _timeout(table: Mapping[str, Any], where: str, fail: Fail) -> float:
    """``timeout_s``: more than 0 (a lookup that may take no time is never asked) and at
    most :data:`MAX_LOOKUP_TIMEOUT_S`."""
    timeout = _seconds(table, "timeout_s", where, fail, default=5.0, at_most=MAX_LOOKUP_TIMEOUT_S)
    if timeout == 0:
        raise fail(f"{where}.timeout_s", "must be a finite number of seconds > 0")
    return timeout


def _lookup_reading(
    table: Mapping[str, Any], where: str, fail: Fail
) -> tuple[str, frozenset[int], str | None]:
    """How the answer reads: the applied path, the not-found statuses, the result list."""
    applied = table.get("applied")
    if not isinstance(applied, str) or not JSON_FIELD.fullmatch(applied):
        raise fail(f"{where}.applied", "must be a JSON path such as data[0]")
    not_found = table.get("not_found", [404])
    if not isinstance(not_found, list) or not all(
        isinstance(s, int) and not isinstance(s, bool) and 100 <= s <= 599 for s in not_found
    ):
        raise fail(f"{where}.not_found", "must be a list of HTTP statuses")
    results = table.get("results")
    if results is not None and (not isinstance(results, str) or not JSON_FIELD.fullmatch(results)):
        raise fail(f"{where}.results", "must be a JSON path such as data")
    if results is None and any(200 <= s < 300 for s in not_found):
        # Else any 200 (an HTML error page, JSON of another shape) would read "not found".
        raise fail(f"{where}.results", "a success status in not_found needs the result "
                   "collection's JSON path, which must be there and empty")  # fmt: skip
    return applied, frozenset(not_found), results


def legacy_lookup(template: str) -> Lookup:
    """The older provider-level ``lookup = "{base_url}/ops/{key}"``: asks by the provider
    idempotency key; ``{"applied": true}`` means applied, ``{"applied": false}`` not
    applied, and any other answer is unknown."""
    return Lookup(
        url=template.replace("{key}", "{op}"),
        applied="applied",
        results="applied",
        not_found=frozenset({200}),
        freshness_s=0.0,
        op="idempotency_key",
    )


def _seconds(
    table: Mapping[str, Any],
    key: str,
    where: str,
    fail: Fail,
    *,
    required: bool = False,
    default: float = 0.0,
    at_most: float = math.inf,
) -> float:
    """A finite number of seconds, 0 to ``at_most``. NaN compares false with every age, so
    a NaN ``freshness_s`` read a fresh "not found" as "not applied"; infinity is no
    duration either."""
    value = table.get(key)
    if value is None and not required:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 <= value <= at_most
        or not math.isfinite(value)
    ):
        bound = "" if math.isinf(at_most) else f" and at most {at_most:.0f}"
        raise fail(f"{where}.{key}", f"must be a finite number of seconds >= 0{bound}")
    return float(value)
