"""A proxy client that leaves for good: its connection reset, not half-closed.

A client that closes its socket after its whole request (an SDK's timeout) sends a FIN,
which the proxy cannot tell from a half-close: it answers, and logs the status written
(contract §3.8). A reset (SO_LINGER 0) loses the connection: the proxy knows its client
has gone, and its access line says 499.

A client of a transport that leaves a stream after its first chunk: the transport reads
it to its end (or its limit) in the background and settles the call there.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from typing import Any

import httpx

from effectguard import AsyncGuardTransport


def leave_with_reset(
    url: str, path: str, body: dict[str, Any], headers: dict[str, str], after_s: float
) -> None:
    """POST ``body`` as JSON to ``url`` + ``path`` on a raw socket and reset the connection
    ``after_s`` seconds later, reading nothing."""
    data = json.dumps(body).encode()
    host, port = url.removeprefix("http://").split(":")
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}", "Content-Type: application/json"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    lines.append(f"Content-Length: {len(data)}")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head + data)
        time.sleep(after_s)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


async def leave_a_stream(
    client: httpx.AsyncClient, transport: AsyncGuardTransport, url: str, body: dict[str, Any]
) -> str:
    """POST a streamed call through ``client``, read its first chunk and go away; wait (5 s
    at most) until ``transport`` settles it in the background. The call's id."""
    async with client.stream("POST", url, json=body) as response:
        call_id = response.headers["effectguard-call-id"]
        async for _ in response.aiter_raw():
            break
    for _ in range(500):
        if (await transport.ledger.call(call_id)).stage != "in_flight":
            break
        await asyncio.sleep(0.01)
    return call_id
