"""The bad-input corpus: every hostile or careless input gets its answer, and harms nobody.

One real ``effectguard serve`` (short front-door limits) in front of one real fake
provider (``openai``), a recording upstream standing for a tool provider whose base
URL has a path (``send_email`` at ``{recorder}/tenant1``, so that an escaping path
would be seen arriving outside ``/tenant1``), and a closed port (``anthropic``, for a
read-only call whose upstream is down). Four threads keep sending ordinary keyed
chat calls for the whole run.

Each row of :data:`CASES` is one input: how it is sent, the status and error
``type`` it must get, and how many requests may reach a provider because of it
(0 unless the input is valid), counted by its ``x-fake-tag`` in the fake provider's
receipts and at the recorder. Afterwards every good call was answered 200 and is
``completed``, nothing else was admitted, no ``effectguard-*`` client header went
upstream, and ``effectguard verify`` passes.

To add an input, add a :class:`Case` to :data:`CASES` (its ``name`` becomes its tag).
"""

from __future__ import annotations

import contextlib
import io
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import pytest
from corpuskit import (
    GoodStream,
    Send,
    chunked,
    http,
    huge_header,
    raw,
    raw_post,
    resend,
    slowloris,
    stream,
    unfinished_body,
)
from edgekit import Seen, recording_upstream

from effectguard.ops.cli import main as cli_main
from effectguard.testing import FakeProvider, Proxy, fake_provider, free_port, running_proxy

pytestmark = pytest.mark.slow

CHAT = "/openai/v1/chat/completions"
MESSAGES = "/anthropic/v1/messages"
SEND = "/send_email/v1/send"
MAX_BODY = 64 * 1024
#: Long enough for anything the proxy must do at once, on a loaded machine.
PATIENCE_S = 20.0


def chat(content: str = "hello", **extra: Any) -> dict[str, Any]:
    """A small OpenAI chat completion request body."""
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": content}]}
    return {**body, "max_tokens": 8, **extra}


def message(**extra: Any) -> dict[str, Any]:
    """A small Anthropic Messages request body."""
    body = {"model": "claude-haiku-4-5", "messages": [{"role": "user", "content": "hi"}]}
    return {**body, "max_tokens": 8, **extra}


def encoded(body: Any) -> bytes:
    """``body`` as JSON bytes."""
    return json.dumps(body).encode()


def nested(depth: int) -> bytes:
    """A chat request whose ``metadata`` nests ``depth`` arrays deep."""
    return encoded(chat())[:-1] + b', "metadata": ' + b"[" * depth + b"]" * depth + b"}"


def post_chat(**extra: Any) -> Send:
    """A chat completion with ``extra`` fields."""
    return http("POST", CHAT, json_body=chat(**extra))


def escape(path: str) -> Send:
    """A raw POST to the tool provider on a path sent exactly as written."""
    return raw(raw_post(path, b'{"to": "a@example.com"}'))


def smuggle(headers: list[tuple[str, str]], body: bytes) -> Send:
    """A raw POST with the given framing headers, on a connection the client keeps open."""
    return raw(raw_post(CHAT, body, headers, close=False))


@dataclass(frozen=True, slots=True)
class Case:
    """One input of the corpus and everything it must (and must not) do."""

    name: str
    send: Send
    #: The statuses allowed (None in the set: the proxy may hang up without an answer).
    status: frozenset[int | None]
    #: The error's ``type``; None for a success or a bare connection-level answer.
    error: str | None = None
    #: The request field the error must name (``error.param``), where it names one.
    param: str | None = None
    #: Requests that may reach a provider because of this input: 0 unless it is valid.
    receipts: int = 0
    #: The stage its call must end in (when it gets a call id).
    stage: str | None = None
    #: The proxy must close the connection after (at most) one answer.
    closes: bool = False
    #: A streamed answer must end with an error, never a clean finish.
    stream_breaks: bool = False
    #: Why the row is expected to fail on this base (an xfail), if it is.
    xfail: str | None = None


def case(name: str, send: Send, *status: int | None, **more: Any) -> Case:
    """A :class:`Case` with its allowed statuses given positionally."""
    return Case(name, send, frozenset(status), **more)


FRAMED = encoded(chat("framed"))
HUGE = 20000000000000000

