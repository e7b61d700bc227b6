"""The tool-effect machinery under attack from both sides, with good traffic alongside.

A misbehaving provider: the lookup of an effect-unknown call is answered by
:mod:`hostilekit`'s scripted endpoint (hung, dripped a byte at a time, huge, redirected,
refused, of the wrong shape, lying about its type, cut off, not HTTP at all). Each answer
must leave the call ``effect_unknown`` with nothing recorded and nothing sent again,
unless it is genuine evidence (the controls). A hostile client: form and multipart
bodies that are ambiguous, forge effectguard's own operation-id field, or cost more to
parse than any real request. Every bad request runs beside good keyed calls, which must
each reach the real fake provider exactly once (counted from its receipts); the ledger
verifies at the end.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from hostilekit import HostileSearch, Script, answer, hostile_search, whole
from toolkit import AUTH, KEY, SEND, DropFirstSend, charge, declare, lossy_transport, lost_send
from toolkit import cli_json as cli

from effectguard import AsyncGuardTransport
from effectguard.callpath.resolve import MAX_ANSWER_BYTES
from effectguard.providers.endpoints import legacy_lookup
from effectguard.rules import lookups
from effectguard.testing import FakeProvider, Proxy, fake_provider, running_proxy, start_proxy

pytestmark = pytest.mark.slow

MakeTransport = Callable[..., AsyncGuardTransport]
Finish = Callable[[AsyncGuardTransport], Awaitable[None]]
#: A script, given the call id its lookup asks about.
Scripted = Callable[[str], Script]
#: How many good calls run beside each bad one.
GOOD = 4
TIMEOUT_S = 0.5
EMPTY = b'{"object": "search_result", "data": []}'
ROUTE = "/payments" + SEND


def found(op: str) -> bytes:
    """A search answer that finds one object carrying operation id ``op``."""
    obj = {"id": "send_found", "status": "sent", "metadata": {"effectguard_op": op}}
    return json.dumps({"object": "search_result", "data": [obj]}).encode()


def constant(script: Script) -> Scripted:
    return lambda _op: script


def ok(body: bytes, **kwargs: object) -> Scripted:
    """A 200 whose body is ``body`` (JSON by its Content-Type unless told otherwise)."""
    return constant(whole(200, body, **kwargs))


DEEP = b'{"data": [], "x": ' + b"[" * 1000 + b"]" * 1000 + b"}"
HUGE = b'{"data": [' + b'{"x": 1},' * (MAX_ANSWER_BYTES // 9) + b"{}]}"

#: Misbehaving lookup answers: every one must leave the call unknown.
BAD: dict[str, Scripted] = {
    "hangs past its timeout": constant(Script((b"",), ending="hang")),
    "drips a byte at a time": constant(
        Script(tuple(bytes([b]) for b in answer(200, EMPTY)), pause_s=0.02)
    ),
    "is larger than MAX_ANSWER_BYTES": ok(HUGE),
    "redirects": constant(whole(302, EMPTY, headers=(("Location", "/found"),))),
    "401": constant(whole(401, EMPTY)),
    "403": constant(whole(403, EMPTY)),
    "429": constant(whole(429, EMPTY)),
    "500": constant(whole(500, EMPTY)),
    "502": constant(whole(502, EMPTY)),
    "results is an object": ok(b'{"data": {}}'),
    "results is a string": ok(b'{"data": ""}'),
    "results is null": ok(b'{"data": null}'),
    "results is false": ok(b'{"data": false}'),
    "results holds a string": ok(b'{"data": ["send_1"]}'),
    "results holds a number": ok(b'{"data": [1]}'),
    "applied path is 0": ok(b'{"data": [0]}'),
    "applied path is empty text": ok(b'{"data": [""]}'),
    "applied path is false": ok(b'{"data": [false]}'),
    "applied path is an empty list": ok(b'{"data": [[]]}'),
    "nests 1000 levels": ok(DEEP),
    "is not UTF-8": ok(b'{"data": [], "note": "\xff\xfe"}'),
    "is JSON served as HTML": ok(EMPTY, content_type="text/html"),
    "has no Content-Type": ok(EMPTY, content_type=None),
    "is HTML served as JSON": ok(b"<html><body>502 Bad Gateway</body></html>"),
    "repeats a key, empty last": lambda op: whole(200, found(op)[:-1] + b', "data": []}'),
    "repeats a key, found last": lambda op: whole(200, b'{"data": [], ' + found(op)[1:]),
    "holds NaN": ok(b'{"data": [{"id": NaN, "metadata": {"effectguard_op": "x"}}]}'),
    "finds another operation": lambda op: whole(200, found("call_someone_else")),
    "finds an object without an op": ok(b'{"data": [{"id": "send_1"}]}'),
    "is reset mid-answer": constant(Script((answer(200, EMPTY)[:-10],), ending="reset")),
    "closes short of its length": constant(Script((answer(200, EMPTY)[:-10],))),
    "is not HTTP": constant(Script((b"NOT HTTP AT ALL\r\n\r\n",))),
}


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeProvider]:
    """One fake provider for the module: the receipts of every good call."""
    tmp = tmp_path_factory.mktemp("hostile")
    with fake_provider(tmp / "receipts.jsonl", extra_args=["--lookup-key", KEY]) as provider:
        yield provider


@pytest.fixture(scope="module")
def hostile() -> Iterator[HostileSearch]:
    """The scripted lookup endpoint."""
    with hostile_search() as endpoint:
        yield endpoint


def declaration(
    tmp_path: Path,
    hostile: HostileSearch,
    freshness: float = 60,
    not_found: str = "[200]",
    timeout_s: float = TIMEOUT_S,
) -> Path:
    """``payments`` (toolkit), its lookup sent to ``hostile`` with a short timeout, and
    checking that a found object carries the call's op id."""
    folder = declare(tmp_path, freshness=freshness)
    path = folder / "payments.toml"
    text = path.read_text().replace("{base_url}/v1/search", hostile.url + "/v1/search")
    text = text.replace("not_found = [200]", f"not_found = {not_found}")
    match = 'match = "metadata.effectguard_op"'
    text = text.replace("timeout_s = 5", f"timeout_s = {timeout_s}\n{match}")
    path.write_text(text)
    return folder


