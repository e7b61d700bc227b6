"""The crash matrix against three kinds of tool (docs/contract.md §2.2, §4.1): real SIGKILLs
at every non-streaming crash point, through the proxy and through the transport, against the
fakes of the bundled ``stripe`` (idempotent), ``postmark`` (no dedup, a lagging metadata
search) and ``github`` (neither) declarations (tests/fakes).

For each tool and way in, one request per crash point reaches a process that kills itself
there; one fresh process then receives every request again (and, for the searchable tool,
again once the calls are older than the declared freshness). Judged only from the fakes'
own receipts and the ledger:

* no call has more effects than the rules approved (no ``--resend`` is authorized here, so
  at most one), and each effect is covered by an earlier durable ``attempt.started``;
* the idempotent tool ends with exactly one effect per call (its dedup absorbs resends);
  the searchable one too, once the lookup could decide (applied: recovered; not applied:
  sent once); the tool with neither keeps each unobserved call ``effect_unknown``;
* nothing is left in flight; every unresolved call holds its full reservation; verify is ok.

Bounded: the streaming point (``mid-stream``) does not apply to these non-streaming tools,
and one timing per point is run (the fake answers at once), not the chat matrix's three.
The test declarations extend the bundled ones in two ways, each said where it is written;
Stripe's is tested as it ships (form bodies, the operation id in ``metadata[effectguard_op]``).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
from corpuskit import error_field
from fakes import RunningFake, running_fake
from test_crash_matrix import KILL_TIMEOUT, Seen, _proxy_send, cli_json, ledger_events

from effectguard.ops.cli import main as cli_main
from effectguard.rules.bodytext import decode_body
from effectguard.testing import start_proxy

pytestmark = pytest.mark.slow

CHILD = Path(__file__).parent / "children" / "transport_call.py"
POINTS = ["after:admit", "after:dispatch", "after:upstream-response", "after:observe"]
#: The search lag of the searchable fake, and the freshness the test declares for it.
LAG_S, FRESH_S = 0.3, 1.0

#: Test-only declarations over the bundled ones (extends: merged endpoint by endpoint).
#: Stripe needs none: its requests are form-encoded, as Stripe takes them, and the
#: bundled declaration is tested as it ships.
OVERRIDES = {
    # Postmark's declared freshness (two hours) would make the test wait that long.
    "postmark": f"""
extends = "postmark"
[[endpoints]]
path = "/email"
effect = "at_most_once"
op_id = {{ json = "Metadata.effectguard_op" }}
[endpoints.lookup]
url = "{{base_url}}/messages/outbound"
query = {{ count = "1", offset = "0", metadata_effectguard_op = "{{op}}" }}
applied = "Messages[0]"
results = "Messages"
not_found = [200]
freshness_s = {FRESH_S}
""",
    # GitHub comments are free; a nominal price makes a held (unresolved) call visible.
    "github": """
