"""A fenced worker's late answer is kept as evidence and can decide the call
(docs/contract.md §6.1, §7, §8).

* In process: a worker is taken over while its call is on the wire; when the provider's
  answer arrives, the store refuses it as the outcome (502 ``observe_refused``) but keeps
  it as ``attempt.late_answer``, written by a fresh registration of the same process. The
  call stays ``effect_unknown``; ``show`` displays the evidence; ``reconcile
  --accept-evidence`` decides it as the provider's declaration reads the status.
* With real processes: two proxies on one ledger, the one holding a call SIGSTOPped past
  its lease; after SIGCONT its late answer is kept, and the CLI accepts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import html
import io
import shlex
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from fencekit import (
    CHAT,
    UPSTREAM,
    Upstream,
    answer_body,
    chat,
    make_runtime,
    stopped_while_held,
    stream_body,
    taken_over_mid_call,
)
from observing import cli_json, ledger_events, wait_for
from pgkit import ledger_url

from effectguard.callpath.guard import Guard
from effectguard.callpath.hooks import Applied, NotApplied, ReconcileQuestion
from effectguard.callpath.runtime import Runtime, RuntimeConfig
from effectguard.errors import Refusal
from effectguard.ingress.admin.callpage import call_page
from effectguard.ledger import Writer, shown_ledger
from effectguard.ops.cli import main as cli_main
from effectguard.ops.verify import verify_ledger
from effectguard.providers import load_providers
from effectguard.testing import fake_provider

_ = (ledger_url,)  # fixtures


@dataclass
class Fenced:
    """A call whose worker was taken over while the provider held it."""

    runtime: Runtime
    guard: Guard
    ledger_url: str
    upstream: Upstream
    task: asyncio.Future[httpx.Response]
    call_id: str
    old: tuple[str, int]


@pytest_asyncio.fixture
async def fenced_call(request: pytest.FixtureRequest, ledger_url: str) -> AsyncIterator[Fenced]:
    """A worker's call on the wire, its worker fenced and the call marked effect_unknown
    by a peer's sweep. The heartbeat never runs: the fenced worker has not noticed."""
    runtime = make_runtime(ledger_url, lease_s=60, heartbeat_s=3600, sweep_s=3600)
    guard = await runtime.start()
    streamed = request.param == "stream"
    upstream = Upstream(200 if streamed else request.param, stream=streamed, hold=True)
    body = chat("held")
    if streamed:
        body.update(stream=True, stream_options={"include_usage": True})
    req = httpx.Request("POST", UPSTREAM + CHAT, json=body, headers={"Idempotency-Key": "k"})
    try:
        async with taken_over_mid_call(runtime, guard, req, upstream, interrupt_calls=True) as (
            task,
            old,
        ):
            (call,) = await runtime.ledger.calls()
            assert call.stage == "effect_unknown"
            yield Fenced(
                runtime,
                guard,
                ledger_url,
                upstream,
                task,
                call.call_id,
                (old.worker, old.generation),
            )
    finally:
        await runtime.stop()


async def late_refusal(fenced: Fenced) -> Refusal:
    """Release the held answer; the client's refusal."""
    fenced.upstream.release.set()
    with pytest.raises(Refusal) as refused:
        await fenced.task
    return refused.value


async def acli(*args: str) -> tuple[int, str]:
    """:func:`cli` from a test's event loop (the CLI runs its own)."""
    return await asyncio.to_thread(cli, *args)


async def ajson(*args: str) -> Any:
    """:func:`observing.cli_json` from a test's event loop."""
    return await asyncio.to_thread(cli_json, *args)