def sent_ops(fake: FakeProvider) -> list[str]:
    """The operation ids of every effect on /v1/send the provider received."""
    return [r["op"] for r in fake.effects() if r["path"] == SEND]


async def beside_good_calls(
    client: httpx.AsyncClient, url: str, bad: Awaitable[httpx.Response], tag: str
) -> tuple[httpx.Response, list[str]]:
    """``bad`` with GOOD good keyed calls at once: its answer, and the good call ids
    (each good call is asserted answered 200)."""

    async def good(n: int) -> httpx.Response:
        return await client.post(url, json=charge(n), headers={"Idempotency-Key": f"{tag}-{n}"})

    answered = await asyncio.gather(bad, *(good(n) for n in range(GOOD)))
    for response in answered[1:]:
        assert response.status_code == 200, response.text
    return answered[0], [r.headers["effectguard-call-id"] for r in answered[1:]]


async def a_lost_call(
    tmp_path: Path,
    make_transport: MakeTransport,
    fake: FakeProvider,
    hostile: HostileSearch,
    not_found: str = "[200]",
) -> tuple[AsyncGuardTransport, httpx.AsyncClient, str]:
    """A transport whose first send was lost (its call effect-unknown), its clock past
    the lookup's freshness; the client, and the lost call's id."""
    folder = declaration(tmp_path, hostile, not_found=not_found)
    t = lossy_transport(make_transport, folder, fake)
    client = httpx.AsyncClient(transport=t, headers=AUTH)
    lost = await lost_send(client, fake.url + SEND, charge(99), headers={"Idempotency-Key": "bad"})
    guard = await t.guard()
    guard.resolver.clock = lambda: time.time() + 120
    return t, client, lost


