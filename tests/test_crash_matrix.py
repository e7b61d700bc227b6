"""The crash matrix (docs/contract.md §3, §6, §7, §11): real SIGKILLs at every crash point.

For every crash point, for the proxy and for the in-process transport (run in
a child process), and for several timings: a request (with an idempotency key,
then key-less) reaches a process that kills itself at the point; a fresh
process on the same ledger receives the same request again. Effects are
counted only from the fake provider's receipt log, and every case checks:

* the resend is refused as ``effect_unknown``, or replayed where the
  observation was durably committed (key-less: admitted as new work, which
  docs/contract.md §4 allows because a completed call is never matched by a key-less retry);
* the provider saw no request that the rules did not approve, and every
  receipt is covered by an earlier, durable ``attempt.started`` of a call whose
  stored body is the body the provider received;
* after the restart no call is in flight; every call whose effect is unknown
  holds its full reservation; the budget counters add up;
* ``effectguard verify`` exits 0.

The control shows the checks can fail: a naive restart that re-sends the
recorded request around the guard puts a duplicate in the receipt log.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
from observing import ledger_events

from effectguard.ops.cli import main as cli_main
from effectguard.rules.bodyref import REF_ENCODING
from effectguard.rules.bodytext import decode_body
from effectguard.testing import FakeProvider, fake_provider, start_proxy

pytestmark = pytest.mark.slow

CHILD = Path(__file__).parent / "children" / "transport_call.py"
CHAT = "/v1/chat/completions"
MODEL = "gpt-4o-mini"
POINTS = ["after:admit", "after:dispatch", "after:upstream-response", "after:observe", "mid-stream"]
#: The points at which the request had reached the provider before the kill.
DISPATCHED = {"after:dispatch", "after:upstream-response", "after:observe", "mid-stream"}
#: Run index -> the fake provider's answer delay (the "different timing").
DELAYS = [0.0, 0.05, 0.2]
MODES = ["proxy", "transport"]
KILL_TIMEOUT = 15.0


# -- what a client saw ---------------------------------------------------------


@dataclass
class Seen:
    """What the client of one request saw, and how its process ended."""

    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: str = ""
    chunks: list[str] = field(default_factory=list)
    error: str | None = None
    exit_code: int | None = None

    def json(self) -> Any:
        """The body as JSON."""
        return json.loads(self.body)


def request_spec(
    content: str, *, stream: bool, delay: float, headers: dict[str, str]
) -> dict[str, Any]:
    """A chat request (a unique prompt per case) with the fake provider's delay header."""
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
    }
    if stream:
        body["stream"] = True
    return {"path": CHAT, "body": body, "headers": {"x-fake-delay": str(delay), **headers}}


def body_of(spec: dict[str, Any]) -> dict[str, Any]:
    """The httpx keyword for a request spec's body: ``form`` is sent form-encoded (as
    Stripe takes it), ``body`` as JSON."""
    return {"data": spec["form"]} if "form" in spec else {"json": spec["body"]}


def _proxy_send(url: str, spec: dict[str, Any]) -> Seen:
    seen = Seen()
    try:
        with (
            httpx.Client(timeout=30) as client,
            client.stream(
                "POST", url + spec["path"], headers=spec["headers"], **body_of(spec)
            ) as r,
        ):
            seen.status, seen.headers = r.status_code, dict(r.headers)
            for chunk in r.iter_raw():
                seen.chunks.append(chunk.decode("utf-8", "replace"))
            seen.body = "".join(seen.chunks)
    except httpx.HTTPError as exc:
        seen.error = f"{type(exc).__name__}: {exc}"
    return seen


