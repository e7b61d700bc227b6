"""What crosses the wire: error bodies (docs/contract.md §9), header hygiene, request hashes,
and the classification of transport errors by whether the request could have
left (docs/contract.md §3.4)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any, AnyStr, Final, Literal

import httpx

from effectguard.callpath import opfields, testhooks
from effectguard.callpath.exchange import Headers, Outbound, Reply, header_text, text_headers
from effectguard.errors import Refusal
from effectguard.providers import Endpoint
from effectguard.rules.bodytext import decode_body
from effectguard.rules.errorshape import error_body, retry_headers, shape_retry_header
from effectguard.rules.events import AttemptObserved, CallReconciled

CALL_ID_HEADER: Final = "effectguard-call-id"
REPLAYED_HEADER: Final = "effectguard-replayed"
RECOVERED_HEADER: Final = "effectguard-recovered"
BUDGET_HEADER: Final = "effectguard-budget"
RETRY_OF_HEADER: Final = "effectguard-retry-of"
SDK_RETRY_HEADER: Final = "x-stainless-retry-count"
IDEMPOTENCY_HEADER: Final = "idempotency-key"

#: effectguard's own headers: never sent upstream, never taken from an upstream answer.
OWN_PREFIX: Final = "effectguard-"
#: Further request headers that are effectguard's and never go upstream.
OWN_HEADERS: Final = frozenset({IDEMPOTENCY_HEADER})
#: Request headers some servers (IIS, Symfony, frameworks behind them) obey to route a
#: request to another path or method than its request line's: the guard checked,
#: priced and recorded the request line, so they never go upstream (contract.md §12).
REROUTING_HEADERS: Final = frozenset(
    {
        "x-original-url",
        "x-rewrite-url",
        "x-http-method-override",
        "x-http-method",
        "x-method-override",
    }
)

#: RFC 9110 §7.6.1 hop-by-hop headers, plus what the proxy recomputes itself.
HOP_BY_HOP: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
#: Headers that carry credentials: never stored, never logged. Cookies in both spellings:
#: RFC 2965's ``Cookie2``/``Set-Cookie2`` are obsolete, but a server may still send them.
SECRET_HEADERS: Final = frozenset(
    {
        "authorization",
        "x-api-key",
        "api-key",
        "proxy-authorization",
        "cookie",
        "set-cookie",
        "cookie2",
        "set-cookie2",
    }
)


def _name(key: str | bytes) -> str:
    """A header name, lower-cased, whether it comes as text or as wire bytes."""
    return (key.decode("latin-1") if isinstance(key, bytes) else key).lower()


_HOP_BY_HOP_RAW: Final = frozenset(h.encode() for h in HOP_BY_HOP)
_SECRET_RAW: Final = frozenset(h.encode() for h in SECRET_HEADERS)


def strip_hop_by_hop(headers: Iterable[tuple[AnyStr, AnyStr]]) -> list[tuple[AnyStr, AnyStr]]:
    """Drop hop-by-hop headers, including any the ``Connection`` header names.

    Works on text pairs and on wire bytes alike; bytes pass through untouched, so a
    UTF-8 header value (RFC 9110 §5.5 obs-text) reaches the other side as sent.
    """
    pairs = list(headers)
    if pairs and isinstance(pairs[0][0], bytes):
        return _strip_raw(pairs)
    named = {
        token.strip().lower()
        for k, v in pairs
        if _name(k) == "connection"
        for token in _name(v).split(",")
    }
    drop = HOP_BY_HOP | named
    return [(k, v) for k, v in pairs if _name(k) not in drop]


def _strip_raw(pairs: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    # Every request and answer passes here: bytes compared as bytes, no decoding.
    drop = _HOP_BY_HOP_RAW
    for k, v in pairs:
        if k.lower() == b"connection":
            drop = drop | {t.strip().lower() for t in v.split(b",")}
    return [(k, v) for k, v in pairs if k.lower() not in drop]


def is_own_header(key: str | bytes) -> bool:
    """Whether a header is effectguard's own (``effectguard-*``), never passed across."""
    return _name(key).startswith(OWN_PREFIX)


