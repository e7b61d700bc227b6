"""Writing the guard's :class:`Reply` to a proxy client, over ASGI.

A whole answer (read and recorded by the guard) goes out with its length. A stream goes
out chunk by chunk, and the client is asked after before each chunk: once it has gone
the proxy stops forwarding, and the guard reads the rest into the ledger in the
background (contract.md §3.8). A stream the guard ends on purpose (broken, or past
``max_answer_bytes``) has its client's connection cut, never finished cleanly.

Header fields the server could not write (:func:`writable_headers`) are left out of what the
client is sent, fresh or replayed; the ledger keeps the answer as the provider sent it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Callable
from typing import Final

import httpx

from effectguard.callpath.exchange import Headers, Reply
from effectguard.callpath.wire import CALL_ID_HEADER, strip_hop_by_hop
from effectguard.ingress.fallback import Send

log = logging.getLogger("effectguard.ingress.server")

#: A byte that may not be in a header name: the name must be an RFC 9110 §5.6.2 token.
_NOT_TOKEN: Final = re.compile(rb"[^!#$%&'*+\-.^_`|~0-9A-Za-z]")
#: A byte that may not be in a header value: a control byte other than tab (RFC 9110 §5.5).
_CONTROL: Final = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


_CALL_ID: Final = CALL_ID_HEADER.lower().encode()


def writable_headers(headers: Headers) -> Headers:
    """``headers`` without the fields the server refuses to write.

    uvicorn checks each field as it writes the response head and raises after it has
    counted the response as started: the client then got nothing, not even the call id,
    for a call that was recorded and charged, and a keyed resend replayed the same field
    into the same failure. An upstream may send such a field (aiohttp reads ``a\\x01b``
    as a value), so it is dropped here; the ledger keeps it as the provider sent it.
    """
    # One search per side for the usual answer, whose every field is fine.
    names = b"".join(k for k, _ in headers)
    values = b"\t".join(v for _, v in headers)
    if not _NOT_TOKEN.search(names) and not _CONTROL.search(values):
        return headers
    return [(k, v) for k, v in headers if k and not _NOT_TOKEN.search(k) and not _CONTROL.search(v)]


async def write_reply(
    send: Send, reply: Reply, gone: Callable[[], bool], cut: Callable[[], bool]
) -> None:
    """Write ``reply``; ``gone`` says whether the client has left (asked before a whole
    answer and before each chunk of a stream), ``cut`` cuts its connection off."""
    headers = writable_headers(strip_hop_by_hop(reply.headers))
    if reply.body is not None:  # a body the guard already read and recorded
        gone()
        body = reply.body
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return
    assert reply.stream is not None
    finished = False
    try:
        # Inside the try: a head that cannot be written still closes the stream, which
        # the guard then reads to its end and settles.
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})
        async for chunk in reply.stream:
            if gone():
                break  # the server would drop the rest: the guard reads it instead
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        else:
            gone()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            finished = True
    except httpx.TransportError as exc:
        # The guard ends a broken or oversized stream this way on purpose, its call
        # already recorded (contract §3.8): a provider's fault, not effectguard's.
        call_id = next((v.decode("latin-1") for k, v in headers if k.lower() == _CALL_ID), None)
        log.warning(
            "stream cut off (call %s): %s", call_id, str(exc)[:300], extra={"call_id": call_id}
        )
        cut()
    finally:
        if not finished:
            # The client went away or the upstream broke: the guard settles the call
            # (reading the upstream to its end in the background if it can).
            with contextlib.suppress(Exception):
                await asyncio.shield(reply.aclose())
        else:
            await reply.aclose()
