"""``effectguard reconcile CALL --resend --note TEXT``: one new attempt of an unknown call,
the duplicate risk accepted by an operator, end to end (transport and proxy).

The hold stays until the authorized attempt settles, and is then spent (the first
attempt may have had its effect too). Exactly one attempt goes out, even to concurrent
resends. Effects are counted from the fake provider's receipts.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
from toolkit import SEND, SLOW_ANSWER_TIMES_OUT, charge, charges, declare

from effectguard import AsyncGuardTransport, ReconcileError, load_providers
from effectguard.testing import FakeProvider, fake_provider, start_proxy

MakeTransport = Callable[..., AsyncGuardTransport]
Finish = Callable[[AsyncGuardTransport], Awaitable[None]]


def per_call(folder: Path) -> int:
    """The declared per-call price of ``payments``."""
    price = load_providers([folder])["payments"].models["default"].per_call
    assert price is not None
    return price


async def unknown_payment(
    make_transport: MakeTransport, folder: Path, fake: FakeProvider, key: str
) -> tuple[AsyncGuardTransport, httpx.AsyncClient, str]:
    """A transport to ``fake`` as ``payments``, its keyed client, and the id of a payment
    whose answer came too late (effect unknown: the provider took it)."""
    t = make_transport(
        providers=[folder], upstreams={"payments": fake.url}, settings=SLOW_ANSWER_TIMES_OUT
    )
    client = httpx.AsyncClient(transport=t, headers={"Idempotency-Key": key})
    first = await client.post(fake.url + SEND, json=charge(1), headers={"x-fake-delay": "3"})
    assert first.status_code == 504, first.text
    return t, client, first.headers["effectguard-call-id"]


async def test_transport_resend_authorized_once_goes_out_once(
    tmp_path: Path, make_transport: MakeTransport, finish: Finish
) -> None:
    """Refused before the authorization; after it, concurrent resends send exactly one new
    attempt; the hold stays until that attempt settles, then it is spent."""
    folder = declare(tmp_path, freshness=None)
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        t, client, call_id = await unknown_payment(make_transport, folder, fake, "r1")
        url = fake.url + SEND
        refused = await client.post(url, json=charge(1))
        assert refused.status_code == 409 and refused.json()["error"]["type"] == "effect_unknown"
        state = await t.ledger.authorize_resend(call_id, note="customer asked", by="ops")
        assert (state.stage, state.held) == ("effect_unknown", per_call(folder))
        with pytest.raises(ReconcileError):
            await t.ledger.authorize_resend(call_id, note="twice", by="ops")
        racing = await asyncio.gather(
            *(
                client.post(url, json=charge(1), headers={"x-fake-delay": "0.2"}, timeout=10)
                for _ in range(2)
            )
        )
        assert sorted(r.status_code for r in racing) == [200, 409], [r.text for r in racing]
        (loser,) = [r for r in racing if r.status_code == 409]
        assert loser.json()["error"]["type"] == "in_progress"
        assert len(charges(fake)) == 2  # the first (maybe applied) and the authorized one
        replay = await client.post(url, json=charge(1))
        assert replay.headers["effectguard-replayed"] == "true"
        assert len(charges(fake)) == 2
        (state,) = await t.ledger.calls()
        assert (state.stage, state.attempts, state.held) == ("completed", 2, 0)
        assert state.cost == 2 * per_call(folder)  # the hold spent, and the new charge
        with pytest.raises(ReconcileError):
            await t.ledger.authorize_resend(call_id, note="again", by="ops")
    await finish(t)


async def test_an_authorized_resend_that_did_nothing_leaves_the_call_unknown_and_held(
    tmp_path: Path, make_transport: MakeTransport, finish: Finish
) -> None:
    """The authorized attempt is answered 429 (declared not processed), then finds the
    provider down (not sent): neither says anything of the first attempt, so the call is
    effect_unknown again, with its hold and the authorization still standing, and a
    person can still decide it. It once read ``not_processed``, effect "none", with the
    first attempt's hold stuck and every ``reconcile`` refused."""
    folder = declare(tmp_path, freshness=None)
    text = (folder / "payments.toml").read_text()
    taken = 'prices_taken = "2026-12-01"\n'
    (folder / "payments.toml").write_text(text.replace(taken, taken + "not_processed = [429]\n"))
    price = per_call(folder)
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        t, client, call_id = await unknown_payment(make_transport, folder, fake, "r2")
        url = fake.url + SEND
        await t.ledger.authorize_resend(call_id, note="customer asked", by="ops")
        busy = await client.post(url, json=charge(1), headers={"x-fake-status": "429"})
        assert busy.status_code == 429, busy.text
        (state,) = await t.ledger.calls()
        assert (state.stage, state.effect, state.held) == ("effect_unknown", "unknown", price)
        assert state.resend_authorized and state.reserved == 0
        # The authorization stands: the next resend goes out, and now finds nobody there.
        fake.stop()
        down = await client.post(url, json=charge(1), timeout=5)
        assert down.status_code == 502, down.text
        (state,) = await t.ledger.calls()
        # Not sent, so retried automatically (contract.md §3.5), still under the authorization.
        assert (state.stage, state.held) == ("effect_unknown", price) and state.attempts >= 3
        with pytest.raises(ReconcileError):
            await t.ledger.authorize_resend(call_id, note="twice", by="ops")
        decided = await t.ledger.reconcile(call_id, applied=False, note="no charge", by="ops")
        assert (decided.stage, decided.held, decided.resend_authorized) == (
            "reconciled_not_applied",
            0,
            False,
        )
    assert len(charges(fake)) == 2  # the first (delayed) and the 429 one: nothing more
    await finish(t)


