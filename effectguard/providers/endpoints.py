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

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Literal, cast

from effectguard.errors import ConfigError
from effectguard.providers.lookupspec import (
    HEADER_NAME,
    JSON_FIELD,
    METHOD,
    Lookup,
    legacy_lookup,
    parse_lookup,
)
from effectguard.providers.templates import MAX_WINDOW_S
from effectguard.rules.money import MAX_CALL_NANOS, usd_to_nanos

__all__ = [
    "HEADER_NAME",
    "Effect",
    "Endpoint",
    "EndpointIndex",
    "IdempotencyGuarantee",
    "Lookup",
    "OpIdPlacement",
    "Units",
    "legacy_lookup",
    "parse_endpoint",
    "parse_idempotency",
    "parse_lookup",
    "path_shape",
    "usd_price",
]

Effect = Literal["read_only", "at_most_once", "idempotent"]
Placement = Literal["header", "json", "form"]

_EFFECTS = ("read_only", "at_most_once", "idempotent", "billable")
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


def _is_param(segment: str) -> bool:
    return segment.startswith("{") and segment.endswith("}")


def path_shape(path: str) -> str:
    """The requests a declared path matches, whatever its parameters are called:
    ``/v1/customers/{customer}`` and ``/v1/customers/{id}`` are one endpoint."""
    return "/".join("{}" if _is_param(s) else s for s in path.split("/"))


@dataclass(frozen=True, slots=True)
class EndpointIndex:
    """A provider's declared endpoints by method and number of path segments, the most
    specific first in each: a literal segment before a parameter at the first place two
    paths differ, else in the order declared.

    A request's endpoint is the first there that matches, whatever the order the file
    declares them in. First-declared used to win: ``/v1/messages/{id}`` declared
    ``read_only`` before ``/v1/messages/send`` made every send pass through unguarded,
    and an override's endpoints come after the bundled ones they refine. Built once per
    declaration, it keeps that rule off the request's path: a request reads the few
    endpoints of its own shape, not every one declared (OpenAI's are 51)."""

    by_shape: Mapping[tuple[str, int], tuple[Endpoint, ...]]

    @classmethod
    def of(cls, endpoints: Sequence[Endpoint]) -> EndpointIndex:
        """The index of ``endpoints`` (a declaration's, in its order)."""
        shapes: dict[tuple[str, int], list[Endpoint]] = {}
        for endpoint in endpoints:
            shapes.setdefault((endpoint.method, endpoint.path.count("/")), []).append(endpoint)
        return cls(
            {
                shape: tuple(sorted(found, key=lambda e: [_is_param(s) for s in e.path.split("/")]))
                for shape, found in shapes.items()
            }
        )

    def find(self, method: str, path: str) -> Endpoint | None:
        """The declared endpoint a request ``method path`` (no query string) is for."""
        for endpoint in self.by_shape.get((method.upper(), path.count("/")), ()):
            if endpoint.matches(method, path):
                return endpoint
        return None


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
    if not isinstance(method, str) or not METHOD.fullmatch(method.upper()):
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
    return None if value is None else usd_price(value, where, fail)


def usd_price(value: object, where: str, fail: Fail) -> int:
    """A price: a decimal USD string (or an integer) as nanos, from 0 to the most one call
    may reserve (:data:`MAX_CALL_NANOS`, about 9 million USD). A TOML float is refused (it
    is not exact); so is a price above that bound, at which no call could ever be
    admitted (each was refused 400 when it came, instead of the file when it loaded)."""
    if isinstance(value, float):
        raise fail(
            where, f'must be a decimal USD string such as "{value}" (TOML floats are not exact)'
        )
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise fail(where, 'must be a decimal USD string such as "0.01"')
    try:
        amount = Decimal(value)
    except InvalidOperation as exc:
        raise fail(where, f"must be a decimal USD string, got {value!r}") from exc
    if not amount.is_finite() or amount < 0:
        raise fail(where, f"must be a non-negative decimal USD string, got {value!r}")
    if amount > Decimal(MAX_CALL_NANOS) / 10**9:
        raise fail(where, f"{value!r} USD is more than one call may cost (9007199.254740992)")
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
        not isinstance(body_field, str) or not JSON_FIELD.fullmatch(body_field)
    ):
        raise fail(f"{where}.body_field", "must be a JSON field path such as a.b")
    window = table.get("window_seconds")
    if isinstance(window, bool) or not isinstance(window, int | float) or not window > 0:
        raise fail(f"{where}.window_seconds", "must be a number of seconds > 0")
    if not math.isfinite(window) or window > MAX_WINDOW_S:
        raise fail(
            f"{where}.window_seconds",
            f"must be finite and at most {MAX_WINDOW_S} (366 days; no provider we know of "
            "documents more than 30): is it in milliseconds?",
        )
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
    pattern = HEADER_NAME if kind == "header" else JSON_FIELD
    if not isinstance(name, str) or not pattern.fullmatch(name):
        raise fail(f"{where}.{kind}", "must be a header name or a field path")
    return OpIdPlacement(cast(Placement, kind), name)
