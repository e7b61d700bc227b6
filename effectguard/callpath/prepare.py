"""Preparing a request for admission: parse, price, hash. Pure.

Everything the guard can decide without I/O happens here, so a refusal for
malformed JSON, an unpriced model or a bad budget path costs nothing and
changes nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

import httpx

from effectguard.callpath import bodies, opfields
from effectguard.callpath.exchange import Outbound
from effectguard.callpath.storefault import told
from effectguard.callpath.wire import (
    IDEMPOTENCY_HEADER,
    RETRY_OF_HEADER,
    SDK_RETRY_HEADER,
    request_hash,
)
from effectguard.config.settings import GuardSettings
from effectguard.errors import Refusal
from effectguard.providers import Endpoint, Provider
from effectguard.providers.endpoints import Units
from effectguard.rules import budget as budgets
from effectguard.rules import jsonkeys, nesting, paths, percall, strictjson
from effectguard.rules import units as unitrules
from effectguard.rules import usage as usages
from effectguard.rules.admission import NOTHING_RECORDED, AdmitRequest, Sending
from effectguard.rules.bodyref import REF_ENCODING
from effectguard.rules.bodytext import encode_body
from effectguard.rules.counts import parse_count
from effectguard.rules.digest import credential_digest
from effectguard.rules.prices import ModelPrice
from effectguard.rules.quickinit import quick_init

MAX_KEY_LENGTH = 255


@functools.lru_cache(maxsize=256)
def _base_path(base_url: str) -> str:
    """The path part of a provider's base URL (parsed once, not per request)."""
    return httpx.URL(base_url).path.rstrip("/")


@quick_init
@dataclass(frozen=True, slots=True)
class Prepared:
    """A parsed and priced request, ready for admission."""

    provider: Provider
    request: Outbound
    path: str
    model: str | None
    price: ModelPrice
    body: bytes
    stream: bool
    reserve: int
    admit: AdmitRequest
    #: The endpoint as declared (or its provider's defaults): what effectguard adds to it.
    endpoint: Endpoint
    #: effectguard asked the stream for its usage (rules/addedusage): the client, which
    #: did not, is not shown the usage event.
    usage_added: bool = False
    #: The most output tokens the request allows (rules/usage.output_cap; None: no cap).
    output_cap: int | None = None


@functools.lru_cache(maxsize=256)
def _raw_base_path(base_url: str) -> str:
    """The still-encoded path part of a provider's base URL."""
    return httpx.URL(base_url).raw_path.decode("ascii").rstrip("/")


def check_below_base(target: str, raw_base_path: str) -> None:
    """Refuse (400) a target (still-encoded path and query) whose path would leave the
    provider's base path (docs/contract.md §12)."""
    raw = target.partition("?")[0]
    below = raw[len(raw_base_path) :] if raw.startswith(raw_base_path) else raw
    try:
        paths.check_path(below or "/")
    except paths.PathRefused as exc:
        raise refuse(400, "invalid_request", f"refused path: {exc}") from exc


