"""Run alone (``python bigstream_probe.py SIZE``): one stream of about SIZE bytes through
``AsyncGuardTransport``, read to its end; prints, as JSON, the answer's size, the traced
heap's peak while it was forwarded and recorded, and whether the ledger holds it exactly.

A process of its own, so the peak is this stream's and nothing else's
(tests/test_big_answer_record.py)."""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import tracemalloc
from collections.abc import AsyncIterator

import httpx
import respx

from effectguard import AsyncGuardTransport
from effectguard.config.settings import GuardSettings
from effectguard.ops.verify import verify_ledger
from effectguard.rules.bodytext import decode_body
from effectguard.rules.events import AttemptObserved

URL = "https://api.openai.com/v1/chat/completions"
DELTA = b'data: {"choices":[{"index":0,"delta":{"content":"' + b"y" * 64000 + b'"}}]}\n\n'
END = (
    b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}'
    b"\n\ndata: [DONE]\n\n"
)


class Chunks(httpx.AsyncByteStream):
    """``count`` deltas, then the usage event and ``[DONE]``."""

    def __init__(self, count: int) -> None:
        self.count = count

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for _ in range(self.count):
            yield DELTA
        yield END


async def main(size: int) -> dict[str, object]:
    count = size // len(DELTA)
    request = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
    with tempfile.TemporaryDirectory() as where:
        settings = GuardSettings(retry_wait_s=0, retry_wait_max_s=0)
        transport = AsyncGuardTransport(ledger=f"{where}/ledger.db", settings=settings)
        client = httpx.AsyncClient(transport=transport)
        with respx.mock() as mock:
            sse = {"content-type": "text/event-stream"}
            mock.post(URL).respond(200, stream=Chunks(count), headers=sse)
            tracemalloc.start()
            async with client.stream("POST", URL, json={**request, "stream": True}) as response:
                call_id = response.headers["effectguard-call-id"]
                async for _ in response.aiter_raw():
                    pass
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        events = [e.event for e in await transport.ledger.events(call_id)]
        (observed,) = [e for e in events if isinstance(e, AttemptObserved)]
        stored = decode_body(observed.body, observed.body_encoding)
        verified = (await verify_ledger(transport.ledger)).ok
        await transport.aclose()
    answer = DELTA * count + END
    return {
        "answer": len(answer),
        "peak": peak,
        "exact": stored == answer,
        "verified": verified,
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(int(sys.argv[1])))))