def cli(*args: str) -> tuple[int, str]:
    """Run an ``effectguard`` command in this process: its exit code and stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = cli_main(list(args))
    return code, out.getvalue()


@pytest.mark.parametrize("fenced_call", [200], indirect=True)
async def test_late_answer_is_kept_without_changing_the_stage(fenced_call: Fenced) -> None:
    """The fenced worker's late 200 is refused as the outcome but kept as evidence, written
    by a fresh registration of the same process; stage and money stay as they were."""
    ledger = fenced_call.runtime.ledger
    before = await ledger.call(fenced_call.call_id)
    refusal = await late_refusal(fenced_call)
    assert refusal.status == 502 and refusal.type == "observe_refused"
    assert "kept as evidence" in refusal.message
    # The refusal (and so the access line) names the stage the takeover left, as `show` does.
    assert (refusal.stage, refusal.next_operation) == ("effect_unknown", "reconcile")

    events = await ledger.events(fenced_call.call_id)
    late = events[-1]
    assert late.kind == "attempt.late_answer"
    body = answer_body(200)
    assert late.data["status"] == 200 and late.data["effect"] == "applied"
    assert late.data["body_digest"] == "sha256:" + hashlib.sha256(body).hexdigest()
    assert late.data["body_bytes"] == len(body)
    assert late.data["usage"]["input_tokens"] == 3 and late.data["usage"]["output_tokens"] == 2
    assert (late.data["observed_by"], late.data["generation"]) == fenced_call.old
    # Written by the registration that replaced the fenced one, not by the fenced one.
    new = fenced_call.guard.writer
    assert (late.worker, late.generation) == (new.worker, new.generation)
    assert new.generation > fenced_call.old[1]
    assert "attempt.observed" not in [e.kind for e in events]

    after = await ledger.call(fenced_call.call_id)
    assert after == before and after.stage == "effect_unknown"
    assert (await verify_ledger(ledger)).ok


@pytest.mark.parametrize("fenced_call", [200], indirect=True)
async def test_show_displays_and_reconcile_accepts_the_late_answer(fenced_call: Fenced) -> None:
    """``show`` lists the evidence and offers --accept-evidence; accepting a 2xx answer
    reconciles the call applied at the cost its usage implies, below the hold."""
    await late_refusal(fenced_call)
    await fenced_call.runtime.stop()
    ledger, call_id = fenced_call.ledger_url, fenced_call.call_id

    shown = await ajson("show", call_id, "--ledger", ledger)
    (late,) = shown["evidence"]
    assert late["status"] == 200 and late["effect"] == "applied"
    assert shown["stage"] == "effect_unknown"
    accept = f"effectguard reconcile {call_id} --ledger {shlex.quote(shown_ledger(ledger))} "
    assert shown["next_command"].startswith(accept + "--accept-evidence")
    (attempt,) = shown["attempts_detail"]
    assert attempt["ended"].startswith("interrupted by")
    code, text = await acli("show", call_id, "--ledger", ledger)
    assert code == 0
    assert "evidence (kept, not the outcome)" in text
    assert "late answer to attempt 1: status 200 (effect applied)" in text
    assert "--accept-evidence" in text

    # The command offered carries --attempt like the others, and runs as printed.
    offered = shown["next_command"].split(" | ")[0]
    assert offered.endswith("--accept-evidence [--note TEXT] --attempt 1"), offered
    assert offered in text
    run = shlex.split(offered.replace("[--note TEXT]", "--note seen"))
    assert run[:2] == ["effectguard", "reconcile"]
    decided = await ajson(*run[1:], "--by", "ops")
    assert decided["stage"] == "reconciled_applied"
    implied = Decimal(late["cost"]) / 10**9
    assert Decimal(decided["cost_usd"]) == implied
    assert 0 < implied < Decimal(shown["held_usd"])
    assert Decimal(decided["held_usd"]) == 0
    events = (await ajson("show", call_id, "--ledger", ledger))["events"]
    (reconciled,) = [e["data"] for e in events if e["kind"] == "call.reconciled"]
    assert reconciled["by"] == "ops" and reconciled["applied"] is True
    assert late["body_digest"] in reconciled["note"] and reconciled["note"].endswith("; seen")
    assert (await acli("verify", "--ledger", ledger))[0] == 0


@pytest.mark.parametrize("fenced_call", [200], indirect=True)
async def test_evidence_is_never_written_as_the_fenced_registration(fenced_call: Fenced) -> None:
    """Where no registration but the fenced one is at hand (a guard without its worker
    runtime), the store refuses the evidence too: the client still gets its 502 saying
    so, and nothing is written as the fenced registration."""

    async def only_the_fenced_one(writer: Writer) -> Writer:
        return writer

    fenced_call.guard.recorder.evidence_writer = only_the_fenced_one
    refusal = await late_refusal(fenced_call)
    assert refusal.status == 502 and refusal.type == "observe_refused"
    assert "could not be kept as evidence either" in refusal.message
    ledger = fenced_call.runtime.ledger
    events = await ledger.events(fenced_call.call_id)
    assert "attempt.late_answer" not in [e.kind for e in events]
    assert (await ledger.call(fenced_call.call_id)).stage == "effect_unknown"
    assert (await verify_ledger(ledger)).ok


@pytest.mark.parametrize("fenced_call", ["stream"], indirect=True)
async def test_a_streamed_late_answer_is_kept(fenced_call: Fenced) -> None:
    """A stream whose end arrives after the fence: the client's stream ends in an error,
    never a clean finish, and the whole stream is kept as evidence with its usage."""
    fenced_call.upstream.release.set()
    response = await fenced_call.task
    with pytest.raises(httpx.RemoteProtocolError, match="kept as evidence"):
        await response.aread()
    ledger = fenced_call.runtime.ledger
    late = (await ledger.events(fenced_call.call_id))[-1]
    assert late.kind == "attempt.late_answer"
    assert late.data["status"] == 200 and late.data["body_bytes"] == len(stream_body())
    assert late.data["usage"]["output_tokens"] == 2 and late.data["usage_problem"] is None
    assert (await ledger.call(fenced_call.call_id)).stage == "effect_unknown"
    assert (await verify_ledger(ledger)).ok


@pytest.mark.parametrize("fenced_call", [400], indirect=True)
async def test_an_unprocessed_late_answer_reconciles_not_applied(fenced_call: Fenced) -> None:
    """A late status the provider declares not processed (400) is accepted as not applied:
    the hold is given back."""
    await late_refusal(fenced_call)
    ledger = fenced_call.runtime.ledger
    state = await ledger.accept_evidence(fenced_call.call_id, note=None, by="ops")
    assert state.stage == "reconciled_not_applied"
    assert state.held == 0 and not state.cost
    assert (await verify_ledger(ledger)).ok


@pytest.mark.parametrize("fenced_call", [200], indirect=True)
async def test_a_late_200_after_a_not_applied_decision_is_never_resent(
    fenced_call: Fenced,
) -> None:
    """A call decided not applied before its late 200 arrives: the 502 says
    next_operation ``none`` (not the stage's ``resend``) with show's advice, and a keyed
    resend is refused 409 ``late_answer_applied``, nothing sent (in every store)."""
    ledger, call_id = fenced_call.runtime.ledger, fenced_call.call_id
    await ledger.reconcile(call_id, applied=False, note="none seen", by="ops")
    refusal = await late_refusal(fenced_call)
    assert (refusal.status, refusal.type) == (502, "observe_refused")
    assert (refusal.stage, refusal.next_operation) == ("reconciled_not_applied", "none")
    advice = "do not resend: a late answer kept for attempt 1 (status 200)"
    assert advice in refusal.message
    guard, upstream = fenced_call.guard, fenced_call.upstream
    sent = upstream.sent
    resend = httpx.Request(
        "POST", UPSTREAM + CHAT, json=chat("held"), headers={"Idempotency-Key": "k"}
    )
    with pytest.raises(Refusal) as refused:
        await guard.handle(guard.providers["openai"], resend, upstream.send)
    assert (refused.value.status, refused.value.type) == (409, "late_answer_applied")
    assert (refused.value.call_id, refused.value.next_operation) == (call_id, "none")
    assert advice in refused.value.message
    assert upstream.sent == sent
    state = await ledger.call(call_id)
    assert (state.stage, state.attempts) == ("reconciled_not_applied", 1)
    assert (await verify_ledger(ledger)).ok


@pytest.mark.parametrize("fenced_call", [200], indirect=True)
async def test_a_late_200_for_an_earlier_attempt_contradicts_the_last_decision(
    fenced_call: Fenced,
) -> None:
    """Attempt 1 decided not applied, resent as attempt 2 (effect unknown: a 500), that
    decided not applied too; then attempt 1's late 200 arrives. The provider applied the
    call, whichever attempt the decision was about: the 502 says next_operation ``none``
    with show's advice, show says do not resend, and a keyed resend is refused 409
    ``late_answer_applied``, nothing sent. (It warned nowhere: only a late answer for the
    call's last attempt was read.)"""
    ledger, call_id = fenced_call.runtime.ledger, fenced_call.call_id
    await ledger.reconcile(call_id, applied=False, note="none seen", by="ops")
    other = make_runtime(fenced_call.ledger_url, lease_s=60, heartbeat_s=3600, sweep_s=3600)
    guard = await other.start()
    try:
        upstream = Upstream(500)
        resend = httpx.Request(
            "POST", UPSTREAM + CHAT, json=chat("held"), headers={"Idempotency-Key": "k"}
        )
        with contextlib.suppress(Refusal):
            await guard.handle(guard.providers["openai"], resend, upstream.send)
        state = await ledger.call(call_id)
        assert (state.stage, state.attempts, upstream.sent) == ("effect_unknown", 2, 1)
        await ledger.reconcile(call_id, applied=False, note="none seen again", by="ops")
        refusal = await late_refusal(fenced_call)
        assert (refusal.status, refusal.type) == (502, "observe_refused")
        assert (refusal.stage, refusal.next_operation) == ("reconciled_not_applied", "none")
        advice = "do not resend: a late answer kept for attempt 1 (status 200)"
        assert advice in refusal.message
        shown = await ajson("show", call_id, "--ledger", fenced_call.ledger_url)
        assert shown["next_command"].startswith(advice), shown["next_command"]
        state, events = await ledger.call(call_id), await ledger.events(call_id)
        page = call_page(state, events, now=state.created_at, csrf="c")
        assert html.escape(advice) in page
        assert "<th>next operation</th><td>none</td>" in page
        with pytest.raises(Refusal) as refused:
            await guard.handle(guard.providers["openai"], resend, upstream.send)
        assert (refused.value.status, refused.value.type) == (409, "late_answer_applied")
        assert advice in refused.value.message
        assert upstream.sent == 1
        state = await ledger.call(call_id)
        assert (state.stage, state.attempts) == ("reconciled_not_applied", 2)
    finally:
        await other.stop()


@pytest.mark.parametrize("fenced_call", [500], indirect=True)
async def test_a_late_answer_of_unknown_effect_decides_nothing(fenced_call: Fenced) -> None:
    """A late 500 (declared transient with unknown effect) is kept, but accepting it is
    refused (exit 3): it proves nothing either way."""
    await late_refusal(fenced_call)
    await fenced_call.runtime.stop()
    ledger, call_id = fenced_call.ledger_url, fenced_call.call_id
    (late,) = (await ajson("show", call_id, "--ledger", ledger))["evidence"]
    assert late["status"] == 500 and late["effect"] == "unknown" and late["cost"] is None
    assert (await acli("reconcile", call_id, "--accept-evidence", "--ledger", ledger))[0] == 3
    assert (await ajson("show", call_id, "--ledger", ledger))["stage"] == "effect_unknown"


@pytest.mark.parametrize(
    ("fenced_call", "says", "decided"),
    [(200, NotApplied(), False), (400, Applied(), False), (200, Applied(), True)],
    indirect=["fenced_call"],
    ids=["late 200, hook not applied", "late 400, hook applied", "late 200, hook applied"],
)
async def test_the_hook_never_overrules_a_late_answer(
    fenced_call: Fenced, says: Applied | NotApplied, decided: bool
) -> None:
    """Once a late answer is kept, the sweeper's hook cannot decide the call against it (a
    "not applied" after the provider answered 200 would let a resend pay twice): the call
    stays unknown for a person. A hook that agrees decides it as before."""
    await late_refusal(fenced_call)
    resolver = fenced_call.guard.resolver

    async def hook(question: ReconcileQuestion) -> Applied | NotApplied:
        return says

    resolver.hook = hook
    ledger = fenced_call.runtime.ledger
    assert await resolver.sweep() == ([fenced_call.call_id] if decided else [])
    stage = (await ledger.call(fenced_call.call_id)).stage
    assert stage == ("reconciled_applied" if decided else "effect_unknown")
    assert (await verify_ledger(ledger)).ok


async def test_accept_evidence_without_evidence_is_refused(tmp_path: Path) -> None:
    """A call with no late answer cannot be decided by one (exit 3); flags that decide by
    hand do not go with --accept-evidence (exit 2)."""
    path = tmp_path / "l.db"
    config = RuntimeConfig(ledger_url=str(path), providers=load_providers([], {"openai": UPSTREAM}))
    runtime = Runtime(config)
    guard = await runtime.start()
    try:

        async def broken(request: httpx.Request) -> httpx.Response:
            raise httpx.ReadTimeout("no answer", request=request)

        req = httpx.Request("POST", UPSTREAM + CHAT, json=chat("x"))
        with pytest.raises(Refusal):
            await guard.handle(guard.providers["openai"], req, broken)
        (call,) = await runtime.ledger.calls()
        assert call.stage == "effect_unknown"
    finally:
        await runtime.stop()
    ledger = str(path)
    assert (await acli("reconcile", call.call_id, "--accept-evidence", "--ledger", ledger))[0] == 3
    for extra in (["--applied"], ["--not-applied"], ["--cost", "1"], ["--resend", "--note", "n"]):
        code, _ = await acli(
            "reconcile", call.call_id, "--accept-evidence", *extra, "--ledger", ledger
        )
        assert code == 2, extra
    assert (await ajson("show", call.call_id, "--ledger", ledger))["stage"] == "effect_unknown"


# -- real processes -------------------------------------------------------------------


@pytest.mark.slow
def test_stopped_proxys_late_answer_is_kept_and_accepted(tmp_path: Path) -> None:
    """SIGSTOP past the lease while the fake provider works on a call: the peer takes it
    over and marks it effect_unknown; after SIGCONT the late 200 is kept as evidence (the
    client still gets 502), the stage stays effect_unknown, and the operator accepts it."""
    headers = {"Idempotency-Key": "held", "x-fake-behaviour": "delay=3"}
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        with stopped_while_held(tmp_path, fake, headers) as held:
            ledger = held.ledger
            call_id, worker = held.started["call"], held.started["data"]["worker"]
            wait_for(
                lambda: any(
                    e["kind"] == "attempt.interrupted" and e["call"] == call_id
                    for e in ledger_events(ledger)
                ),
                15,
                "the second proxy to take the stopped one over and mark its call",
            )
            held.first.kill(signal.SIGCONT)
            late = held.pending.result(timeout=30)
            assert late.status_code == 502, late.text
            assert late.json()["error"]["type"] == "observe_refused"
            assert "kept as evidence" in late.json()["error"]["message"]
        assert len(fake.effects()) == 1
    (kept,) = [e for e in ledger_events(ledger) if e["kind"] == "attempt.late_answer"]
    assert kept["call"] == call_id and kept["data"]["status"] == 200
    assert kept["data"]["observed_by"] == worker and kept["worker"] != worker

    shown = cli_json("show", call_id, "--ledger", str(ledger))
    assert shown["stage"] == "effect_unknown" and shown["evidence"][0]["status"] == 200
    decided = cli_json("reconcile", call_id, "--accept-evidence", "--ledger", str(ledger))
    assert decided["stage"] == "reconciled_applied"
    assert Decimal(decided["cost_usd"]) == Decimal(kept["data"]["cost"]) / 10**9
    assert cli("verify", "--ledger", str(ledger))[0] == 0