def _parse_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, refused (400) if it is not one, repeats a key in
    an object, or nests too deep."""
    try:
        # A repeated key: we would price and hash the last value while a provider may act
        # on the first ("max_tokens": 100000 then 1).
        loaded = strictjson.loads(raw)
    except (jsonkeys.RepeatedKey, strictjson.NotStrict) as exc:
        raise refuse(400, "invalid_request", f"request body is ambiguous JSON: {exc}") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise refuse(400, "invalid_request", f"request body is not valid JSON: {exc}") from exc
    except RecursionError:
        raise _too_deep() from None  # deeper than the parser's own stack
    if not isinstance(loaded, dict):
        raise refuse(400, "invalid_request", "request body must be a JSON object")
    if nesting.depth_exceeds(loaded):
        raise _too_deep()
    return loaded


def _too_deep() -> Refusal:
    limit = nesting.MAX_JSON_DEPTH
    return refuse(400, "invalid_request", f"request body nests deeper than {limit} levels")


def refuse(status: int, type_: str, message: str, **kw: Any) -> Refusal:
    """A :class:`Refusal` (shorthand)."""
    return Refusal(status, type_, message, **kw)


def ledger_unavailable(exc: Exception, call_id: str | None = None, what: str = "") -> Refusal:
    """503 ``ledger_unavailable`` for a request that sent nothing because the ledger
    failed (docs/contract.md §9): ``x-should-retry: true``, a retry is safe."""
    what = what or "the ledger could not record this request, so it was not sent"
    message = f"{what}: {told(exc, call_id)}"
    return refuse(503, "ledger_unavailable", message, call_id=call_id, retryable=True)


def prepare(
    provider: Provider,
    request: Outbound,
    settings: GuardSettings,
    *,
    budget: str,
    budget_root: str | None,
) -> Prepared | None:
    """Parse, price and hash a request (pure); None for read-only endpoints."""
    base_path = _base_path(provider.base_url)
    check_below_base(request.target, _raw_base_path(provider.base_url))
    path = request.path[len(base_path) :] if base_path else request.path
    endpoint = provider.effect_for(request.method, path)
    if endpoint.effect == "read_only":
        return None
    root = _budget_root(budget, budget_root)
    content_type = request.header("content-type")
    kind = bodies.kind_of(content_type)
    parsed, hashed = _parse_body(provider, request, path, endpoint, kind, content_type or "")
    model, price = _priced(provider, endpoint, parsed, kind)
    key = _idempotency_key(request)
    _check_own_fields(endpoint, parsed, kind, request.target)
    # Form or multipart fields are text, not token caps: priced per call or by the output bound.
    bounded = parsed if kind == "json" else percall.form_counts(parsed)
    stream = _stream(provider, parsed, kind)
    sent, added = _body_to_send(provider, path, parsed, request.body, kind)
    reserve, tokens, cap = _reservation(price, bounded, provider.dialect)
    retry_of = request.header(RETRY_OF_HEADER)
    scope = _scope_headers(request, endpoint)
    body_text, body_encoding = _stored_body(request, sent)
    idem = endpoint.idempotency
    admit = AdmitRequest(
        request_hash=request_hash(
            provider.name, request.method, request.target, hashed, kind, scope
        ),
        provider=provider.name,
        endpoint=path,
        method=request.method,
        model=model,
        idempotency_key=key,
        budget=budget,
        budget_root=root,
        effect_kind=endpoint.effect,
        body=body_text,
        body_encoding=body_encoding,
        stream=stream,
        reserve=reserve,
        tokens=tokens,
        is_retry=retry_of is not None or _sdk_retry(request),
        retry_of=retry_of,
        retry_window_s=settings.retry_window_s,
        provider_idempotency_window_s=idem.window_seconds if idem else None,
        create_budgets=settings.create_budgets,
        spool=request.spool,
        headers=scope,
        sending=_sending(provider, endpoint, request),
    )
    return Prepared(
        provider, request, path, model, price, sent, stream, reserve, admit, endpoint, added, cap
    )


def _sending(provider: Provider, endpoint: Endpoint, request: Outbound) -> Sending:
    """What each attempt of the request records of how it goes out (rules/admission).
    Where and with which credential only for an endpoint with a lookup, which is what
    reads them: a model call's attempt stores no more than it did."""
    op_id_in = endpoint.op_id.label if endpoint.op_id is not None else None
    if endpoint.lookup is None:
        return NOTHING_RECORDED if op_id_in is None else Sending(op_id_in)
    credential = request.header(provider.key_header)
    digest = credential_digest(credential) if credential is not None else None
    return Sending(op_id_in, provider.base_url, digest)


