"""The simulated clients: each scheduled call sent as an SDK would send it.

Every HTTP request is written down as an :class:`Answer`, whatever came back
(a status and the exact bytes, or the transport error that ended it). Those
answers are the client half of the evidence the invariants read; effectguard
wrote none of it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from effectguard.testing.fakebehaviour import BEHAVIOUR_HEADER, TAG_HEADER
from effectguard.testing.sim.proxykeys import ClientKeys
from effectguard.testing.sim.schedule import FRESHNESS_S, ROUTES, Call

__all__ = ["Answer", "Kind", "body_of", "run_call", "send"]

Kind = Literal["first", "retry", "repeat", "replay", "resend"]
#: At most this many rounds of keyed resends of a ``pay`` call short of a 200.
RESEND_ROUNDS = 3
#: Timeouts: a SIGSTOPped replica accepts connections but answers only after SIGCONT.
TIMEOUT = httpx.Timeout(30.0, connect=2.0)


@dataclass
class Answer:
    """What one HTTP request of a scheduled call got back."""

    call: str
    kind: Kind
    tag: str
    replica: int
    stream: bool
    key: str | None
    status: int | None = None
    call_id: str | None = None
    replayed: bool = False
    #: ``Effectguard-Recovered``: the result a lookup or hook recovered (who did).
    recovered: str | None = None
    #: The ``x-should-retry`` header, which the SDKs obey before the status.
    retry_hint: str | None = None
    error_type: str | None = None
    body_b64: str = ""
    transport_error: str | None = None
    #: The proxy key sent (``--operator``: its name, ``ROOT.N``; None: none).
    proxy_key: str | None = None
    #: When the request was sent (``time.time()``: the clock of the operator's notes).
    sent_at: float = 0.0
    #: When the answer's status arrived (``time.time()``; 0: none did, or an older run's).
    answered_at: float = 0.0

    @property
    def body(self) -> bytes:
        """The exact bytes received."""
        return base64.b64decode(self.body_b64)

    @property
    def clean_ok(self) -> bool:
        """A 200 whose body arrived to its end without a transport error."""
        return self.status == 200 and self.transport_error is None


def body_of(call: Call) -> dict[str, Any]:
    """The JSON body of ``call``'s requests (the same for every retry)."""
    model = ROUTES[call.route][2]
    messages = [{"role": "user", "content": call.prompt}]
    if call.route == "send":
        return {"to": f"{call.id}@example.com", "subject": call.prompt}
    if call.route == "pay":
        return {"amount": 100 + int(call.id[1:]), "currency": "usd", "description": call.prompt}
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": call.max_tokens}
    if call.stream:
        body["stream"] = True
        if call.route == "chat":
            body["stream_options"] = {"include_usage": True}
    return body


def _headers(call: Call, tag: str, retry_count: int, kind: Kind) -> dict[str, str]:
    headers = {
        "content-type": "application/json",
        "effectguard-budget": call.budget,
        "x-stainless-retry-count": str(retry_count),
        TAG_HEADER: tag,
    }
    behaviour = call.resend_behaviour if kind == "resend" else ""
    if behaviour or call.behaviour:
        headers[BEHAVIOUR_HEADER] = behaviour or call.behaviour
    if call.key is not None:
        headers["idempotency-key"] = call.key
    if call.route == "messages":
        headers["anthropic-version"] = "2023-06-01"
    return headers