@pytest.mark.parametrize("case", list(BAD))
async def test_a_misbehaving_lookup_answer_decides_nothing(
    tmp_path: Path,
    make_transport: MakeTransport,
    finish: Finish,
    fake: FakeProvider,
    hostile: HostileSearch,
    case: str,
) -> None:
    """The keyed resend of a lost call whose lookup answers so is refused 409
    ``effect_unknown``: nothing is recorded, nothing resent, a sweep decides nothing,
    a redirect is never followed, and the good calls beside it each land exactly once."""
    t, client, lost = await a_lost_call(tmp_path, make_transport, fake, hostile)
    hostile.follow(BAD[case](lost))
    redirected = hostile.hits("/found")
    resend = client.post(fake.url + SEND, json=charge(99), headers={"Idempotency-Key": "bad"})
    refused, good = await beside_good_calls(client, fake.url + SEND, resend, f"good-{lost}")
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"]["type"] == "effect_unknown"
    guard = await t.guard()
    assert await guard.resolver.sweep() == []
    assert [e for e in await t.ledger.events(lost) if e.kind == "call.reconciled"] == []
    assert (await t.ledger.call(lost)).stage == "effect_unknown"
    ops = sent_ops(fake)
    assert lost not in ops
    assert all(ops.count(call_id) == 1 for call_id in good)
    assert hostile.hits("/found") == redirected
    await finish(t)


async def test_a_well_formed_empty_search_resends_exactly_once(
    tmp_path: Path,
    make_transport: MakeTransport,
    finish: Finish,
    fake: FakeProvider,
    hostile: HostileSearch,
) -> None:
    """A control: a search answering a well-formed empty result past its freshness
    proves the lost call not applied, and it is resent exactly once beside good calls."""
    t, client, lost = await a_lost_call(tmp_path, make_transport, fake, hostile)
    hostile.follow(whole(200, EMPTY))
    resend = client.post(fake.url + SEND, json=charge(99), headers={"Idempotency-Key": "bad"})
    resent, good = await beside_good_calls(client, fake.url + SEND, resend, f"good-{lost}")
    assert resent.status_code == 200, resent.text
    assert "effectguard-recovered" not in resent.headers
    ops = sent_ops(fake)
    assert all(ops.count(call_id) == 1 for call_id in [lost, *good])
    await finish(t)


@pytest.mark.parametrize(
    ("content_type", "resent"),
    [("text/html", False), (None, False), ("application/json", True)],
    ids=["HTML 404", "404 without a type", "the provider's JSON 404"],
)
async def test_a_not_found_status_counts_only_in_the_providers_json(
    tmp_path: Path,
    make_transport: MakeTransport,
    finish: Finish,
    fake: FakeProvider,
    hostile: HostileSearch,
    content_type: str | None,
    resent: bool,
) -> None:
    """With ``not_found = [404]`` declared, a 404 proves "not applied" only in the
    provider's own JSON: a gateway's HTML 404 (or one with no type) leaves the lost call
    unknown and unsent; a JSON 404 past the freshness resends it exactly once."""
    t, client, lost = await a_lost_call(tmp_path, make_transport, fake, hostile, "[200, 404]")
    body = b'{"error": {"type": "not_found"}}' if resent else b"<html>404 Not Found</html>"
    hostile.follow(whole(404, body, content_type=content_type))
    answer = await client.post(fake.url + SEND, json=charge(99), headers={"Idempotency-Key": "bad"})
    assert answer.status_code == (200 if resent else 409), answer.text
    assert sent_ops(fake).count(lost) == (1 if resent else 0)
    await finish(t)


async def test_concurrent_keyed_resends_of_one_call_send_it_once(
    tmp_path: Path,
    make_transport: MakeTransport,
    finish: Finish,
    fake: FakeProvider,
    hostile: HostileSearch,
) -> None:
    """A client that fires eight keyed resends of one lost call at once, each asking the
    lookup: one new attempt goes out; the others are told it is in progress, or, once it
    has completed, replayed its answer."""
    t, client, lost = await a_lost_call(tmp_path, make_transport, fake, hostile)
    hostile.follow(whole(200, EMPTY))
    headers = {"Idempotency-Key": "bad"}
    answered = await asyncio.gather(
        *(client.post(fake.url + SEND, json=charge(99), headers=headers) for _ in range(8))
    )
    # The one that went out, and any that came after it completed (a replay), say 200
    # with its answer; those that met it in flight, 409 in_progress.
    sent = [r for r in answered if r.status_code == 200]
    assert len({r.content for r in sent}) == 1
    assert [r.headers.get("effectguard-replayed") for r in sent].count(None) == 1
    waiting = [r for r in answered if r.status_code != 200]
    assert {(r.status_code, r.json()["error"]["type"]) for r in waiting} <= {(409, "in_progress")}
    assert sent_ops(fake).count(lost) == 1
    await finish(t)