def _reservation(
    price: ModelPrice, bounded: dict[str, Any], dialect: str
) -> tuple[int, int, int | None]:
    """R, the token estimate (docs/contract.md §5.2) and the output cap the settlement
    judges usage by (rules/settlement); a bound out of range is 400."""
    try:
        reserve, tokens = usages.reservation(price, bounded, dialect=dialect)
        return reserve, tokens, usages.output_cap(bounded, dialect)
    except usages.OutOfBounds as exc:
        raise refuse(400, "invalid_request", str(exc), param=exc.field) from exc
    except (TypeError, ValueError) as exc:
        raise refuse(400, "invalid_request", f"cannot estimate this request: {exc}") from exc


def _check_identity_encoding(request: Outbound) -> None:
    """Refuse (400) a compressed body: effectguard would parse, price and hash the
    compressed bytes while the provider acts on what they decompress to."""
    encoding = (request.header("content-encoding") or "identity").strip().lower()
    if encoding != "identity":
        raise refuse(
            400,
            "invalid_request",
            f"Content-Encoding {encoding!r} is not supported: send the body uncompressed",
        )


def _stream(provider: Provider, parsed: dict[str, Any], kind: bodies.BodyKind) -> bool:
    """Whether the request asks for a stream. A model request's ``stream`` is true, false
    or absent (400 otherwise): effectguard reads only ``true`` as a stream, and a provider
    that took ``"yes"`` as one would send events the guard was not reading as such."""
    if kind != "json":
        return False
    flag = parsed.get("stream")
    if provider.dialect != "flat" and flag is not None and not isinstance(flag, bool):
        raise refuse(400, "invalid_request", "stream must be true or false", param="stream")
    return usages.wants_stream(parsed)


def _stored_body(request: Outbound, sent: bytes) -> tuple[str, str]:
    """The manifest's ``body`` and ``body_encoding``: a spooled upload is stored by
    reference (rules/bodyref), never read whole."""
    if request.spool is not None:
        return request.spool.sha256, REF_ENCODING
    return encode_body(sent)


def _check_own_fields(
    endpoint: Endpoint, parsed: dict[str, Any], kind: bodies.BodyKind, target: str
) -> None:
    """Refuse (400) a body that has no place for a field effectguard must write into it:
    without the operation id, a lookup would never find the call, and "not found" would
    wrongly read as "not applied". The same holds for a query string that sets the field:
    a provider that reads a POST's query parameters (Stripe's API takes them) could keep
    the client's value instead of effectguard's."""
    paths_: list[str] = []
    if endpoint.idempotency is not None and endpoint.idempotency.body_field is not None:
        paths_.append(endpoint.idempotency.body_field)
    if endpoint.op_id is not None and endpoint.op_id.where in ("json", "form"):
        want: bodies.BodyKind = "form" if endpoint.op_id.where == "form" else "json"
        if kind != want:
            # A multipart body is never rewritten: adding a part would re-frame an upload
            # byte for byte, and no multipart API we know of keeps an extra part anyway.
            raise refuse(
                400,
                "invalid_request",
                f"this endpoint takes effectguard's operation id in the {want} field "
                f"{endpoint.op_id.name!r}, so its requests must be {_MEDIA[want]}",
            )
        if want == "json":
            paths_.append(endpoint.op_id.name)
        query = dict.fromkeys(k for k, _ in parse_qsl(target.partition("?")[2], True))
        if opfields.supplied(parsed, endpoint.op_id.name, want) or (
            query and opfields.supplied(query, endpoint.op_id.name, "form")
        ):
            raise refuse(
                400,
                "invalid_request",
                f"the request sets {endpoint.op_id.name!r} itself (in its body or query): "
                "that field is where effectguard writes the call's operation id, which only "
                "effectguard may set",
            )
    if paths_ and kind != "json":
        raise refuse(400, "invalid_request", f"this endpoint's body must be {_MEDIA['json']}")
    for path in paths_:
        if not opfields.writable(parsed, path):
            raise refuse(400, "invalid_request", f"request body has no object for field {path!r}")


