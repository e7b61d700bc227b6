"""Writing the guard's :class:`Reply` to a proxy client, over ASGI.

A whole answer (read and recorded by the guard) goes out with its length. A stream goes
out chunk by chunk, and the client is asked after before each chunk: once it has gone
the proxy stops forwarding, and the guard reads the rest into the ledger in the
background (contract.md §3.8). A stream the guard ends on purpose (broken, or past
``max_answer_bytes``) has its client's connection cut, never finished cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import httpx

from effectguard.callpath.exchange import Reply
from effectguard.callpath.wire import strip_hop_by_hop
from effectguard.ingress.fallback import Send

log = logging.getLogger("effectguard.ingress.server")


async def write_reply(
    send: Send, reply: Reply, gone: Callable[[], bool], cut: Callable[[], bool]
) -> None:
    """Write ``reply``; ``gone`` says whether the client has left (asked before a whole
    answer and before each chunk of a stream), ``cut`` cuts its connection off."""
    headers = strip_hop_by_hop(reply.headers)
    if reply.body is not None:  # a body the guard already read and recorded
        gone()
        body = reply.body
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return
    assert reply.stream is not None
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    finished = False
    try:
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
        log.warning("stream cut off: %s", str(exc)[:300])
        cut()
    finally:
        if not finished:
            # The client went away or the upstream broke: the guard settles the call
            # (reading the upstream to its end in the background if it can).
            with contextlib.suppress(Exception):
                await asyncio.shield(reply.aclose())
        else:
            await reply.aclose()