async def send(
    client: httpx.AsyncClient,
    base_url: str,
    call: Call,
    *,
    kind: Kind,
    tag: str,
    replica: int,
    retry_count: int,
    keys: ClientKeys | None = None,
) -> Answer:
    """Send one request of ``call`` to ``base_url`` and record what came back."""
    provider, path, _, _ = ROUTES[call.route]
    answer = Answer(call.id, kind, tag, replica, call.stream, call.key)
    received = bytearray()
    content = json.dumps(body_of(call)).encode()
    headers = _headers(call, tag, retry_count, kind)
    held = keys.of(call.budget) if keys is not None else None
    if held is not None:
        answer.proxy_key, headers["effectguard-key"] = held
    answer.sent_at = time.time()
    try:
        async with client.stream(
            "POST", f"{base_url}/{provider}{path}", content=content, headers=headers
        ) as response:
            answer.status = response.status_code
            answer.answered_at = time.time()
            answer.call_id = response.headers.get("effectguard-call-id")
            answer.replayed = response.headers.get("effectguard-replayed") == "true"
            answer.recovered = response.headers.get("effectguard-recovered")
            answer.retry_hint = response.headers.get("x-should-retry")
            async for chunk in response.aiter_raw():
                received += chunk
    except httpx.HTTPError as exc:
        answer.transport_error = f"{type(exc).__name__}: {exc}"
    answer.body_b64 = base64.b64encode(bytes(received)).decode()
    if answer.status is not None and answer.status >= 400:
        answer.error_type = _error_type(bytes(received))
    return answer


def _error_type(raw: bytes) -> str | None:
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    error = obj.get("error") if isinstance(obj, dict) else None
    return error.get("type") if isinstance(error, dict) else None


def _sdk_would_retry(answer: Answer) -> bool:
    """The OpenAI/Anthropic SDKs' rule: the server's hint first, then the status."""
    if answer.retry_hint in ("true", "false"):
        return answer.retry_hint == "true"
    if answer.status is None:
        return True  # connection error or timeout
    return answer.status in (408, 409, 429) or answer.status >= 500


async def run_call(
    client: httpx.AsyncClient,
    url_of: Callable[[int], str],
    call: Call,
    keys: ClientKeys | None = None,
) -> list[Answer]:
    """Send ``call`` with SDK-style retries (and its repeat); every answer, in order."""
    answers: list[Answer] = []
    for n in range(call.sdk_retries + 1):
        replica = call.replicas[n]
        kind: Kind = "first" if n == 0 else "retry"
        answer = await send(
            client,
            url_of(replica),
            call,
            kind=kind,
            tag=f"{call.id}.{n}",
            replica=replica,
            retry_count=n,
            keys=keys,
        )
        answers.append(answer)
        if not _sdk_would_retry(answer):
            break
        await asyncio.sleep(0.1 * 2**n)  # the SDKs back off; short here
    if call.repeat:
        replica = call.replicas[-1]
        answers.append(
            await send(
                client,
                url_of(replica),
                call,
                kind="repeat",
                tag=f"{call.id}.r",
                replica=replica,
                retry_count=1,
                keys=keys,
            )
        )
    if call.resends:
        answers += await _resend_rounds(client, url_of, call, answers[-1].clean_ok, keys)
    return answers


async def _resend_rounds(
    client: httpx.AsyncClient,
    url_of: Callable[[int], str],
    call: Call,
    done: bool,
    keys: ClientKeys | None,
) -> list[Answer]:
    """Short of a 200, ``call.resends`` keyed resends at once, each round once the
    lookup's freshness has passed: they race one another's lookups, the sweeper's, and
    the attempt one of them starts. A key-less call's copies declare themselves SDK
    retries (a key-less request that does not is new work, contract §4)."""
    answers: list[Answer] = []
    for round_ in range(RESEND_ROUNDS):
        if done:
            break
        await asyncio.sleep(FRESHNESS_S + 0.5)
        replicas = [call.replicas[(round_ + n) % len(call.replicas)] for n in range(call.resends)]
        sent = await asyncio.gather(
            *(
                send(
                    client,
                    url_of(replica),
                    call,
                    kind="resend",
                    tag=f"{call.id}.s{round_}.{n}",
                    replica=replica,
                    retry_count=0 if call.key else 1,
                    keys=keys,
                )
                for n, replica in enumerate(replicas)
            )
        )
        answers += sent
        done = any(a.clean_ok for a in sent)
    return answers