class SlowLink:
    """A TCP relay to the fake provider that trickles answers back, like a slow network.

    The fake provider writes a whole stream at once and the proxy's aiohttp leg
    reads it in one go, so without this a proxy "mid-stream" kill would always
    come after the stream's end was observed. Requests pass through untouched;
    answers come back in small pieces with pauses. (Effects are still counted
    from the fake provider's own receipt log.)
    """

    def __init__(self, target: str, piece: int = 128, pause: float = 0.01) -> None:
        url = httpx.URL(target)
        self._target = (url.host, url.port or 80)
        self._piece, self._pause = piece, pause
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(self._target)
            threading.Thread(target=self._pump, args=(client, upstream, 0), daemon=True).start()
            threading.Thread(
                target=self._pump, args=(upstream, client, self._piece), daemon=True
            ).start()

    def _pump(self, source: socket.socket, sink: socket.socket, piece: int) -> None:
        try:
            while data := source.recv(65536):
                step = piece or len(data)
                for at in range(0, len(data), step):
                    sink.sendall(data[at : at + step])
                    if piece:
                        time.sleep(self._pause)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Stop accepting; open connections end with their peers."""
        self._server.close()


class ProxyMode:
    """Requests through ``effectguard serve`` subprocesses, upstream over a :class:`SlowLink`."""

    name = "proxy"

    def __init__(self, ledger: Path, fake: FakeProvider) -> None:
        self.ledger, self.fake = ledger, fake
        self.link = SlowLink(fake.url)

    def crash(self, point: str, spec: dict[str, Any]) -> Seen:
        """Send through a proxy that kills itself at ``point``; wait for it to die."""
        proxy = start_proxy(
            self.ledger, upstreams={"openai": self.link.url}, env={"EFFECTGUARD_CRASH_AT": point}
        )
        try:
            seen = _proxy_send(proxy.url + "/openai", spec)
            seen.exit_code = proxy.process.wait(KILL_TIMEOUT)
        finally:
            proxy.kill()
        return seen

    def send(self, specs: list[dict[str, Any]]) -> list[Seen]:
        """Send through one fresh proxy on the same ledger (stopped gracefully after)."""
        proxy = start_proxy(self.ledger, upstreams={"openai": self.link.url})
        try:
            seen = [_proxy_send(proxy.url + "/openai", spec) for spec in specs]
        finally:
            code = proxy.stop()
        # uvicorn re-raises the SIGTERM it handled, after the graceful shutdown.
        assert code in (0, -signal.SIGTERM), proxy.log()
        return seen


class TransportMode:
    """Requests through ``AsyncGuardTransport`` in a child process."""

    name = "transport"

    def __init__(self, ledger: Path, fake: FakeProvider) -> None:
        self.ledger, self.fake = ledger, fake

    def _run(self, specs: list[dict[str, Any]], point: str | None) -> list[Seen]:
        env = {k: v for k, v in os.environ.items() if k != "EFFECTGUARD_CRASH_AT"}
        if point is not None:
            env["EFFECTGUARD_CRASH_AT"] = point
        package_root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        args = [
            sys.executable,
            str(CHILD),
            str(self.ledger),
            "openai",
            self.fake.url,
            json.dumps(specs),
        ]
        done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=60)
        seen = [Seen(exit_code=done.returncode) for _ in specs]
        for line in done.stdout.splitlines():
            item = json.loads(line)
            one = seen[item["i"]]
            if "chunk" in item:
                one.chunks.append(item["chunk"])
            elif "error" in item:
                one.error = item["error"]
            else:
                one.status, one.headers, one.body = item["status"], item["headers"], item["body"]
        if point is None:
            assert done.returncode == 0, done.stderr
        return seen

    def crash(self, point: str, spec: dict[str, Any]) -> Seen:
        """Send from a child that kills itself at ``point``."""
        (seen,) = self._run([spec], point)
        return seen

    def send(self, specs: list[dict[str, Any]]) -> list[Seen]:
        """Send from one fresh child on the same ledger."""
        return self._run(specs, None)


# -- what the ledger and the provider say -----------------------------------------


def cli(*args: str) -> tuple[int, str]:
    """Run the ``effectguard`` command in this process; its exit code and stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli_main(list(args))
    return code, out.getvalue()


def cli_json(*args: str) -> Any:
    """Run an ``effectguard`` command with ``--json`` and parse its output."""
    code, out = cli(*args, "--json")
    assert code == 0, out
    return json.loads(out)