class LoseAnswers(httpx.AsyncBaseTransport):
    """A network that, while ``armed``, delivers each request and loses its answer: the
    provider applies the effect, and effectguard cannot know it did."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.armed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if not self.armed or request.url.path != SEND:
            return response
        await response.aread()
        raise httpx.ReadError("connection reset after the provider answered")

    async def aclose(self) -> None:
        await self.inner.aclose()


async def search_arrives(hostile: HostileSearch, seen: int) -> None:
    """Wait until the lookup endpoint has seen more than ``seen`` searches."""
    for _ in range(500):
        if hostile.hits("/v1/search") > seen:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the resend's lookup never reached the search endpoint")


async def test_a_resend_whose_lookup_fails_after_another_decided_the_call_replays_it(
    tmp_path: Path,
    make_transport: MakeTransport,
    finish: Finish,
    fake: FakeProvider,
    hostile: HostileSearch,
) -> None:
    """Two keyed resends of one lost call: the first one's lookup hangs; meanwhile the
    second's proves the call not applied and sends it. The first, its lookup timed out,
    answers from the call as it now stands (the replay), not 409 ``effect_unknown``."""
    t, client, lost = await a_lost_call(tmp_path, make_transport, fake, hostile)
    headers = {"Idempotency-Key": "bad"}
    hostile.follow(Script((b"",), ending="hang"))
    seen = hostile.hits("/v1/search")
    first = asyncio.ensure_future(client.post(fake.url + SEND, json=charge(99), headers=headers))
    await search_arrives(hostile, seen)
    hostile.follow(whole(200, EMPTY))
    second = await client.post(fake.url + SEND, json=charge(99), headers=headers)
    assert second.status_code == 200, second.text
    answered = await first
    assert answered.status_code == 200, answered.text
    assert answered.headers["effectguard-replayed"] == "true"
    assert answered.content == second.content
    assert sent_ops(fake).count(lost) == 1
    await finish(t)


async def test_evidence_from_before_an_attempt_does_not_decide_that_attempt(
    tmp_path: Path,
    make_transport: MakeTransport,
    finish: Finish,
    fake: FakeProvider,
    hostile: HostileSearch,
) -> None:
    """A resend's lookup answers "not found" late: by then another resend has sent the
    call again, and that attempt reached the provider and lost its answer. The late
    "not found" says nothing of that attempt: it is not recorded, the call stays
    unknown, and the provider is not paid a third time."""
    folder = declaration(tmp_path, hostile, timeout_s=5)
    network = LoseAnswers(httpx.AsyncHTTPTransport())
    t = make_transport(
        inner=DropFirstSend(network), providers=[folder], upstreams={"payments": fake.url}
    )
    client = httpx.AsyncClient(transport=t, headers=AUTH)
    headers = {"Idempotency-Key": "bad"}
    lost = await lost_send(client, fake.url + SEND, charge(99), headers=headers)
    guard = await t.guard()
    guard.resolver.clock = lambda: time.time() + 120
    late = Script(tuple(answer(200, EMPTY).partition(b"\r\n\r\n")), pause_s=1.0)
    hostile.follow(late)
    seen = hostile.hits("/v1/search")
    first = asyncio.ensure_future(client.post(fake.url + SEND, json=charge(99), headers=headers))
    await search_arrives(hostile, seen)
    hostile.follow(whole(200, EMPTY))
    network.armed = True
    second = await client.post(fake.url + SEND, json=charge(99), headers=headers)
    assert second.status_code == 502, second.text
    assert sent_ops(fake).count(lost) == 1  # the second attempt's effect
    network.armed = False
    answered = await first
    assert answered.status_code == 409, answered.text
    assert answered.json()["error"]["type"] == "effect_unknown"
    assert sent_ops(fake).count(lost) == 1
    assert (await t.ledger.call(lost)).stage == "effect_unknown"
    await finish(t)


async def test_a_search_that_finds_this_operation_recovers_it(
    tmp_path: Path,
    make_transport: MakeTransport,
    finish: Finish,
    fake: FakeProvider,
    hostile: HostileSearch,
) -> None:
    """A control: an object whose ``metadata.effectguard_op`` is the call's own (the
    declared ``match``) is the call's result, recovered with nothing sent."""
    t, client, paid = await a_lost_call(tmp_path, make_transport, fake, hostile)
    hostile.follow(whole(200, found(paid)))
    resend = client.post(fake.url + SEND, json=charge(99), headers={"Idempotency-Key": "bad"})
    recovered, good = await beside_good_calls(client, fake.url + SEND, resend, f"good-{paid}")
    assert recovered.status_code == 200, recovered.text
    assert recovered.headers["effectguard-recovered"] == "lookup:payments"
    assert recovered.json()["metadata"] == {"effectguard_op": paid}
    ops = sent_ops(fake)
    assert paid not in ops
    assert all(ops.count(call_id) == 1 for call_id in good)
    await finish(t)