def cli(*args: str, ok: bool = True) -> Any:
    """Run the real ``effectguard`` command with ``--json``; parse stdout if it succeeded."""
    done = subprocess.run(
        [sys.executable, "-m", "effectguard", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode == 0) == ok, done.stdout + done.stderr
    return json.loads(done.stdout) if ok else done.stderr


@pytest.mark.slow
def test_proxy_resend_authorized_by_the_cli(tmp_path: Path) -> None:
    """After a crash, `reconcile CALL --resend --note` lets one keyed resend through the proxy."""
    ledger = tmp_path / "ledger.db"
    folder = declare(tmp_path, freshness=None)
    args = ("--providers", str(folder))
    route = "/payments" + SEND
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        upstreams = {"payments": fake.url}
        proxy = start_proxy(
            ledger, upstreams=upstreams, args=args, env={"EFFECTGUARD_CRASH_AT": "after:dispatch"}
        )
        try:
            with pytest.raises(httpx.TransportError):
                httpx.post(proxy.url + route, json=charge(1), headers={"Idempotency-Key": "r"})
            assert proxy.process.wait(15) == -signal.SIGKILL
        finally:
            proxy.kill()
        proxy = start_proxy(ledger, upstreams=upstreams, args=args)
        try:
            post = lambda: httpx.post(  # noqa: E731
                proxy.url + route, json=charge(1), headers={"Idempotency-Key": "r"}, timeout=30
            )
            refused = post()
            assert refused.status_code == 409, refused.text
            call_id = refused.headers["effectguard-call-id"]
            assert "--note" in cli(
                "reconcile", call_id, "--resend", "--ledger", str(ledger), ok=False
            )
            shown = cli(
                "reconcile",
                call_id,
                "--resend",
                "--note",
                "accept a duplicate",
                "--ledger",
                str(ledger),
            )
            assert shown["stage"] == "effect_unknown"
            offered = cli("show", call_id, "--ledger", str(ledger))["next_command"]
            assert offered.startswith("resend the request"), offered  # then the decisions
            assert f"effectguard reconcile {call_id}" in offered, offered
            resent, replay = post(), post()
        finally:
            proxy.stop()
        assert resent.status_code == 200, resent.text
        assert replay.headers["effectguard-replayed"] == "true"
        assert len(charges(fake)) == 2
        (call,) = cli("calls", "--ledger", str(ledger))
        assert (call["stage"], call["attempts"]) == ("completed", 2)
        assert Decimal(call["held_usd"]) == 0
        assert Decimal(call["cost_usd"]) == 2 * Decimal(call["reserved_usd"])
        events = cli("show", call_id, "--ledger", str(ledger))["events"]
        (authorized,) = [e["data"] for e in events if e["kind"] == "call.resend_authorized"]
        assert authorized["note"] == "accept a duplicate"
        assert cli("verify", "--ledger", str(ledger))["ok"] is True