def storable_headers(headers: Headers, secret: Iterable[str] = ()) -> dict[str, str]:
    """Response headers safe to store: no hop-by-hop, no credentials, none of ours.

    Filtered as wire bytes; only the headers kept are decoded. A header sent more than
    once is kept as one, its values joined with ``", "`` as RFC 9110 §5.3 allows (a
    replay then carries them all, not only the last)."""
    drop = _SECRET_RAW | {s.lower().encode("latin-1") for s in secret}
    kept: dict[str, str] = {}
    for k, v in _strip_raw(list(headers)):
        if (name := k.lower()) in drop or name.startswith(_OWN_PREFIX_RAW):
            continue
        key, value = name.decode("latin-1"), header_text(v)
        kept[key] = f"{kept[key]}, {value}" if key in kept else value
    return kept


def request_hash(
    provider: str,
    method: str,
    target: str,
    body: Mapping[str, Any] | bytes,
    kind: str = "json",
    scope: Mapping[str, str] | None = None,
) -> str:
    """A stable hash of what a request asks for (key order and spacing do not matter).

    ``kind`` labels what the mapping was parsed from ("json", or the canonical "form" and
    "multipart" forms of callpath/bodies), so bodies of different types never collide.
    ``scope``: the headers naming the account the request acts in (Stripe's
    ``Stripe-Account``), where it sends any: the same body in two accounts is two
    requests. Without them the hash is what it always was."""
    h = hashlib.sha256(f"{provider}\n{method.upper()}\n{target}\n".encode())
    if scope:
        h.update(b"scope\n" + json.dumps(scope, sort_keys=True).encode() + b"\n")
    if isinstance(body, bytes):
        h.update(b"raw\n" + body)
    else:
        h.update(
            kind.encode()
            + b"\n"
            + json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        )
    return h.hexdigest()


def error_headers(refusal: Refusal, shape: str = "openai") -> dict[str, str]:
    """docs/contract.md §9 headers: the call id and whether an SDK may retry by itself
    (``x-should-retry``, and the retry header of the provider's own SDK, by ``shape``)."""
    headers = {"content-type": "application/json", **retry_headers(shape, refusal.retryable)}
    if refusal.call_id:
        headers[CALL_ID_HEADER] = refusal.call_id
    if refusal.retry_after is not None:
        headers["retry-after"] = str(refusal.retry_after)
    return headers


def error_response(
    shape: str, refusal: Refusal, request: httpx.Request | None = None
) -> httpx.Response:
    """A refusal in the provider's error ``shape`` as an ``httpx.Response`` (for the
    transports)."""
    return httpx.Response(
        refusal.status,
        headers=error_headers(refusal, shape),
        content=json.dumps(error_body(shape, refusal)).encode(),
        request=request,
    )


SendOutcome = Literal["not_sent", "unknown"]
AnswerKind = Literal["stream", "body", "not_http"]


def answer_kind(
    status: int, content_type: str | None, asked_stream: bool, coding: str | None = None
) -> AnswerKind:
    """How an upstream's answer is read: forwarded as an event stream, read whole, or not
    an HTTP answer at all (a final status outside 200-599, such as a 101 to a request that
    asked for no upgrade, which no client could be given or replayed).

    ``coding`` is the answer's ``Transfer-Encoding``. The guard never offers a transfer
    coding (``TE`` is hop-by-hop and dropped), so an answer coded with anything but
    ``chunked`` is one the provider was not asked for: its body arrives still coded, and
    neither its usage nor what a client would be given can be read from it (RFC 9112
    §6.1). That too is not an answer the guard can observe.

    A media type is case-insensitive (RFC 9110 §8.3.1). A 2xx answer without a content
    type to a request that asked for a stream is read as the stream it asked for: then a
    cut before its terminal event is broken, never complete."""
    if not 200 <= status <= 599 or unasked_coding(coding):
        return "not_http"
    if not 200 <= status < 300:
        return "body"
    if content_type is None or not content_type.strip():
        return "stream" if asked_stream else "body"
    media = content_type.split(";", 1)[0].strip().lower()
    return "stream" if media == "text/event-stream" else "body"