CASES = [
    # -- integers no counter can hold, or no integer at all (finding 1) --
    case(
        "max-tokens-1e17",
        post_chat(max_tokens=1e17),
        400,
        error="invalid_request",
        param="max_tokens",
    ),
    case(
        "max-tokens-2e16",
        post_chat(max_tokens=HUGE),
        400,
        error="invalid_request",
        param="max_tokens",
    ),
    case(
        "max-tokens-float",
        post_chat(max_tokens=8.5),
        400,
        error="invalid_request",
        param="max_tokens",
    ),
    case(
        "max-tokens-negative",
        post_chat(max_tokens=-1),
        400,
        error="invalid_request",
        param="max_tokens",
    ),
    case(
        "max-tokens-string",
        post_chat(max_tokens="8"),
        400,
        error="invalid_request",
        param="max_tokens",
    ),
    case(
        "max-tokens-bool",
        post_chat(max_tokens=True),
        400,
        error="invalid_request",
        param="max_tokens",
    ),
    case(
        "max-completion-2e64",
        post_chat(max_completion_tokens=2**64),
        400,
        error="invalid_request",
        param="max_completion_tokens",
    ),
    case("n-1e17", post_chat(n=1e17), 400, error="invalid_request", param="n"),
    case("n-2e16", post_chat(n=HUGE), 400, error="invalid_request", param="n"),
    case("n-float", post_chat(n=1.5), 400, error="invalid_request", param="n"),
    case("n-negative", post_chat(n=-2), 400, error="invalid_request", param="n"),
    case("n-string", post_chat(n="2"), 400, error="invalid_request", param="n"),
    case(
        "anthropic-max-tokens-2e16",
        http("POST", MESSAGES, json_body=message(max_tokens=HUGE)),
        400,
        error="invalid_request",
        param="max_tokens",
    ),
    # -- paths that would leave the tool provider's /tenant1 (finding 3) --
    case(
        "path-dot-dot", escape("/send_email/../../admin/delete-all"), 400, error="invalid_request"
    ),
    case(
        "path-dot-dot-deep", escape("/send_email/v1/../../../admin"), 400, error="invalid_request"
    ),
    case("path-pct-2e", escape("/send_email/%2e%2e/%2e%2e/admin"), 400, error="invalid_request"),
    case("path-pct-2E", escape("/send_email/%2E%2E/admin"), 400, error="invalid_request"),
    case("path-pct-2f", escape("/send_email/..%2f..%2fadmin"), 400, error="invalid_request"),
    case("path-pct-5c", escape("/send_email/v1%5csend"), 400, error="invalid_request"),
    case("path-pct-09", escape("/send_email/v1/send%09"), 400, error="invalid_request"),
    case("path-pct-00", escape("/send_email/v1/%00send"), 400, error="invalid_request"),
    case(
        "path-crlf",
        escape("/send_email/v1/send%0d%0aX-Injected:%20y"),
        400,
        error="invalid_request",
    ),
    case("path-backslash", escape("/send_email/..\\..\\admin"), 400, error="invalid_request"),
    case("path-dot", escape("/send_email/./v1/send"), 400, error="invalid_request"),
    case("path-clean", escape(SEND), 200, receipts=1, stage="completed"),
    # -- bodies --
    case("json-900-deep", http("POST", CHAT, content=nested(900)), 400, error="invalid_request"),
    case(
        "json-malformed",
        http("POST", CHAT, content=b'{"model": "gpt-4o-mini", "messa'),
        400,
        error="invalid_request",
    ),
    case(
        "json-not-utf8",
        http("POST", CHAT, content=b'{"model": "\xff\xfe"}'),
        400,
        error="invalid_request",
    ),
    # A repeated key: we would price the last max_tokens, a provider may act on the first.
    case(
        "json-repeated-key",
        http(
            "POST",
            CHAT,
            content=b'{"model": "gpt-4o-mini", "max_tokens": 100000, "max_tokens": 1,'
            b' "messages": [{"role": "user", "content": "hi"}]}',
        ),
        400,
        error="invalid_request",
    ),
    case(
        "json-repeated-nested-key",
        http(
            "POST",
            CHAT,
            content=b'{"model": "gpt-4o-mini", "messages":'
            b' [{"role": "user", "content": "a", "content": "b"}]}',
        ),
        400,
        error="invalid_request",
    ),
    # Not strict JSON (contract.md §12): a lone surrogate escape is no character (it
    # failed with a 500 while the request was hashed), and 1e400 reads as infinity (one
    # hash with 2e400, and a JSON body effectguard rewrites went out as "Infinity").
    case(
        "json-lone-surrogate-tool",
        http("POST", SEND, content=b'{"to": "a@example.com", "subject": "\\ud800"}'),
        400,
        error="invalid_request",
    ),
    case(
        "json-lone-surrogate-chat",
        post_chat(user="\udc00"),
        400,
        error="invalid_request",
    ),
    case(
        "json-number-overflow",
        http("POST", SEND, content=b'{"to": "a@example.com", "n": 1e400}'),
        400,
        error="invalid_request",
    ),
    case("json-nan", post_chat(temperature=float("nan")), 400, error="invalid_request"),
    case(
        "json-surrogate-pair",
        http("POST", SEND, content=b'{"to": "a@example.com", "subject": "\\ud83d\\ude00"}'),
        200,
        receipts=1,
        stage="completed",
    ),
    case("json-empty", http("POST", CHAT, content=b""), 400, error="invalid_request"),
    case("body-array", http("POST", CHAT, json_body=[chat()]), 400, error="invalid_request"),
    case("body-string", http("POST", CHAT, json_body="hello"), 400, error="invalid_request"),
    case("body-null", http("POST", CHAT, content=b"null"), 400, error="invalid_request"),
    case(
        "body-over-limit",
        http("POST", CHAT, json_body=chat("x" * MAX_BODY)),
        413,
        error="request_too_large",
    ),
    case(
        "body-over-limit-chunked",
        chunked(CHAT, encoded(chat("y" * MAX_BODY * 2))),
        413,
        error="request_too_large",
    ),
    case("model-unpriced", post_chat(model="gpt-unpriced-9000"), 400, error="model_not_priced"),
    # -- headers --
    case(
        "header-utf8",
        http("POST", CHAT, json_body=chat(), headers={"x-title": "Café ✓ 東京".encode()}),
        200,
        receipts=1,
        stage="completed",
    ),
    case(
        "header-utf8-raw",
        raw(raw_post(SEND, b'{"to": "a@example.com"}'), extra_header="X-Title: Café ✓".encode()),
        200,
        receipts=1,
        stage="completed",
    ),
    case(
        "key-empty",
        http("POST", CHAT, json_body=chat(), headers={"Idempotency-Key": ""}),
        400,
        error="invalid_request",
    ),
    case(
        "key-too-long",
        http("POST", CHAT, json_body=chat(), headers={"Idempotency-Key": "k" * 256}),
        400,
        error="invalid_request",
    ),
    case(
        "budget-dot-dot",
        http("POST", CHAT, json_body=chat(), headers={"Effectguard-Budget": "../etc"}),
        400,
        error="invalid_budget",
    ),
    case(
        "budget-empty",
        http("POST", CHAT, json_body=chat(), headers={"Effectguard-Budget": ""}),
        400,
        error="invalid_budget",
    ),
    case(
        "budget-double-slash",
        http("POST", CHAT, json_body=chat(), headers={"Effectguard-Budget": "a//b"}),
        400,
        error="invalid_budget",
    ),
    case(
        "call-id-forged-tool",
        http(
            "POST",
            SEND,
            json_body={"to": "a@example.com"},
            headers={"Effectguard-Call-Id": "client-forged", "Effectguard-Replayed": "true"},
        ),
        200,
        receipts=1,
        stage="completed",
    ),
    case(
        "call-id-forged-chat",
        http("POST", CHAT, json_body=chat(), headers={"Effectguard-Call-Id": "client-forged"}),
        200,
        receipts=1,
        stage="completed",
    ),
    # -- routes --
    case(
        "provider-unknown",
        http("POST", "/nosuch/v1/chat/completions", json_body=chat()),
        404,
        error="unknown_provider",
    ),
    case(
        "read-only-upstream-down",
        http("GET", "/anthropic/v1/models"),
        502,
        error="upstream_unreachable",
    ),
    case("read-only-upstream-up", http("GET", "/openai/v1/models"), 200),
    # -- request smuggling and framing: refused, connection closed --
    case(
        "smuggle-cl-te",
        smuggle(
            [("Content-Length", "5"), ("Transfer-Encoding", "chunked")],
            b"%x\r\n" % len(FRAMED) + FRAMED + b"\r\n0\r\n\r\n",
        ),
        400,
        closes=True,
    ),
    case(
        "smuggle-two-cl-same",
        smuggle([("Content-Length", str(len(FRAMED)))] * 2, FRAMED),
        400,
        closes=True,
    ),
    case(
        "smuggle-two-cl-differ",
        smuggle([("Content-Length", str(len(FRAMED))), ("Content-Length", "5")], FRAMED),
        400,
        closes=True,
    ),
    case(
        "content-length-not-a-number",
        smuggle([("Content-Length", "12abc")], FRAMED),
        400,
        closes=True,
    ),
    # -- the front door (finding 8) --
    case("slowloris", slowloris(CHAT, pause_s=0.3), 408, None, closes=True),
    case("header-30mb", huge_header(CHAT, megabytes=30), 431, None, closes=True),
    case("body-unfinished", unfinished_body(CHAT), 400, 408, None, closes=True),
    # -- a misbehaving upstream, chosen per request by x-fake-behaviour --
    case(
        "upstream-drop",
        http("POST", CHAT, json_body=chat(), headers={"x-fake-behaviour": "drop"}),
        502,
        error="effect_unknown",
        receipts=1,
        stage="effect_unknown",
    ),
    case(
        "stream-reset",
        stream(CHAT, chat(stream=True), {"x-fake-behaviour": "reset=2"}),
        200,
        receipts=1,
        stage="effect_unknown",
        stream_breaks=True,
    ),
    case(
        "stream-cut-clean",
        stream(CHAT, chat(stream=True), {"x-fake-behaviour": "cut=2"}),
        200,
        receipts=1,
        stage="effect_unknown",
        stream_breaks=True,
    ),
    case(
        "stream-cut-clean-at-once",
        stream(CHAT, chat(stream=True), {"x-fake-behaviour": "cut=0"}),
        200,
        receipts=1,
        stage="effect_unknown",
        stream_breaks=True,
    ),
    case(
        "keyed-resend-after-500",
        resend(CHAT, chat("after 500"), "corpus-500", "status=500"),
        409,
        error="effect_unknown",
        receipts=1,
        stage="effect_unknown",
    ),
    case(
        "keyed-resend-after-503",
        resend(CHAT, chat("after 503"), "corpus-503", "status=503;id=corpus-503;times=1"),
        200,
        receipts=2,
        stage="completed",
    ),
]


