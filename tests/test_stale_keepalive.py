"""Kept-alive upstream connections that the upstream closes while they sit idle.

An upstream (or a load balancer in front of it) closes a connection that stayed idle
past its keep-alive timeout. A request sent on it as the close crosses it on the wire
is lost unread, but effectguard cannot prove that: the call is ``effect_unknown``. Two
things keep that from happening where it can be avoided:

* No leg reuses a connection idle longer than 4 s, below the most common upstream
  keep-alive timeout (5 s: uvicorn's, so vLLM's, Node's, Apache's); both legs used to
  reuse one for 5 s, so a call 4.9 s after the last one raced the upstream's close.
* A connection whose close already reached effectguard when a request was to be
  written on it carries nothing: the request goes out on a fresh connection (the
  proxy's leg wrote it on the closed one, and the call was ``effect_unknown`` though
  the upstream never read it).

The provider's receipts (the requests it read whole) count the effects.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
from asgikit import asgi_call
from keepalivekit import KeepAliveUpstream

from effectguard import AsyncGuardTransport, GuardTransport
from effectguard.callpath.exchange import Outbound
from effectguard.callpath.wire import classify_transport_error
from effectguard.config.settings import load_settings
from effectguard.ingress.aioleg import AiohttpLeg
from effectguard.ingress.server import create_app

CHAT = "/v1/chat/completions"
#: Longer than the legs keep an idle connection, shorter than the upstream does.
PAST_THE_BOUND_S = 4.5


def _chat(content: str) -> bytes:
    return json.dumps(
        {
            "model": "gpt-4o-mini",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": content}],
        }
    ).encode()


async def _proxy_calls(upstream: KeepAliveUpstream, ledger: Path) -> list[int]:
    settings = load_settings(ledger=str(ledger), upstreams={"openai": upstream.url})
    app = create_app(settings)
    await app.startup()
    try:
        first = (await asgi_call(app, "/openai" + CHAT, _chat("proxy-0")))[0]
        await asyncio.sleep(PAST_THE_BOUND_S)
        return [first, (await asgi_call(app, "/openai" + CHAT, _chat("proxy-1")))[0]]
    finally:
        await app.shutdown()


async def _async_transport_calls(upstream: KeepAliveUpstream, ledger: Path) -> list[int]:
    transport = AsyncGuardTransport(ledger=str(ledger), upstreams={"openai": upstream.url})
    async with httpx.AsyncClient(transport=transport, base_url=upstream.url) as client:
        first = await client.post(CHAT, content=_chat("async-0"))
        await asyncio.sleep(PAST_THE_BOUND_S)
        second = await client.post(CHAT, content=_chat("async-1"))
    return [first.status_code, second.status_code]


def _sync_transport_calls(upstream: KeepAliveUpstream, ledger: Path) -> list[int]:
    transport = GuardTransport(ledger=str(ledger), upstreams={"openai": upstream.url})
    with httpx.Client(transport=transport, base_url=upstream.url) as client:
        first = client.post(CHAT, content=_chat("sync-0"))
        time.sleep(PAST_THE_BOUND_S)
        second = client.post(CHAT, content=_chat("sync-1"))
    return [first.status_code, second.status_code]


def test_no_leg_reuses_a_connection_idle_near_a_five_second_keep_alive(tmp_path: Path) -> None:
    """A call 4.5 s after the last one goes out on a fresh connection through the proxy
    and both transports, not on one a 5 s keep-alive upstream is about to close."""
    with (
        KeepAliveUpstream(idle_close_s=5.0) as proxied,
        KeepAliveUpstream(idle_close_s=5.0) as in_async,
        KeepAliveUpstream(idle_close_s=5.0) as in_sync,
    ):

        async def run() -> list[list[int]]:
            return await asyncio.gather(
                _proxy_calls(proxied, tmp_path / "proxy.db"),
                _async_transport_calls(in_async, tmp_path / "async.db"),
                asyncio.to_thread(_sync_transport_calls, in_sync, tmp_path / "sync.db"),
            )

        statuses = asyncio.run(run())
    assert statuses == [[200, 200], [200, 200], [200, 200]]
    for upstream in (proxied, in_async, in_sync):
        assert len(upstream.receipts) == 2
    assert (proxied.connections, in_async.connections, in_sync.connections) == (2, 2, 2)


def test_a_connection_closed_before_the_write_carries_nothing() -> None:
    """The proxy's leg, given a pooled connection whose close has reached the socket but
    not yet aiohttp, writes nothing on it: the call goes out on a fresh connection, the
    provider reads it once and answers it."""
    with KeepAliveUpstream(close_after_s=0.05) as upstream:

        async def run() -> list[object]:
            leg = AiohttpLeg(5.0, 5.0)
            outcomes: list[object] = []
            try:
                for n in range(2):
                    request = Outbound("POST", upstream.url + CHAT, CHAT, CHAT, [], _chat(f"c{n}"))
                    try:
                        response = await leg.send(request)
                        async for _ in response.aiter_raw():
                            pass
                        await response.aclose()
                        outcomes.append(response.status)
                    except httpx.TransportError as exc:
                        outcomes.append(classify_transport_error(exc))
                    # Holds the event loop while the upstream hangs up, 50 ms after its
                    # answer: the close waits at the socket when the next request starts.
                    time.sleep(0.3)
            finally:
                await leg.aclose()
            return outcomes

        outcomes = asyncio.run(run())
    assert outcomes == [200, 200]
    assert [json.loads(b)["messages"][0]["content"] for b in upstream.receipts] == ["c0", "c1"]
    assert upstream.connections == 2