@pytest.mark.parametrize(
    ("body", "verdict"),
    [
        (b'{"applied": true}', "applied"),
        (b'{"applied": false}', "not_applied"),
        (b'{"applied": "false"}', "unknown"),
        (b'{"applied": "no"}', "unknown"),
        (b'{"applied": 1}', "unknown"),
        (b'{"applied": 0}', "unknown"),
        (b'{"applied": []}', "unknown"),
        (b'{"applied": {}}', "unknown"),
        (b'{"applied": null}', "unknown"),
    ],
)
def test_the_older_lookup_reads_only_true_or_false(body: bytes, verdict: str) -> None:
    """The provider-wide ``{"applied": true|false}`` answer: anything but a boolean there
    (a string "false", an empty list) proves nothing."""
    lookup = legacy_lookup("{base_url}/ops/{op}")
    reading = lookups.read_answer(
        200,
        body,
        content_type="application/json",
        applied=lookup.applied,
        not_found=lookup.not_found,
        freshness_s=lookup.freshness_s,
        age_s=60,
        results=lookup.results,
        op="key-1",
        blind=None,
    )
    assert reading.verdict == verdict, reading.why


# -- the same through the proxy, whose upstream leg is aiohttp ------------------------

#: What a provider's answer does to aiohttp that httpx takes in its stride, and the
#: answers the two clients read differently; each the answer to a lookup.
THROUGH_PROXY: dict[str, Scripted] = {
    "has a header line too long for the client": constant(
        Script((answer(200, EMPTY, headers=(("X-Padding", "p" * 100_000),)),))
    ),
    **{
        name: BAD[name]
        for name in (
            "is not HTTP",
            "nests 1000 levels",
            "is reset mid-answer",
            "closes short of its length",
            "redirects",
            "drips a byte at a time",
            "repeats a key, empty last",
            "finds another operation",
        )
    },
}
BROKEN = """
name = "broken"
base_url = "http://127.0.0.1:9"
dialect = "flat"
prices_taken = "2026-12-01"

[[endpoints]]
path = "/v1/send"
effect = "at_most_once"

[models.default]
per_call = "0.01"
max_output_tokens = 0
"""


CHARGES = """
name = "charges"
base_url = "http://127.0.0.1:9"
dialect = "flat"
prices_taken = "2026-12-01"

[[endpoints]]
path = "/v1/charges"
effect = "at_most_once"
op_id = { form = "metadata[effectguard_op]" }

[models.default]
per_call = "0.01"
max_output_tokens = 0
"""


MAIL = """
name = "mail"
base_url = "http://127.0.0.1:9"
dialect = "flat"
prices_taken = "2026-12-01"

[[endpoints]]
path = "/v1/send"
effect = "at_most_once"
op_id = { json = "Metadata.effectguard_op" }

[models.default]
per_call = "0.01"
max_output_tokens = 0
"""


@dataclass
class Proxied:
    """The module's proxy, with one call a crash left effect-unknown (key ``bad``)."""

    proxy: Proxy
    lost: str