def _budget_root(budget: str, budget_root: str | None) -> str:
    """The budget root the call is scoped to; ``budget`` must be a valid path under it."""
    try:
        budgets.validate_path(budget)
    except ValueError as exc:
        raise refuse(400, "invalid_budget", str(exc)) from exc
    root = budget_root or budgets.root_of(budget)
    if not budgets.is_under(budget, root):
        raise refuse(403, "budget_forbidden", f"budget {budget!r} is not under {root!r}")
    return root


_MEDIA = {"json": "a JSON object", "form": "application/x-www-form-urlencoded"}


def _parse_body(
    provider: Provider,
    request: Outbound,
    path: str,
    endpoint: Endpoint,
    kind: bodies.BodyKind,
    content_type: str,
) -> tuple[dict[str, Any], Mapping[str, Any] | bytes]:
    """The request's fields, and what its hash is over (callpath/bodies); refused (400)
    if it does not parse as its Content-Type. A request that needs no model may send no
    body: a flat tool provider's, or one to an endpoint with a ``per_call`` price (a
    ``DELETE``, a cancel)."""
    _check_identity_encoding(request)
    raw = request.body
    try:
        if kind == "form":
            fields = bodies.parse_form(raw)
            _named_once([k for k, _ in fields], "model")
            return dict(fields), {"fields": bodies.hashed_form(fields)}
        if kind == "multipart":
            spool = request.spool
            if spool is None:
                parts = bodies.parse_multipart(raw, content_type)
            else:
                parts = bodies.parse_multipart_file(spool.path, content_type)
            _named_once([p.name for p in parts], "model")
            return bodies.part_fields(parts), {"parts": bodies.hashed_parts(parts)}
    except bodies.Malformed as exc:
        raise refuse(400, "invalid_request", str(exc)) from exc
    if not raw:
        if provider.dialect == "flat" or endpoint.per_call is not None:
            return {}, raw
        raise _no_body(provider, request.method, path)
    parsed = _parse_json(raw)
    return parsed, parsed or raw


def _no_body(provider: Provider, method: str, path: str) -> Refusal:
    """The refusal of a body-less request to an endpoint priced by the model its body
    names: most often a read the provider's declaration does not list (undeclared
    endpoints are guarded as billable, docs/contract.md §2.2)."""
    declared = provider.endpoint_for(method, path) is not None
    why = "" if declared else f" (provider {provider.name!r} does not declare it, so it is)"
    return refuse(
        400,
        "invalid_request",
        f"{method} {path} is guarded as billable{why}: its request must be a JSON object "
        "naming a priced model, and this one has no body. If the endpoint has no effect, "
        'declare it effect = "read_only" in a provider file (--providers DIR)',
    )


def _named_once(names: list[str], field: str) -> None:
    """A field effectguard reads from a form or multipart body (the ``model`` it prices)
    must be there at most once: effectguard would read the last, a provider perhaps the
    first, and price one model while the provider runs another."""
    if names.count(field) > 1:
        raise bodies.Malformed(f"request body names its {field} more than once")


def _priced(
    provider: Provider, endpoint: Endpoint, parsed: dict[str, Any], kind: bodies.BodyKind
) -> tuple[str | None, ModelPrice]:
    """The request's model and its price, for as many units as it names where the
    endpoint is billed per unit."""
    model, price = _model_and_price(provider, endpoint, parsed)
    if endpoint.units is not None:
        price = _per_unit(price, endpoint.units, parsed, kind)
    return model, price