def unasked_coding(coding: str | None) -> str | None:
    """The transfer codings of ``coding`` other than ``chunked``, if there are any."""
    if coding is None or coding == "chunked":  # nearly every coded answer: no work
        return None
    others = [c.strip() for c in coding.split(",") if c.strip().lower() not in ("chunked", "")]
    return ", ".join(others) or None


def unobservable(status: int, kind: AnswerKind, limit: int, coding: str | None) -> tuple[str, str]:
    """What the client is told, and the reason recorded, for an answer the guard cannot
    observe: not HTTP, coded in a way nobody asked for, or past ``max_answer_bytes``
    (``limit``)."""
    if kind == "not_http" and (unasked := unasked_coding(coding)) is not None:
        return "the answer was not readable", (
            f"the provider answered {status} with Transfer-Encoding {unasked!r}, "
            "which was not asked for, so its body could not be read"
        )
    if kind == "not_http":
        return "the answer was not HTTP", (
            f"the provider answered with status {status}, which is not a final HTTP answer"
        )
    return "the answer was too large to observe", answer_too_large(status, limit)


def answer_too_large(status: int, limit: int) -> str:
    """Why an attempt whose answer outgrew ``max_answer_bytes`` is effect unknown."""
    return (
        f"the provider's {status} answer grew past max_answer_bytes ({limit} bytes) "
        "and was not read further"
    )


def classify_transport_error(exc: BaseException) -> SendOutcome:
    """Whether a transport error proves the request never left (docs/contract.md §3.4).

    Only a failure to open the connection proves that: connect errors, connect
    timeouts and pool timeouts. The aiohttp-backed transport maps some errors
    that happen *after* sending (a server disconnect) to ``ConnectTimeout``, so
    its original exception is consulted first.
    """
    if testhooks.disconnect_counts_as_not_sent(exc):  # a deliberately broken build only
        return "not_sent"
    cause = exc.__cause__
    if cause is not None and type(cause).__module__.startswith("aiohttp"):
        return _classify_aiohttp(cause)
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout):
        return "not_sent"
    return "unknown"


def timed_out(exc: BaseException) -> bool:
    """Whether a transport error is a timeout (answered 504) rather than a failure (502).

    The aiohttp-backed transport reports a server disconnect as ``ConnectTimeout``; its
    original exception says whether time ran out (aiohttp's timeouts are ``TimeoutError``).
    """
    cause = exc.__cause__
    if cause is not None and type(cause).__module__.startswith("aiohttp"):
        return isinstance(cause, TimeoutError)
    return isinstance(exc, httpx.TimeoutException)


def _classify_aiohttp(exc: BaseException) -> SendOutcome:
    import aiohttp

    connection_timeout = getattr(aiohttp, "ConnectionTimeoutError", None)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "not_sent"
    if connection_timeout is not None and isinstance(exc, connection_timeout):
        return "not_sent"
    return "unknown"


def upstream_request(
    request: Outbound,
    body: bytes,
    endpoint: Endpoint | None,
    provider_key: str | None,
    op_id: str | None = None,
) -> Outbound:
    """The request as it goes upstream: own headers out; the endpoint's idempotency key and
    operation id in, where it declares them (the body the client sent is what was hashed)."""
    written: dict[bytes, str] = {}
    fields: list[tuple[str, str]] = []
    guarantee = endpoint.idempotency if endpoint is not None else None
    if provider_key is not None and guarantee is not None:
        if guarantee.header is not None:
            written[guarantee.header.lower().encode("latin-1")] = provider_key
        elif guarantee.body_field is not None:
            fields.append((guarantee.body_field, provider_key))
    placement = endpoint.op_id if endpoint is not None else None
    if op_id is not None and placement is not None:
        if placement.where == "header":
            written[placement.name.lower().encode("latin-1")] = op_id
        else:
            fields.append((placement.name, op_id))
    # Wire bytes, not decoded text: a non-ASCII value goes upstream exactly as it came.
    headers = [
        (k, v)
        for k, v in strip_hop_by_hop(request.headers)
        if (name := k.lower()) not in _OWN_RAW
        and not name.startswith(_OWN_PREFIX_RAW)
        and name != b"accept-encoding"
        and name not in written  # effectguard's value, never the client's
    ]
    # Identity encoding: usage is read from the bytes, which are stored exactly as received.
    headers.append((b"accept-encoding", b"identity"))
    headers += [(k, v.encode()) for k, v in written.items()]
    if fields:
        body = opfields.write(body, request.header("content-type") or "", fields)
    return Outbound(
        request.method,
        request.url,
        request.path,
        request.target,
        headers,
        body,
        request.timeout,
        request.extensions,
        request.spool,
    )


