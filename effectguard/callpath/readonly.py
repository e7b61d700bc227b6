"""Read-only requests: forwarded untouched, with nothing to record, and clear answers
when the upstream cannot be reached (a read has no effect to lose)."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator

import httpx

from effectguard.callpath.exchange import (
    Outbound,
    Reply,
    ReplyStream,
    Send,
    Upstream,
    header_value,
)
from effectguard.callpath.prepare import refuse
from effectguard.callpath.readbound import bounded, held_plain
from effectguard.callpath.wire import (
    answer_kind,
    classify_transport_error,
    client_headers,
    timed_out,
    upstream_request,
)
from effectguard.config.settings import GuardSettings
from effectguard.providers import Provider
from effectguard.rules.keymask import key_forms, key_of, mask_forms
from effectguard.telemetry.observer import Observer
from effectguard.telemetry.report import CallReport


async def forward_read_only(
    provider: Provider,
    request: Outbound,
    send: Send,
    report: CallReport,
    observer: Observer,
    settings: GuardSettings,
) -> Reply:
    """Forward a read-only request: nothing to record, but errors still get clear answers.
    Its answer is bounded as a whole as a guarded call's is (callpath/readbound)."""
    outgoing = upstream_request(request, request.body, None, None)
    observer.dispatching(report, outgoing)
    sent_at = time.perf_counter()
    try:
        response = await _send_read(send, outgoing)
        body = await _bounded(response, request.method, settings)
    except httpx.TransportError as exc:
        not_sent = classify_transport_error(exc) == "not_sent"
        kind = "upstream_unreachable" if not_sent else "upstream_failed"
        observer.refused(provider.name, kind)
        # A read has no effect to lose, so a client may always try again.
        raise refuse(
            504 if timed_out(exc) and not not_sent else 502,
            kind,
            f"{provider.name} {'could not be reached' if not_sent else 'failed'}: {describe(exc)}",
            retryable=True,
        ) from exc
    finally:
        report.upstream_s += time.perf_counter() - sent_at
    if not 200 <= response.status < 300:  # a success is never searched (rules/keymask)
        credential = outgoing.header(provider.key_header)
        forms = key_forms(key_of(credential, provider.key_format))
        if forms:
            body = mask_forms(body, forms) if isinstance(body, bytes) else MaskedBody(body, forms)
    headers = client_headers(response.headers, None)
    if isinstance(body, bytes):
        return Reply(response.status, headers, body=body, extensions=response.extensions)
    return Reply(response.status, headers, stream=body, extensions=response.extensions)


#: Statuses whose answer has no body (RFC 9110 §15.3.5, §15.4.5), forwarded as they come.
_BODILESS = frozenset({204, 304})


async def _bounded(response: Upstream, method: str, settings: GuardSettings) -> bytes | ReplyStream:
    """The answer's body, whole or to forward as it comes, bounded (callpath/readbound).
    An answer that has no body but whose headers may describe another's (to a ``HEAD``,
    a ``304``) is forwarded as it comes, so that no length of 0 is written for it."""
    content_type = header_value(response.headers, "content-type")
    if answer_kind(response.status, content_type, False) == "stream":
        return bounded(response, settings.upstream_stream_timeout_s, "stream_timeout_s")
    if method == "HEAD" or response.status in _BODILESS:
        return bounded(response, settings.upstream_read_timeout_s, "read_timeout_s")
    try:
        body = await held_plain(response, settings.upstream_read_timeout_s)
    except BaseException:
        await response.aclose()
        raise
    if isinstance(body, bytes):
        await response.aclose()  # read whole: its connection goes back to the pool
    return body


class MaskedBody:
    """An answer's body forwarded with the provider key masked (rules/keymask), chunk by
    chunk: the bytes that could begin a key cut by a chunk's end are held back until the
    next chunk (or the end) shows whether they do."""

    def __init__(self, source: ReplyStream, forms: tuple[bytes, ...]) -> None:
        self._source = source
        self._forms = forms
        self._hold = max(len(form) for form in forms) - 1

    async def aclose(self) -> None:
        await self._source.aclose()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        held = b""
        async for chunk in self._source:
            data = mask_forms(held + chunk, self._forms)
            # Any occurrence that starts before the held tail ends inside ``data``.
            cut = max(len(data) - self._hold, 0)
            held = data[cut:]
            if cut:
                yield data[:cut]
        if held:
            yield held


async def _send_read(send: Send, outgoing: Outbound) -> Upstream:
    """Send a read, once more if a connection failed under it without running out of
    time: a kept-alive connection the upstream had closed (the leg never resends on its
    own, since for an effect that would be a second, unrecorded send; a read has none)."""
    try:
        return await send(outgoing)
    except httpx.TransportError as exc:
        if timed_out(exc):
            raise
    return await send(outgoing)


#: A URL's query string, in an error's text (aiohttp names the URL in some, e.g. a bad
#: status line): up to the end of the URL as a message quotes it.
_QUERY = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>?#]*)\?[^\s'\"<>#]*")


def describe(exc: BaseException) -> str:
    """A transport error in one short line: its type and message, any URL's query left out.

    The line goes to the log, the ledger (an interrupt's reason, shown by ``show`` and the
    operator page) and the client's error answer; a query string may carry a credential
    (``?key=...``), which none of them may hold."""
    cause = exc.__cause__
    if cause is not None and type(cause).__module__.startswith("aiohttp"):
        # The proxy's aiohttp leg reraises as httpx's classes, some misnamed (a server
        # that hangs up after the request is ``ConnectTimeout``): name what happened.
        exc = cause
    text = _QUERY.sub(r"\1?…", _unparsed(exc) or str(exc) or type(exc).__name__)
    return f"{type(exc).__name__}: {text}"[:300]


def _unparsed(exc: BaseException) -> str | None:
    """What aiohttp could not read of an answer, if that is what ``exc`` reports: the
    parser's own error (from ``aiohttp.http_exceptions``, at the end of its causes) by
    name and message, on one line.

    aiohttp's text for such an answer (``ClientResponseError: 400, message=..., url=...``,
    ``... <ContentLengthError: 400, message=...>``) carries the status 400 its parser puts
    on every answer it cannot read, a status the provider never sent: read as the
    provider's, it says nothing was done, and an operator reconciling by it would free the
    key of a call the provider may have made. It quoted the upstream's address too."""
    causes: list[BaseException] = []
    cause = exc.__cause__
    # Bounded: a chain of causes can loop, and this runs on an error path only.
    while cause is not None and type(cause).__module__ == "aiohttp.http_exceptions":
        causes.append(cause)
        cause = cause.__cause__ if len(causes) < 8 else None
    if not causes:
        return None
    parser = causes[-1]  # the most specific: aiohttp wraps it in a plain one on the way
    said = f"{type(parser).__name__}: {' '.join(str(getattr(parser, 'message', '')).split())}"
    if hasattr(exc, "request_info"):  # ClientResponseError: its text is all the parser's
        return said
    return str(exc).replace(repr(causes[0]), said)