@pytest.fixture(scope="module")
def proxied(
    tmp_path_factory: pytest.TempPathFactory, fake: FakeProvider, hostile: HostileSearch
) -> Iterator[Proxied]:
    """A proxy to the fake provider (``payments``, looked up at ``hostile``) and to
    ``hostile`` itself (``broken``); its ledger holds a payment the proxy crashed after
    admitting, which its restart leaves effect-unknown."""
    tmp = tmp_path_factory.mktemp("proxied")
    folder = declaration(tmp, hostile, freshness=0)
    (folder / "broken.toml").write_text(BROKEN)
    (folder / "charges.toml").write_text(CHARGES)
    (folder / "mail.toml").write_text(MAIL)
    config = tmp / "config.toml"
    config.write_text("[server]\nsweep_s = 3600\n")
    ledger = tmp / "ledger.db"
    args = ("--providers", str(folder), "--config", str(config))
    upstreams = {"payments": fake.url, "broken": hostile.url}
    upstreams |= {"charges": fake.url, "openai": fake.url, "mail": fake.url}
    env = {"PAYMENTS_API_KEY": KEY}
    hostile.follow(whole(503, b"{}"))  # the restart's first sweep learns nothing
    crashing = start_proxy(
        ledger, upstreams=upstreams, args=args, env={**env, "EFFECTGUARD_CRASH_AT": "after:admit"}
    )
    try:
        with pytest.raises(httpx.TransportError):
            bad = {**AUTH, "Idempotency-Key": "bad"}
            httpx.post(crashing.url + ROUTE, json=charge(99), headers=bad, timeout=30)
        crashing.process.wait(15)
    finally:
        crashing.kill()
    with running_proxy(ledger, upstreams=upstreams, args=args, env=env) as proxy:
        (state,) = cli_calls(ledger)
        assert state["stage"] == "effect_unknown"
        yield Proxied(proxy, state["call_id"])
    assert cli("verify", "--ledger", str(ledger))["ok"] is True


def cli_calls(ledger: Path) -> list[dict[str, Any]]:
    """``effectguard calls``: every call in the ledger."""
    calls: list[dict[str, Any]] = cli("calls", "--ledger", str(ledger))
    return calls


@pytest.mark.parametrize("case", list(THROUGH_PROXY))
async def test_a_misbehaving_lookup_answer_decides_nothing_through_the_proxy(
    proxied: Proxied, fake: FakeProvider, hostile: HostileSearch, case: str
) -> None:
    """Through the proxy's aiohttp leg too: the keyed resend is refused 409
    ``effect_unknown`` (never a 500), nothing is resent, and the good calls beside it
    each land exactly once."""
    hostile.follow(THROUGH_PROXY[case](proxied.lost))
    redirected = hostile.hits("/found")
    async with httpx.AsyncClient(base_url=proxied.proxy.url, headers=AUTH, timeout=30) as client:
        resend = client.post(ROUTE, json=charge(99), headers={"Idempotency-Key": "bad"})
        refused, good = await beside_good_calls(client, ROUTE, resend, f"proxy-{case}")
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"]["type"] == "effect_unknown"
    ops = sent_ops(fake)
    assert proxied.lost not in ops
    assert all(ops.count(call_id) == 1 for call_id in good)
    assert hostile.hits("/found") == redirected


async def test_a_provider_answer_that_is_not_http_is_an_unknown_effect(
    proxied: Proxied, fake: FakeProvider, hostile: HostileSearch
) -> None:
    """A call whose provider answers with something aiohttp cannot parse was sent: 502
    ``effect_unknown`` with its call id (not a 500), beside good calls that land once."""
    hostile.follow(BAD["is not HTTP"](""))
    async with httpx.AsyncClient(base_url=proxied.proxy.url, headers=AUTH, timeout=30) as client:
        broken = client.post("/broken" + SEND, json=charge(1))
        answered, good = await beside_good_calls(client, ROUTE, broken, "proxy-broken")
    assert answered.status_code == 502, answered.text
    assert answered.json()["error"]["type"] == "effect_unknown"
    ops = sent_ops(fake)
    assert all(ops.count(call_id) == 1 for call_id in good)