def verify_exit(ledger: Path) -> subprocess.CompletedProcess[str]:
    """``effectguard verify --ledger L`` as its own process."""
    return subprocess.run(
        [sys.executable, "-m", "effectguard", "verify", "--ledger", str(ledger)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def sent_sha_by_call(events: list[dict[str, Any]]) -> dict[str, str]:
    """Each call's stored request body (as sent upstream) -> its SHA-256."""
    out = {}
    for e in events:
        if e["kind"] == "call.manifest" and e["data"]["body_encoding"] == REF_ENCODING:
            out[e["call"]] = e["data"]["body"]  # a spooled upload, named by its SHA-256
        elif e["kind"] == "call.manifest":
            body = decode_body(e["data"]["body"], e["data"]["body_encoding"])
            out[e["call"]] = hashlib.sha256(body).hexdigest()
    return out


def effect_problems(ledger: Path, fake: FakeProvider) -> list[str]:
    """Receipts the ledger does not account for (empty: every effect was approved).

    Each receipt must match a call whose stored body is the received body, and
    the n-th receipt of a body needs n ``attempt.started`` events of such calls
    committed before it arrived: no effect without a durable intent.
    """
    events = ledger_events(ledger)
    sha_of = sent_sha_by_call(events)
    started: dict[str, list[float]] = {}
    for e in events:
        if e["kind"] == "attempt.started":
            started.setdefault(sha_of[e["call"]], []).append(e["at"])
    problems = []
    receipts: dict[str, list[float]] = {}
    for receipt in fake.effects():
        receipts.setdefault(receipt["body_sha256"], []).append(receipt["ts"])
    for sha, times in receipts.items():
        starts = sorted(started.get(sha, []))
        for n, ts in enumerate(sorted(times), start=1):
            covered = sum(1 for at in starts if at <= ts)
            if covered < n:
                problems.append(
                    f"receipt {n} of body {sha[:12]} at {ts} has only {covered} earlier "
                    f"attempt.started (of {len(starts)})"
                )
    return problems


def receipts_of(fake: FakeProvider, ledger: Path, call_ids: set[str]) -> int:
    """How many effects the provider received with the body of any of ``call_ids``."""
    sha_of = sent_sha_by_call(ledger_events(ledger))
    shas = {sha_of[c] for c in call_ids}
    return sum(1 for r in fake.effects() if r["body_sha256"] in shas)


def calls_of(ledger: Path, content: str) -> list[dict[str, Any]]:
    """The calls (``effectguard calls --json``) whose stored body holds ``content``."""
    events = ledger_events(ledger)
    ids = {
        e["call"] for e in events if e["kind"] == "call.manifest" and content in e["data"]["body"]
    }
    return [c for c in cli_json("calls", "--ledger", str(ledger)) if c["call_id"] in ids]


def assert_accounted(ledger: Path, fake: FakeProvider) -> None:
    """The end-of-case checks: nothing in flight, unknowns charged, counters add up, verify."""
    assert cli_json("calls", "--ledger", str(ledger), "--state", "in_flight") == []
    calls = cli_json("calls", "--ledger", str(ledger))
    for call in calls:
        if call["stage"] == "effect_unknown":
            # Dispatched (or possibly dispatched) but unobserved: charged in full.
            assert Decimal(call["held_usd"]) == Decimal(call["reserved_usd"]) > 0, call
        elif call["stage"] == "completed":
            assert call["cost_usd"] is not None and Decimal(call["held_usd"]) == 0, call
    (node,) = [n for n in cli_json("budgets", "--ledger", str(ledger)) if n["path"] == "default"]
    assert Decimal(node["reserved_usd"]) == 0
    assert Decimal(node["held_usd"]) == sum(Decimal(c["held_usd"]) for c in calls)
    assert Decimal(node["spent_usd"]) == sum(Decimal(c["cost_usd"] or 0) for c in calls)
    assert effect_problems(ledger, fake) == []
    code, out = cli("verify", "--ledger", str(ledger))
    assert code == 0, out


# -- the matrix ----------------------------------------------------------------------


@pytest.fixture
def mode_for(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A fake provider with its receipt log, and the way in under test on a fresh ledger."""
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        ledger = tmp_path / "ledger.db"
        mode = (ProxyMode if request.param == "proxy" else TransportMode)(ledger, fake)
        yield mode
        if isinstance(mode, ProxyMode):
            mode.link.close()


def _expect_killed(seen: Seen, stage: str) -> None:
    """The killed process never handed its client a clean finish.

    Its client saw the terminal event only if the observation was durable
    first (the guard holds the terminal event back until it is).
    """
    assert seen.exit_code == -signal.SIGKILL, seen
    assert seen.status is None or seen.error is not None, seen
    if any("[DONE]" in chunk for chunk in seen.chunks):
        assert stage == "completed", seen


def _observed_first(point: str, stage: str) -> bool:
    """Whether the first call's observation was committed before the kill.

    Always at ``after:observe``; at ``mid-stream`` only if the first chunk the
    guard read already held the whole stream, so it was observed before being
    forwarded (a slow machine can still coalesce the :class:`SlowLink`'s pieces).
    """
    if point == "after:observe":
        assert stage == "completed"
        return True
    if point == "mid-stream":
        return stage == "completed"
    assert stage == "effect_unknown"
    return False


@pytest.mark.parametrize("run", range(len(DELAYS)), ids=[f"delay{d}" for d in DELAYS])
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("mode_for", MODES, indirect=True)
def test_crash_point_restart_never_duplicates_an_effect(
    mode_for: Any, point: str, run: int
) -> None:
    """A kill at ``point`` and a resend on a fresh process never add an unapproved effect."""
    mode, fake, ledger = mode_for, mode_for.fake, mode_for.ledger
    delay = DELAYS[run]
    stream = point == "mid-stream" or run % 2 == 1
    tag = f"{mode.name}-{point}-{run}-{uuid.uuid4().hex[:8]}"
    keyed = request_spec(
        f"keyed {tag}", stream=stream, delay=delay, headers={"Idempotency-Key": f"key-{tag}"}
    )
    keyless = request_spec(f"keyless {tag}", stream=stream, delay=delay, headers={})
    # The key-less resend declares itself a retry, as the SDKs do.
    keyless_retry = {**keyless, "headers": {**keyless["headers"], "x-stainless-retry-count": "1"}}

    # Two processes die at the point (the second one's start sweeps the first);
    # a third, fresh one receives both requests again.
    first_keyed = mode.crash(point, keyed)
    first_keyless = mode.crash(point, keyless)
    resend_keyed, resend_keyless = mode.send([keyed, keyless_retry])

    (call,) = calls_of(ledger, f"keyed {tag}")
    _expect_killed(first_keyed, call["stage"])
    if _observed_first(point, call["stage"]):
        assert resend_keyed.status == 200, resend_keyed
        assert resend_keyed.headers.get("effectguard-replayed") == "true", resend_keyed
    else:
        assert resend_keyed.status == 409, resend_keyed
        assert resend_keyed.json()["error"]["type"] == "effect_unknown", resend_keyed
        assert resend_keyed.json()["error"]["call_id"] == call["call_id"]
        assert call["attempts"] == 1
    assert receipts_of(fake, ledger, {call["call_id"]}) == (1 if point in DISPATCHED else 0)

    calls = sorted(calls_of(ledger, f"keyless {tag}"), key=lambda c: c["created_at"])
    ids = {c["call_id"] for c in calls}
    _expect_killed(first_keyless, calls[0]["stage"])
    if _observed_first(point, calls[0]["stage"]):
        # The first call completed; a key-less retry only matches unresolved calls
        # (docs/contract.md §4), so the resend is new work: a second call, a second approved effect.
        assert resend_keyless.status == 200, resend_keyless
        assert "effectguard-replayed" not in resend_keyless.headers, resend_keyless
        assert [c["stage"] for c in calls] == ["completed", "completed"]
        assert receipts_of(fake, ledger, ids) == 2
    else:
        assert resend_keyless.status == 409, resend_keyless
        assert resend_keyless.json()["error"]["type"] == "effect_unknown", resend_keyless
        assert len(calls) == 1
        assert receipts_of(fake, ledger, ids) == (1 if point in DISPATCHED else 0)

    assert_accounted(ledger, fake)

    # The control: a naive restart re-sends the recorded request around the guard.
    if point in DISPATCHED:
        events = ledger_events(ledger)
        manifest = next(
            e for e in events if e["kind"] == "call.manifest" and e["call"] == call["call_id"]
        )
        body = decode_body(manifest["data"]["body"], manifest["data"]["body_encoding"])
        httpx.post(
            fake.url + CHAT, content=body, headers={"content-type": "application/json"}, timeout=30
        )
        assert receipts_of(fake, ledger, {call["call_id"]}) == 2
        problems = effect_problems(ledger, fake)
        assert len(problems) == 1 and "only 1 earlier attempt.started" in problems[0], problems


@pytest.mark.parametrize("applied", [True, False], ids=["applied", "not-applied"])
def test_crash_after_reconcile_keeps_the_decision(
    tmp_path: Path, applied: bool, request: pytest.FixtureRequest
) -> None:
    """A reconcile killed right after it commits is durable; the resend follows the decision."""
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        ledger = tmp_path / "ledger.db"
        mode = ProxyMode(ledger, fake)
        request.addfinalizer(mode.link.close)
        spec = request_spec(
            "reconcile me", stream=False, delay=0.0, headers={"Idempotency-Key": "rk"}
        )
        mode.crash("after:dispatch", spec)
        assert mode.send([spec])[0].status == 409
        (call,) = calls_of(ledger, "reconcile me")
        decision = ["--applied"] if applied else ["--not-applied"]
        env = {**os.environ, "EFFECTGUARD_CRASH_AT": "after:reconcile"}
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "effectguard",
                "reconcile",
                call["call_id"],
                *decision,
                "--note",
                "checked the provider dashboard",
                "--by",
                "ops",
                "--ledger",
                str(ledger),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert done.returncode == -signal.SIGKILL, done.stderr
        (call,) = calls_of(ledger, "reconcile me")
        (resend,) = mode.send([spec])
        if applied:
            assert call["stage"] == "reconciled_applied"
            assert resend.status == 409 and resend.json()["error"]["type"] == "reconciled_applied"
            assert len(fake.effects()) == 1
        else:
            # The operator's "not applied" approves exactly one more send.
            assert call["stage"] == "reconciled_not_applied"
            assert resend.status == 200, resend
            assert len(fake.effects()) == 2
            (call,) = calls_of(ledger, "reconcile me")
            assert call["stage"] == "completed" and call["attempts"] == 2
        assert_accounted(ledger, fake)
        done = verify_exit(ledger)  # once as its own process: the exit code a script sees
        assert done.returncode == 0 and done.stdout.startswith("ok:"), done.stdout + done.stderr