_OWN_RAW: Final = frozenset(h.encode() for h in OWN_HEADERS | REROUTING_HEADERS)
_OWN_PREFIX_RAW: Final = OWN_PREFIX.encode()


def client_headers(headers: Headers, call_id: str | None) -> Headers:
    """An upstream answer's headers for the client: hop-by-hop and ``effectguard-*`` out
    (only effectguard speaks for itself), the call id in."""
    kept = [
        (k, v) for k, v in strip_hop_by_hop(headers) if not k.lower().startswith(_OWN_PREFIX_RAW)
    ]
    if call_id is not None:
        kept.append((_CALL_ID_RAW, call_id.encode()))
    return kept


_CALL_ID_RAW: Final = CALL_ID_HEADER.encode()
SHOULD_RETRY_HEADER: Final = "x-should-retry"
_SHOULD_RETRY_RAW: Final = SHOULD_RETRY_HEADER.encode()


def final_answer(headers: Headers, shape: str = "openai") -> Headers:
    """``headers`` of an error answer the guard booked as applied (``failed``) or as an
    unknown effect, marked ``x-should-retry: false`` (and ``false`` in the retry header of
    the provider's own SDK, by ``shape``) in place of whatever the provider said. The SDKs
    obey that header before the status: their automatic retry of such an answer would be
    new work repeating the effect and its charge, or a 409."""
    marks = {_SHOULD_RETRY_RAW}
    if (own := shape_retry_header(shape)) is not None:
        marks.add(own.encode())
    kept = [(k, v) for k, v in headers if k.lower() not in marks]
    kept += [(mark, b"false") for mark in sorted(marks)]
    return kept


def replay_response(call_id: str, observed: AttemptObserved | None, shape: str = "openai") -> Reply:
    """The stored response of a completed call, marked as a replay (``shape``: the
    provider's error shape, whose retry header a final error answer carries too)."""
    if observed is None:
        raise Refusal(409, "in_progress", f"call {call_id} has no stored response", call_id=call_id)
    headers = [(k, v) for k, v in observed.headers.items() if k != "content-length"]
    headers += [(CALL_ID_HEADER, call_id), (REPLAYED_HEADER, "true")]
    replayed = text_headers(headers)
    # A failed call's error answer is final, as when it was first given; a not-processed
    # one (a joined retry may be given it) is not: a retry is safe.
    if observed.status >= 400 and not observed.not_processed:
        replayed = final_answer(replayed, shape)
    body = decode_body(observed.body, observed.body_encoding)
    return Reply(observed.status, replayed, body=body)


def recovered_response(call_id: str, decision: CallReconciled) -> Reply:
    """The result a lookup or the hook recovered for an applied decision, as a 200 marked
    replayed and ``Effectguard-Recovered: <by>`` (docs/contract.md §4.1)."""
    assert decision.result is not None
    headers = [
        ("content-type", "application/json"),
        (CALL_ID_HEADER, call_id),
        (REPLAYED_HEADER, "true"),
        (RECOVERED_HEADER, decision.by),
    ]
    body = decode_body(decision.result, decision.result_encoding)
    return Reply(200, text_headers(headers), body=body)