# -- a hostile client ------------------------------------------------------------------

FORM = "application/x-www-form-urlencoded"
CHARGE = "/charges/v1/charges"
UPLOAD = "/openai/v1/audio/transcriptions"
MAIL_SEND = "/mail" + SEND


def form_case(body: bytes) -> tuple[str, str, bytes]:
    return CHARGE, FORM, body


def mail_case(body: object) -> tuple[str, str, bytes]:
    return MAIL_SEND, "application/json", json.dumps(body).encode()


def parts(*heads: bytes, boundary: bytes = b"B") -> bytes:
    """A multipart body: one part per head (its header lines), each with content ``v``."""
    framed = b"".join(b"--" + boundary + b"\r\n" + h + b"\r\n\r\nv\r\n" for h in heads)
    return framed + b"--" + boundary + b"--\r\n"


def field(name: bytes, extra: bytes = b"") -> bytes:
    return b'Content-Disposition: form-data; name="' + name + b'"' + extra


AUDIO = field(b"file", b'; filename="a.wav"') + b"\r\nContent-Type: audio/wav"
WHISPER = field(b"model")


def upload_case(
    body: bytes, content_type: str = "multipart/form-data; boundary=B"
) -> tuple[str, str, bytes]:
    return UPLOAD, content_type, body


def whisper(*heads: bytes) -> bytes:
    """A transcription upload whose model part says ``whisper-1``, and ``heads`` more."""
    body = parts(AUDIO, *heads, WHISPER)
    return body.replace(b"\r\n\r\nv\r\n--B--", b"\r\n\r\nwhisper-1\r\n--B--")


#: Bodies no real client sends, each refused 400 before anything is sent.
REFUSED: dict[str, tuple[str, str, bytes]] = {
    "a form that sets the op-id field itself": form_case(b"amount=1&metadata[effectguard_op]=x"),
    "the op-id field percent-encoded": form_case(b"amount=1&metadata%5Beffectguard_op%5D=x"),
    "the op-id field encoded twice": form_case(b"amount=1&metadata%255Beffectguard_op%255D=x"),
    "the op-id field with an escaped letter": form_case(b"metadata[effectguard%5Fop]=x"),
    "the op-id field in other case": form_case(b"amount=1&Metadata[EFFECTGUARD_OP]=x"),
    "the op-id field with a space": form_case(b"amount=1&metadata[effectguard_op]+=x"),
    "the op-id field nested under": form_case(b"amount=1&metadata[effectguard_op][]=x"),
    "the op-id field nested under a long key": form_case(
        b"metadata[effectguard_op][" + b"%2561" * 5000 + b"]=x"
    ),
    "the op-id field dotted": form_case(b"amount=1&metadata.effectguard_op=x"),
    # A provider that reads a POST's query parameters could keep the client's op id.
    "the op-id field in the query string": (
        CHARGE + "?metadata[effectguard_op]=x",
        FORM,
        b"amount=1",
    ),
    "the op-id field percent-encoded in the query": (
        CHARGE + "?expand=a&metadata%5BEffectguard_op%5D",
        FORM,
        b"amount=1",
    ),
    "the JSON op-id field in the query string": (
        MAIL_SEND + "?metadata.effectguard_op=x",
        "application/json",
        b'{"to": "a@x"}',
    ),
    "a form with a bad escape": form_case(b"amount=1&note=%ZZ"),
    "a form escaping bytes that are not UTF-8": form_case(b"amount=1&note=%ff"),
    "a form naming its model twice": form_case(b"model=other&amount=1&model=default"),
    "a form of 1001 fields": form_case(b"&".join(b"f%d=v" % n for n in range(1001))),
    "JSON with the op-id field in other case": mail_case({"Metadata": {"EffectGuard_Op": "x"}}),
    "JSON with the op-id object in other case": mail_case({"metadata": {"effectguard_op": "x"}}),
    "multipart with no boundary": upload_case(whisper(), "multipart/form-data"),
    "multipart with two boundaries": upload_case(
        whisper(), "multipart/form-data; boundary=B; boundary=C"
    ),
    "multipart with two boundaries in other case": upload_case(
        whisper(), "multipart/form-data; boundary=B; BOUNDARY=C"
    ),
    "multipart with 40 KB of part headers": upload_case(
        whisper(field(b"note") + b"\r\nX-Pad: p" * 4000)
    ),
    "multipart with 100 parts of 2600 short header lines": upload_case(
        whisper(*[field(b"n%d" % n) + b"\r\nX: y" * 2600 for n in range(100)])
    ),
    "multipart with 30000 parts": upload_case(whisper(*[field(b"n%d" % n) for n in range(30000)])),
    "a part with two dispositions": upload_case(
        whisper(field(b"note") + b"\r\n" + field(b"model"))
    ),
    "a part naming itself twice": upload_case(whisper(field(b"note", b'; name="model"'))),
    "multipart naming its model twice": upload_case(whisper(WHISPER)),
}