# -- the environment ------------------------------------------------------------------------


@dataclass
class Env:
    """The proxy, its upstreams, the good calls beside the corpus, and what the corpus saw."""

    proxy: Proxy
    provider: FakeProvider
    seen: list[Seen]
    good: GoodStream
    #: The call ids every row was told about, passed or not.
    told: set[str | None] = field(default_factory=set)
    #: Each row that passed: the receipts it was allowed (re-counted at the end).
    passed: dict[str, int] = field(default_factory=dict)

    def arrived(self, tag: str) -> int:
        """Requests carrying ``tag`` that reached the fake provider or the recorder."""
        at_fake = sum(1 for r in self.provider.receipts() if r["tag"] == tag)
        at_recorder = sum(1 for s in self.seen if (b"x-fake-tag", tag.encode()) in s.headers)
        return at_fake + at_recorder

    def calls(self) -> dict[str, dict[str, Any]]:
        """``effectguard calls --json``, by call id."""
        # Every call: `calls` lists 1,000 by default, and the good traffic alongside the
        # corpus makes more on a slow machine (a CI run failed on a good call left out).
        rows = cli_json("calls", "--ledger", self.proxy.ledger, "--limit", "1000000")
        return {row["call_id"]: row for row in rows}


def cli_json(*args: str) -> Any:
    """Run an ``effectguard`` command with ``--json`` in this process; assert exit 0."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli_main([*args, "--json"])
    assert code == 0, out.getvalue()
    return json.loads(out.getvalue())


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """One proxy with short front-door limits, its upstreams, and the good calls running."""
    tmp = tmp_path_factory.mktemp("corpus")
    config = tmp / "config.toml"
    config.write_text(
        "[server]\nheader_timeout_s = 1\nbody_timeout_s = 2\n"
        f"max_header_bytes = 16384\nmax_body_bytes = {MAX_BODY}\n"
    )
    with (
        fake_provider(tmp / "receipts.jsonl") as provider,
        recording_upstream() as (recorder, seen),
        running_proxy(
            tmp / "ledger.db",
            upstreams={
                "openai": provider.url,
                "send_email": recorder + "/tenant1",
                "anthropic": f"http://127.0.0.1:{free_port()}",  # nobody listens there
            },
            args=["--config", str(config)],
        ) as proxy,
    ):
        good = GoodStream(
            proxy.url,
            CHAT,
            body=lambda key: chat(f"good call {key}"),
            headers={"Effectguard-Budget": "good-stream", "x-fake-tag": "good"},
        )
        good.start()
        try:
            yield Env(proxy, provider, seen, good)
        finally:
            good.stop()


def wait_for_stage(env: Env, call_id: str, stage: str) -> str | None:
    """The call's stage once it is ``stage`` (a broken stream is marked as it ends), or
    whatever it is after a while."""
    deadline = time.monotonic() + PATIENCE_S
    current = None
    while time.monotonic() < deadline:
        current = env.calls().get(call_id, {}).get("stage")
        if current == stage:
            break
        time.sleep(0.1)
    return current


@pytest.mark.parametrize(
    "row",
    [
        pytest.param(c, id=c.name, marks=[pytest.mark.xfail(reason=c.xfail, strict=False)])
        if c.xfail
        else pytest.param(c, id=c.name)
        for c in CASES
    ],
)
def test_input(env: Env, row: Case) -> None:
    """The input gets its status and error type, reaches a provider only if valid, and
    its call (if it has one) ends in the stage the row names."""
    outcome = row.send(env.proxy.url, row.name)
    env.told.add(outcome.call_id)
    assert outcome.status in row.status, outcome
    assert outcome.error_type == row.error, outcome
    if row.param is not None:
        assert outcome.error_param == row.param, outcome
    if row.error is not None and outcome.status is not None and outcome.status < 500:
        assert outcome.should_retry == "false", outcome
    assert not outcome.replayed, outcome
    if row.closes:
        assert outcome.closed, f"the connection stayed open after the answer: {outcome}"
    if row.stream_breaks:
        assert outcome.stream_broke, "the client's stream finished cleanly"
    if outcome.call_id is not None:
        assert outcome.call_id.startswith("call_"), outcome  # never a client's forged id
    assert env.arrived(row.name) == row.receipts
    if row.stage is not None:
        assert outcome.call_id is not None, outcome
        assert wait_for_stage(env, outcome.call_id, row.stage) == row.stage
    env.passed[row.name] = row.receipts


def test_good_calls_were_untouched_and_the_ledger_verifies(env: Env) -> None:
    """While the corpus ran, every good call got 200 and is completed with nothing held;
    no input reached a provider more often than allowed, nothing else was admitted, no
    client ``effectguard-*`` header went upstream, and ``verify`` passes."""
    env.good.stop()
    assert not env.good.errors, env.good.errors[:3]
    answers = env.good.answers
    assert len(answers) >= env.good.threads, "the good calls did not run beside the corpus"
    bad = [(key, r.status_code, r.text[:200]) for key, r in answers if r.status_code != 200]
    assert not bad, bad
    calls = env.calls()
    good_ids = {r.headers["effectguard-call-id"] for _, r in answers}
    assert len(good_ids) == len(answers)
    assert {calls[c]["stage"] for c in good_ids} == {"completed"}
    assert env.arrived("good") == len(answers)
    budgets = {b["path"]: b for b in cli_json("budgets", "--ledger", env.proxy.ledger)}
    assert budgets["good-stream"]["held_usd"] == budgets["good-stream"]["reserved_usd"]
    assert Decimal(budgets["good-stream"]["held_usd"]) == 0
    for name, allowed in env.passed.items():
        assert env.arrived(name) == allowed, name  # a late (smuggled) request shows here
    told = env.told | good_ids
    assert set(calls) <= told, "a call was admitted that no client was told about"
    for request in env.seen:
        crossed = [k for k, _ in request.headers if k.startswith(b"effectguard-")]
        assert not crossed, (request.path, crossed)
    assert cli_main(["verify", "--ledger", env.proxy.ledger]) == 0
