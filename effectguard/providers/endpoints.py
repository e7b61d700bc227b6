"""Endpoint declarations: what a request to one endpoint does, and how to find out later.

Each ``[[endpoints]]`` entry of a provider declaration says (docs/contract.md §2.2):

* its **effect kind**: ``read_only`` (passed through), ``at_most_once`` (the default for
  anything billable: an unknown effect waits for evidence or a person) or ``idempotent``
  (the provider deduplicates on a header or a JSON body field, within a window).
  ``billable`` is accepted as the older name: it means ``idempotent`` where the provider's
  ``[idempotency]`` table declares a default guarantee, else ``at_most_once``;
* where effectguard writes the call's **operation id** (``op_id``): a header, a JSON body
  field (dotted path) or a form field, so that a provider that keeps it can be searched;
* a **lookup**: the request that asks the provider whether an operation was applied, how
  its answer reads, and how fresh the provider's search is (:class:`Lookup`).

This module parses and validates those entries into frozen values; it does no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, Literal, cast

from effectguard.errors import ConfigError
from effectguard.rules.money import usd_to_nanos

__all__ = [
    "Effect",
    "Endpoint",
    "IdempotencyGuarantee",
    "Lookup",
    "OpIdPlacement",
    "Units",
    "parse_endpoint",
    "parse_idempotency",
    "parse_lookup",
]

Effect = Literal["read_only", "at_most_once", "idempotent"]
OpSource = Literal["call_id", "idempotency_key"]
Placement = Literal["header", "json", "form"]

_EFFECTS = ("read_only", "at_most_once", "idempotent", "billable")
#: An HTTP header name (RFC 9110 token); declarations name headers with it.
HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")
_METHOD = re.compile(r"[A-Z]+")
_FIELD = re.compile(r"[A-Za-z0-9_\-\[\]]+(\.[A-Za-z0-9_\-\[\]]+)*")
_ENDPOINT_KEYS = frozenset(
    {
        "path",
        "method",
        "effect",
        "idempotency",
        "op_id",
        "lookup",
        "per_call",
        "cost_deferred",
        "units",
    }
)
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

Fail = Callable[[str, str], ConfigError]


@dataclass(frozen=True, slots=True)
class IdempotencyGuarantee:
    """A provider-documented dedup: a request repeating the key within the window applies
    once. The key travels in ``header``, or in the JSON body field ``body_field``."""

    header: str | None
    window_seconds: float
    body_field: str | None = None


@dataclass(frozen=True, slots=True)
class OpIdPlacement:
    """Where the call's operation id is written into the outgoing request.

    The operation id is the **call id**: unique across tenants (a client's
    ``Idempotency-Key`` is scoped to its budget root, so two tenants may both use
    "order-1", and a provider-wide search for it could find the other's effect), present
    for key-less calls too, and the same on every attempt of the call.
    """

    where: Placement
    name: str

    @property
    def label(self) -> str:
        """How an attempt records this place (``attempt.started``'s ``op_id_in``): the kind
        and the name, a header's in lower case (header names are case-insensitive)."""
        return f"{self.where} {self.name.lower() if self.where == 'header' else self.name}"


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


@dataclass(frozen=True, slots=True)
class Units:
    """How many billed units one request is (an email's recipients): the entries, split on
    ``separator``, of the request's top-level JSON string ``fields``. The call is priced at
    its per-call price times that count (at least one)."""

    fields: tuple[str, ...]
    separator: str = ","
    #: A top-level list of messages, each naming its own ``fields``, where one request
    #: sends many (Postmark's ``/email/batchWithTemplates``): every message counts.
    items: str | None = None


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One declared endpoint: its effect kind, and what effectguard adds to its requests."""

    path: str
    effect: Effect
    method: str = "POST"
    idempotency: IdempotencyGuarantee | None = None
    op_id: OpIdPlacement | None = None
    lookup: Lookup | None = None
    #: The price, in nanos, of a request that names no model (a file upload, a batch).
    per_call: int | None = None
    #: The provider bills this call's real cost later, apart from it (a batch): the ledger
    #: records only the declared per-call price, and flags the call as such.
    cost_deferred: bool = False
    #: The provider bills per unit the request names, not per request.
    units: Units | None = None

    def matches(self, method: str, path: str) -> bool:
        """Whether a request ``method path`` (no query string) targets this endpoint."""
        if method.upper() != self.method:
            return False
        want, got = self.path.split("/"), path.split("/")
        if len(want) != len(got):
            return False
        return all(
            (w.startswith("{") and w.endswith("}") and g != "") or w == g
            for w, g in zip(want, got, strict=True)
        )


def default_endpoint(
    path: str, method: str, idempotency: IdempotencyGuarantee | None, lookup: Lookup | None
) -> Endpoint:
    """How an undeclared endpoint is treated: billable, with the provider's defaults."""
    effect: Effect = "idempotent" if idempotency is not None else "at_most_once"
    return Endpoint(path, effect, method.upper(), idempotency, None, lookup)


def parse_endpoint(
    entry: object,
    where: str,
    fail: Fail,
    default_idempotency: IdempotencyGuarantee | None,
    default_lookup: Lookup | None,
) -> Endpoint:
    """One ``[[endpoints]]`` entry; the provider's ``[idempotency]`` and ``lookup`` are the
    defaults of its billable endpoints."""
    if not isinstance(entry, dict):
        raise fail(where, "must be a table")
    unknown = sorted(set(entry) - _ENDPOINT_KEYS)
    if unknown:
        raise fail(f"{where}.{unknown[0]}", "unknown field")
    path = entry.get("path")
    if not isinstance(path, str) or not path.startswith("/") or "?" in path or "#" in path:
        raise fail(f"{where}.path", "must start with '/' and carry no query")
    method = entry.get("method", "POST")
    if not isinstance(method, str) or not _METHOD.fullmatch(method.upper()):
        raise fail(f"{where}.method", "must be an HTTP method")
    declared = entry.get("effect")
    if declared not in _EFFECTS:
        raise fail(f"{where}.effect", f"must be one of {', '.join(_EFFECTS)}")
    if declared == "read_only":
        for extra in ("idempotency", "op_id", "lookup", "per_call", "cost_deferred", "units"):
            if extra in entry:
                raise fail(f"{where}.{extra}", "a read_only endpoint has no effect to guard")
        return Endpoint(path, "read_only", method.upper())
    own = parse_idempotency(entry.get("idempotency"), f"{where}.idempotency", fail)
    effect, idempotency = _effect(declared, own, default_idempotency, where, fail)
    op_id = _op_id(entry.get("op_id"), f"{where}.op_id", fail)
    lookup = default_lookup
    if "lookup" in entry:
        lookup = parse_lookup(entry["lookup"], f"{where}.lookup", fail, op_id is not None)
        if lookup.op == "idempotency_key" and idempotency is None:
            raise fail(f"{where}.lookup.op", "idempotency_key needs an idempotent endpoint")
    per_call = _per_call(entry.get("per_call"), f"{where}.per_call", fail)
    deferred = entry.get("cost_deferred", False)
    if not isinstance(deferred, bool):
        raise fail(f"{where}.cost_deferred", "must be true or false")
    units = _units(entry.get("units"), f"{where}.units", fail)
    return Endpoint(
        path, effect, method.upper(), idempotency, op_id, lookup, per_call, deferred, units
    )


def _units(value: object, where: str, fail: Fail) -> Units | None:
    """``units = { fields = ["To", "Cc"], separator = ",", items = "Messages" }``."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"fields", "separator", "items"}:
        raise fail(where, "must be a table of fields (and separator, items)")
    fields = value.get("fields")
    if (
        not isinstance(fields, list)
        or not fields
        or not all(isinstance(f, str) and f for f in fields)
    ):
        raise fail(f"{where}.fields", "must be a non-empty list of JSON field names")
    separator = value.get("separator", ",")
    if not isinstance(separator, str) or not separator:
        raise fail(f"{where}.separator", "must be a non-empty string")
    items = value.get("items")
    if items is not None and (not isinstance(items, str) or not items):
        raise fail(f"{where}.items", "must be a JSON field name")
    return Units(tuple(fields), separator, items)


def _per_call(value: object, where: str, fail: Fail) -> int | None:
    """A USD decimal string as nanos (a TOML float is not exact, so it is refused)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise fail(where, 'must be a decimal USD string such as "0.01"')
    try:
        amount = Decimal(value)
    except InvalidOperation as exc:
        raise fail(where, f"must be a decimal USD string, got {value!r}") from exc
    if not amount.is_finite() or amount < 0:
        raise fail(where, f"must be a non-negative decimal USD string, got {value!r}")
    return usd_to_nanos(amount)


def _effect(
    declared: str,
    own: IdempotencyGuarantee | None,
    default: IdempotencyGuarantee | None,
    where: str,
    fail: Fail,
) -> tuple[Effect, IdempotencyGuarantee | None]:
    if declared == "at_most_once":
        if own is not None:
            raise fail(f"{where}.idempotency", 'only an "idempotent" endpoint declares one')
        return "at_most_once", None
    guarantee = own or default
    if declared == "idempotent" and guarantee is None:
        raise fail(f"{where}.idempotency", "an idempotent endpoint needs one (or the provider's)")
    if declared == "billable" and own is not None:
        raise fail(f"{where}.effect", 'an endpoint with its own idempotency is "idempotent"')
    return ("idempotent", guarantee) if guarantee is not None else ("at_most_once", None)


def parse_idempotency(table: object, where: str, fail: Fail) -> IdempotencyGuarantee | None:
    """An ``idempotency`` table: ``header`` or ``body_field``, and ``window_seconds``."""
    if table is None:
        return None
    if not isinstance(table, dict):
        raise fail(where, "must be a table")
    unknown = sorted(set(table) - {"header", "body_field", "window_seconds"})
    if unknown:
        raise fail(f"{where}.{unknown[0]}", "unknown field")
    header, body_field = table.get("header"), table.get("body_field")
    if (header is None) == (body_field is None):
        raise fail(where, "declare exactly one of header or body_field")
    if header is not None and (not isinstance(header, str) or not HEADER_NAME.fullmatch(header)):
        raise fail(f"{where}.header", "must be an HTTP header name")
    if body_field is not None and (
        not isinstance(body_field, str) or not _FIELD.fullmatch(body_field)
    ):
        raise fail(f"{where}.body_field", "must be a JSON field path such as a.b")
    window = table.get("window_seconds")
    if isinstance(window, bool) or not isinstance(window, int | float) or not window > 0:
        raise fail(f"{where}.window_seconds", "must be a number of seconds > 0")
    return IdempotencyGuarantee(header, float(window), body_field)


def _op_id(table: object, where: str, fail: Fail) -> OpIdPlacement | None:
    if table is None:
        return None
    if not isinstance(table, dict) or len(table) != 1:
        raise fail(where, 'must name one place: { header = "..." }, { json = "..." } or '
                   '{ form = "..." }')  # fmt: skip
    ((kind, name),) = table.items()
    if kind not in ("header", "json", "form"):
        raise fail(f"{where}.{kind}", "must be header, json or form")
    pattern = HEADER_NAME if kind == "header" else _FIELD
    if not isinstance(name, str) or not pattern.fullmatch(name):
        raise fail(f"{where}.{kind}", "must be a header name or a field path")
    return OpIdPlacement(cast(Placement, kind), name)


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
    if match is not None and (not isinstance(match, str) or not _FIELD.fullmatch(match)):
        raise fail(f"{where}.match", "must be a JSON path such as metadata.effectguard_op")
    return Lookup(
        url=url,
        applied=applied,
        not_found=not_found,
        freshness_s=_seconds(table, "freshness_s", where, fail, required=True),
        method=method,
        query=query,
        op=cast(OpSource, op),
        timeout_s=_seconds(table, "timeout_s", where, fail, default=5.0),
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
    if not isinstance(url, str) or not url.startswith(("{base_url}", "http://", "https://")):
        raise fail(f"{where}.url", "must be a URL template starting with {base_url} or http(s)")
    method = table.get("method", "GET")
    if not isinstance(method, str) or not _METHOD.fullmatch(method.upper()):
        raise fail(f"{where}.method", "must be an HTTP method")
    fields: dict[str, Fields] = {}
    for key in ("query", "form"):
        given = table.get(key, {})
        if not isinstance(given, dict) or not all(isinstance(v, str) for v in given.values()):
            raise fail(f"{where}.{key}", "must be a table of strings")
        for text in given.values():
            _check_template(text, f"{where}.{key}", fail)
        fields[key] = tuple((str(k), v) for k, v in given.items())
    _check_template(url, f"{where}.url", fail)
    if fields["form"] and method.upper() in ("GET", "HEAD"):
        raise fail(f"{where}.form", 'form fields are a request body: declare method = "POST"')
    if "{op}" not in url + "".join(v for _, v in fields["query"] + fields["form"]):
        raise fail(f"{where}.url", "the url, a query field or a form field must contain {op}")
    return url, method.upper(), fields["query"], fields["form"]


def _lookup_reading(
    table: Mapping[str, Any], where: str, fail: Fail
) -> tuple[str, frozenset[int], str | None]:
    """How the answer reads: the applied path, the not-found statuses, the result list."""
    applied = table.get("applied")
    if not isinstance(applied, str) or not _FIELD.fullmatch(applied):
        raise fail(f"{where}.applied", "must be a JSON path such as data[0]")
    not_found = table.get("not_found", [404])
    if not isinstance(not_found, list) or not all(
        isinstance(s, int) and not isinstance(s, bool) and 100 <= s <= 599 for s in not_found
    ):
        raise fail(f"{where}.not_found", "must be a list of HTTP statuses")
    results = table.get("results")
    if results is not None and (not isinstance(results, str) or not _FIELD.fullmatch(results)):
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


def _check_template(text: str, where: str, fail: Fail) -> None:
    try:
        text.format(base_url="", op="")
    except (KeyError, IndexError, ValueError) as exc:
        raise fail(where, "only {base_url} and {op} may be used") from exc


def _seconds(
    table: Mapping[str, Any],
    key: str,
    where: str,
    fail: Fail,
    *,
    required: bool = False,
    default: float = 0.0,
) -> float:
    value = table.get(key)
    if value is None and not required:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise fail(f"{where}.{key}", "must be a number of seconds >= 0")
    return float(value)