@pytest.mark.parametrize("case", list(REFUSED))
async def test_a_hostile_body_is_refused_before_anything_is_sent(
    proxied: Proxied, fake: FakeProvider, case: str
) -> None:
    """Refused 400 ``invalid_request``, nothing reaches the provider, and the good calls
    beside it each land exactly once."""
    path, content_type, body = REFUSED[case]
    tag = f"hostile-{len(fake.receipts())}"
    headers = {"content-type": content_type, "x-fake-tag": tag}
    async with httpx.AsyncClient(base_url=proxied.proxy.url, headers=AUTH, timeout=30) as client:
        bad = client.post(path, content=body, headers=headers)
        refused, good = await beside_good_calls(client, ROUTE, bad, f"client-{case}")
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["type"] == "invalid_request", refused.text
    assert [r for r in fake.receipts() if r["tag"] == tag] == []
    ops = sent_ops(fake)
    assert all(ops.count(call_id) == 1 for call_id in good)


async def test_the_well_formed_neighbours_of_hostile_bodies_are_sent_once(
    proxied: Proxied, fake: FakeProvider
) -> None:
    """The controls: a form repeating a field effectguard does not read, a form whose
    metadata has other keys, and a well-formed upload, each sent exactly once, with the
    op id appended to the form as the last field."""
    cases = [
        form_case(b"amount=1&expand[]=a&expand[]=b"),
        form_case(b"amount=1&metadata[order]=7&metadata[effectguard]=x"),
        (CHARGE + "?expand[]=a&metadata[order]=7", FORM, b"amount=1"),
        upload_case(whisper(field(b"language"))),
        mail_case({"Metadata": {"effectguard_op": "x", "order": "7"}}),  # x is replaced
    ]
    async with httpx.AsyncClient(base_url=proxied.proxy.url, headers=AUTH, timeout=30) as client:
        for n, (path, content_type, body) in enumerate(cases):
            tag = f"neighbour-{n}-{len(fake.receipts())}"
            headers = {"content-type": content_type, "x-fake-tag": tag}
            sent = client.post(path, content=body, headers=headers)
            answered, good = await beside_good_calls(client, ROUTE, sent, tag)
            assert answered.status_code == 200, answered.text
            assert len([r for r in fake.effects() if r["tag"] == tag]) == 1
            ops = sent_ops(fake)
            assert all(ops.count(call_id) == 1 for call_id in good)
            if path == CHARGE:  # the fake reads metadata[effectguard_op] from a form
                (receipt,) = [r for r in fake.effects() if r["tag"] == tag]
                assert receipt["op"] == answered.headers["effectguard-call-id"]


async def test_a_genuine_not_found_resends_exactly_once_through_the_proxy(
    proxied: Proxied, fake: FakeProvider, hostile: HostileSearch
) -> None:
    """The control, last: a well-formed empty search resends the crashed call once."""
    hostile.follow(whole(200, EMPTY))
    async with httpx.AsyncClient(base_url=proxied.proxy.url, headers=AUTH, timeout=30) as client:
        resend = client.post(ROUTE, json=charge(99), headers={"Idempotency-Key": "bad"})
        resent, good = await beside_good_calls(client, ROUTE, resend, "proxy-genuine")
    assert resent.status_code == 200, resent.text
    ops = sent_ops(fake)
    assert all(ops.count(call_id) == 1 for call_id in [proxied.lost, *good])