def _model_and_price(
    provider: Provider, endpoint: Endpoint, parsed: dict[str, Any]
) -> tuple[str | None, ModelPrice]:
    """The requested model and its declared price (an endpoint's ``per_call`` price for a
    request that names none); an unpriced model is refused."""
    model: str | None = parsed.get("model")
    if model is not None and not isinstance(model, str):
        raise refuse(400, "invalid_request", "model must be a string")
    if model is None and endpoint.per_call is not None:
        return None, ModelPrice(input=0, output=0, max_output_tokens=0, per_call=endpoint.per_call)
    price = provider.price_for(model)
    if price is None and model is None:
        raise refuse(
            400,
            "model_not_priced",
            f"this request to {provider.name!r} {endpoint.path} names no model, and the "
            "endpoint declares no per_call price; declare one with --providers DIR",
        )
    if price is None:
        raise refuse(
            400,
            "model_not_priced",
            f"model {model!r} has no declared price for provider {provider.name!r}; "
            "declare it with --providers DIR",
            model=model,
        )
    return model, price


def _per_unit(price: ModelPrice, units: Units, parsed: dict[str, Any], kind: str) -> ModelPrice:
    """``price`` for as many units as the request names (an email's recipients): the
    provider bills each, so one call is charged and reserved for all of them
    (:mod:`effectguard.rules.units` counts too many rather than too few)."""
    if kind != "json":
        raise refuse(400, "invalid_request", "this endpoint's body must be a JSON object")
    if price.per_call is None:
        return price  # priced by tokens: there is no per-call price to multiply
    try:
        count = unitrules.count_units(parsed, units.fields, units.separator, units.items)
    except unitrules.BadUnits as e:
        raise refuse(400, "invalid_request", str(e), param=e.param) from None
    return dataclasses.replace(price, per_call=price.per_call * count)


def _scope_headers(request: Outbound, endpoint: Endpoint) -> dict[str, str]:
    """The headers naming the account the call acts in, for its lookup to send again; one
    sent twice is refused (400), as either value could be the account acted in."""
    names = endpoint.lookup.scope_headers if endpoint.lookup is not None else ()
    found: dict[str, str] = {}
    for name in names:
        if request.repeats(name):
            raise refuse(400, "invalid_request", f"{name} is sent more than once")
        value = request.header(name)
        if value is not None:
            found[name] = value
    return found


def _idempotency_key(request: Outbound) -> str | None:
    """The client's ``Idempotency-Key``, if it sent a usable one."""
    key = request.header(IDEMPOTENCY_HEADER)
    if key is not None and request.repeats(IDEMPOTENCY_HEADER):
        # Joined they would make a key ("a, b") that neither value names.
        raise refuse(400, "invalid_request", "Idempotency-Key is sent more than once")
    if key is not None and not 0 < len(key) <= MAX_KEY_LENGTH:
        raise refuse(
            400, "invalid_request", f"Idempotency-Key must be 1-{MAX_KEY_LENGTH} characters"
        )
    return key


def _body_to_send(
    provider: Provider, path: str, parsed: dict[str, Any], raw: bytes, kind: str
) -> tuple[bytes, bool]:
    """The body sent upstream: as received, unless a JSON stream must ask for its usage;
    and whether it was amended so (the client is then not shown the usage event)."""
    if kind != "json":
        return raw, False
    amended = usages.with_stream_usage(provider.dialect, path, parsed)
    if amended is None:
        return raw, False
    return json.dumps(amended, separators=(",", ":"), ensure_ascii=False).encode(), True


def _sdk_retry(request: Outbound) -> bool:
    """Whether an SDK marked this request as its own retry (``x-stainless-retry-count`` >= 1)."""
    count = parse_count(request.header(SDK_RETRY_HEADER) or "0", 1)
    return count is not None and count >= 1


def usage_of(prepared: Prepared, body: bytes) -> usages.UsageResult:
    """The answer's usage; a call priced per call alone costs that, whatever it says."""
    if percall.per_call_only(prepared.price):
        return percall.answer_usage(prepared.price, prepared.provider.dialect, body)
    return usages.usage_from_body(prepared.provider.dialect, prepared.path, body)