extends = "github"
[models.default]
per_call = "0.001"
""",
}


@dataclass(frozen=True)
class Tool:
    """One kind of tool: its provider, fake, request and credentials."""

    provider: str
    fake: str
    path: str
    env: dict[str, str]
    headers: dict[str, str]

    def spec(self, tag: str) -> dict[str, Any]:
        """A request unique to ``tag`` (keyed: the resend is the client's retry)."""
        headers = {**self.headers, "Idempotency-Key": f"key-{tag}"}
        if self.provider == "stripe":
            form = {"amount": "500", "currency": "usd", "description": tag}
            return {"path": self.path, "form": form, "headers": headers}
        bodies: dict[str, dict[str, Any]] = {
            "postmark": {
                "From": "a@example.com",
                "To": "b@example.com",
                "Subject": tag,
                "TextBody": "hi",
                "Metadata": {},
            },
            "github": {"body": tag},
        }
        return {"path": self.path, "body": bodies[self.provider], "headers": headers}


TOOLS = {
    "idempotent": Tool("stripe", "stripe_like", "/v1/payment_intents",
                       {"STRIPE_API_KEY": "sk_test_x"}, {"Authorization": "Bearer sk_test_x"}),
    "searchable": Tool("postmark", "email_like", "/email", {"POSTMARK_SERVER_TOKEN": "pm"},
                       {"X-Postmark-Server-Token": "pm"}),
    "neither": Tool("github", "chat_like", "/repos/o/r/issues/1/comments",
                    {"GITHUB_TOKEN": "gh"}, {"Authorization": "Bearer gh"}),
}  # fmt: skip


class Way:
    """The proxy or the transport (in a child), on one ledger, with the test declarations."""

    def __init__(self, name: str, tool: Tool, fake: RunningFake, tmp: Path) -> None:
        self.name, self.tool, self.fake, self.ledger = name, tool, fake, tmp / "ledger.db"
        self.providers = tmp / "providers"
        self.providers.mkdir()
        if tool.provider in OVERRIDES:
            (self.providers / f"{tool.provider}.toml").write_text(OVERRIDES[tool.provider])

    def run(self, specs: list[dict[str, Any]], point: str | None) -> list[Seen]:
        """Send ``specs`` through one fresh process (killed at ``point``, if given)."""
        env = {**self.tool.env, **({"EFFECTGUARD_CRASH_AT": point} if point else {})}
        if self.name == "proxy":
            return self._proxy(specs, env, point)
        return self._child(specs, env, point)

    def _proxy(
        self, specs: list[dict[str, Any]], env: dict[str, str], point: str | None
    ) -> list[Seen]:
        proxy = start_proxy(self.ledger, upstreams={self.tool.provider: self.fake.url},
                            args=("--providers", str(self.providers)), env=env)  # fmt: skip
        try:
            seen = [_proxy_send(f"{proxy.url}/{self.tool.provider}", s) for s in specs]
            if point:
                seen[0].exit_code = proxy.process.wait(KILL_TIMEOUT)
        finally:
            proxy.kill() if point else proxy.stop()
        return seen

    def _child(
        self, specs: list[dict[str, Any]], env: dict[str, str], point: str | None
    ) -> list[Seen]:
        full = {k: v for k, v in os.environ.items() if k != "EFFECTGUARD_CRASH_AT"} | env
        root = str(Path(__file__).resolve().parent.parent)
        full["PYTHONPATH"] = os.pathsep.join(filter(None, [root, full.get("PYTHONPATH")]))
        args = [sys.executable, str(CHILD), str(self.ledger), self.tool.provider,
                self.fake.url, json.dumps(specs), str(self.providers)]  # fmt: skip
        done = subprocess.run(args, capture_output=True, text=True, env=full, timeout=60)
        seen = [Seen(exit_code=done.returncode) for _ in specs]
        for line in done.stdout.splitlines():
            item = json.loads(line)
            if "status" in item:
                one = seen[item["i"]]
                one.status, one.headers, one.body = item["status"], item["headers"], item["body"]
        assert point or done.returncode == 0, done.stderr
        return seen


# -- judging from the receipts --------------------------------------------------------


def effects_by_call(ledger: Path, fake: RunningFake) -> dict[str, list[float]]:
    """Each call's effects (receipt times), from the fake's own receipts: by the operation
    id the request carried, or (a tool that keeps none) by the body the call sent."""
    events = ledger_events(ledger)
    by_body = {}
    for e in events:
        if e["kind"] == "call.manifest":
            body = decode_body(e["data"]["body"], e["data"]["body_encoding"])
            by_body[hashlib.sha256(body).hexdigest()] = e["call"]
    out: dict[str, list[float]] = {}
    for receipt in fake.effects():
        call = receipt["op"] or by_body.get(receipt["body_sha256"], "unmatched")
        out.setdefault(call, []).append(receipt["ts"])
    return out


def assert_no_unapproved_effect(ledger: Path, fake: RunningFake) -> None:
    """At most one effect per call, each after a durable ``attempt.started`` of its call."""
    events = ledger_events(ledger)
    for call, times in effects_by_call(ledger, fake).items():
        assert call != "unmatched", "an effect no call accounts for"
        assert len(times) <= 1, f"{call}: {len(times)} effects, none authorized beyond one"
        starts = [e["at"] for e in events if e["kind"] == "attempt.started" and e["call"] == call]
        assert any(at <= times[0] for at in starts), f"{call}: an effect before its intent"


def assert_accounted(ledger: Path) -> None:
    """Nothing in flight; every unresolved call charged in full; counters add up; verify."""
    assert cli_json("calls", "--ledger", str(ledger), "--state", "in_flight") == []
    calls = cli_json("calls", "--ledger", str(ledger))
    for call in calls:
        if call["stage"] == "effect_unknown":
            assert Decimal(call["held_usd"]) == Decimal(call["reserved_usd"]) > 0, call
        else:
            assert Decimal(call["held_usd"]) == 0, call
    (node,) = [n for n in cli_json("budgets", "--ledger", str(ledger)) if n["path"] == "default"]
    assert Decimal(node["reserved_usd"]) == 0
    assert Decimal(node["held_usd"]) == sum(Decimal(c["held_usd"]) for c in calls)
    assert cli_main(["verify", "--ledger", str(ledger)]) == 0


def error_type(seen: Seen) -> str | None:
    """The effectguard error type of a 409, if any."""
    return error_field(json.loads(seen.body), "type") if seen.status == 409 else None


#: The searchable tool's crash points at which the email was sent before the kill.
SENT_BEFORE_KILL = ("after:dispatch", "after:upstream-response")


def assert_searchable_resent(point: str, seen: Seen) -> None:
    """The first resend of a searchable call, whenever it comes: what it may be told.

    Observed before the kill: replayed. Sent but unobserved: recovered by the lookup, or
    409 while the call is younger than the freshness (the search may not show it yet).
    Never sent: resent once it is older than the freshness, 409 before. (Which of the
    two depends on how long the restart took, so both are allowed; never anything else.)
    """
    if point == "after:observe":
        assert seen.status == 200, (point, seen)
        assert seen.headers.get("effectguard-replayed") == "true", (point, seen)
    elif error_type(seen) != "effect_unknown":
        assert seen.status == 200, (point, seen)
        recovered = seen.headers.get("effectguard-recovered")
        assert recovered == ("lookup:postmark" if point in SENT_BEFORE_KILL else None), (
            point,
            seen,
        )


def assert_searchable_decided(point: str, seen: Seen) -> None:
    """A resend once every call is older than the freshness: each is answered 200, an email
    sent before the kill with the message the search found (recovered, kept and replayed),
    one never sent by its one new attempt (or its replay)."""
    assert seen.status == 200, (point, seen)
    recovered = seen.headers.get("effectguard-recovered")
    if point in SENT_BEFORE_KILL:
        assert recovered == "lookup:postmark", (point, seen)
        assert seen.json()["Metadata"]["effectguard_op"] == seen.headers["effectguard-call-id"]
    else:
        assert recovered is None, (point, seen)


# -- the matrix -------------------------------------------------------------------------


@pytest.fixture(params=["proxy", "transport"])
def way_in(request: pytest.FixtureRequest) -> str:
    """Through the proxy, or through the in-process transport."""
    return str(request.param)


@pytest.mark.parametrize("kind", list(TOOLS))
def test_every_crash_point_against_each_kind_of_tool(
    tmp_path: Path, way_in: str, kind: str
) -> None:
    """Killed at each point and resent on a fresh process, no tool sees an unapproved effect,
    nothing stays in flight, and every unresolved call is charged."""
    tool = TOOLS[kind]
    with running_fake(tool.fake, tmp_path / "receipts.jsonl", lag_s=LAG_S) as fake:
        way = Way(way_in, tool, fake, tmp_path)
        tags = {p: f"{kind}-{way_in}-{p}-{uuid.uuid4().hex[:8]}" for p in POINTS}
        for point in POINTS:
            (seen,) = way.run([tool.spec(tags[point])], point)
            assert seen.exit_code == -signal.SIGKILL, seen
        resent = dict(zip(POINTS, way.run([tool.spec(tags[p]) for p in POINTS], None), strict=True))
        assert_no_unapproved_effect(way.ledger, fake)

        if kind == "searchable":
            # Once older than the declared freshness, the lookup decides each unknown call.
            time.sleep(FRESH_S + LAG_S)
            decided = way.run([tool.spec(tags[p]) for p in POINTS], None)
            for point, seen in zip(POINTS, decided, strict=True):
                assert_searchable_decided(point, seen)
        for point, seen in resent.items():
            if kind == "idempotent":
                # Resent inside the window with the same provider key: the fake's dedup
                # absorbs it, and the call ends with exactly one charge.
                assert seen.status == 200, (point, seen)
            elif kind == "searchable":
                assert_searchable_resent(point, seen)
            elif point == "after:observe":
                # Observed before the kill: the resend is answered from the ledger.
                assert seen.status == 201, (point, seen)
                assert seen.headers.get("effectguard-replayed") == "true", (point, seen)
            else:
                assert error_type(seen) == "effect_unknown", (point, seen)
        calls = {c["call_id"]: c for c in cli_json("calls", "--ledger", str(way.ledger))}
        effects = effects_by_call(way.ledger, fake)
        if kind in ("idempotent", "searchable"):
            for call in calls.values():
                assert len(effects.get(call["call_id"], [])) == 1, call
                assert call["stage"] in ("completed", "reconciled_applied"), call
        assert len(calls) == len(POINTS)
        assert_no_unapproved_effect(way.ledger, fake)
        assert_accounted(way.ledger)
        if kind == "neither":
            # The control: a naive restart re-sending around the guard is caught.
            spec = tool.spec(tags["after:dispatch"])
            httpx.post(fake.url + spec["path"], json=spec["body"],
                                     headers=spec["headers"], timeout=30)  # fmt: skip
            with pytest.raises(AssertionError, match="none authorized beyond one"):
                assert_no_unapproved_effect(way.ledger, fake)
