"""The application answers "did it happen?" (the reconcile hook), end to end.

A keyed resend of an effect-unknown call asks the hook (here: no lookup is declared):
applied → the hook's result as a 200 marked ``Effectguard-Recovered: hook``, charged the
hook's cost, never resent; not applied → resent once; a failing hook → 409 as before.
Through the transport (``reconcile_hook=``) and the proxy (``[guard] reconcile_hook``),
with real crashes and the fake provider's receipts.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Awaitable, Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import hookapp
import httpx
import pytest
from conftest import FAST
from toolkit import AUTH, KEY, SEND, charge, charges, declare, lossy_transport, lost_send
from toolkit import cli_json as cli

from effectguard import AsyncGuardTransport
from effectguard.callpath.resolve import facts_of
from effectguard.rules.money import usd_to_nanos
from effectguard.testing import FakeProvider, fake_provider, start_proxy

MakeTransport = Callable[..., AsyncGuardTransport]
Finish = Callable[[AsyncGuardTransport], Awaitable[None]]


async def test_transport_hook_decides_unknown_calls(
    tmp_path: Path, make_transport: MakeTransport, finish: Finish
) -> None:
    """Transport: applied → recovered result and the hook's cost, replayed to a later
    resend; not applied → one resend; a hook that fails → 409 effect_unknown, nothing sent."""
    folder = declare(tmp_path, freshness=None)
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        url = fake.url + SEND
        results: dict[int, httpx.Response] = {}
        for amount in (1, 2, 3):
            # Each call is lost on the way: effect unknown, nothing reached the provider.
            t = lossy_transport(make_transport, folder, fake, reconcile_hook=hookapp.answer)
            client = httpx.AsyncClient(transport=t, headers={"Idempotency-Key": f"k{amount}"})
            await lost_send(client, url, charge(amount))
            results[amount] = await client.post(url, json=charge(amount))
            if amount == 1:
                # The hook's result was kept with its decision: a later resend replays it.
                again = await client.post(url, json=charge(amount))
                assert again.status_code == 200, again.text
                assert again.headers["effectguard-replayed"] == "true"
                assert again.headers["effectguard-recovered"] == "hook"
                assert again.content == results[amount].content
            await t.aclose()
        applied, resent, failed = results[1], results[2], results[3]
        assert applied.status_code == 200, applied.text
        assert applied.headers["effectguard-recovered"] == "hook"
        call_id = applied.headers["effectguard-call-id"]
        assert applied.json() == {"id": "from-outbox", "op": call_id}
        assert resent.status_code == 200 and "effectguard-recovered" not in resent.headers
        assert failed.status_code == 409 and failed.json()["error"]["type"] == "effect_unknown"
        assert len(charges(fake)) == 1  # only the not-applied call was sent (again)
    t = make_transport(providers=[folder], upstreams={"payments": fake.url})
    await t.guard()
    states = {s.idempotency_key: s for s in await t.ledger.calls()}
    assert states["k1"].stage == "reconciled_applied"
    assert states["k1"].cost == usd_to_nanos(Decimal("0.02"))
    assert states["k3"].stage == "effect_unknown"
    events = await t.ledger.events(states["k1"].call_id)
    (decided,) = [e.data for e in events if e.kind == "call.reconciled"]
    assert decided["by"] == "hook" and "evidence sha256:" in decided["note"]
    await finish(t)


def _proxy(ledger: Path, fake: FakeProvider, args: tuple[str, ...], crash_at: str | None) -> Any:
    here = str(Path(__file__).parent)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
    if crash_at:
        env["EFFECTGUARD_CRASH_AT"] = crash_at
    return start_proxy(ledger, upstreams={"payments": fake.url}, args=args, env=env)


@pytest.mark.slow
def test_proxy_hook_from_config_decides_unknown_calls(tmp_path: Path) -> None:
    """Proxy: the hook named in [guard] reconcile_hook decides keyed resends, recorded by hook."""
    ledger = tmp_path / "ledger.db"
    config = tmp_path / "effectguard.toml"
    config.write_text('[server]\nsweep_s = 3600\n\n[guard]\nreconcile_hook = "hookapp:answer"\n')
    args = ("--providers", str(declare(tmp_path, freshness=None)), "--config", str(config))
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        for amount, point in ((1, "after:dispatch"), (2, "after:admit"), (3, "after:dispatch")):
            proxy = _proxy(ledger, fake, args, point)
            try:
                with pytest.raises(httpx.TransportError):
                    httpx.post(
                        proxy.url + "/payments" + SEND,
                        json=charge(amount),
                        headers={"Idempotency-Key": f"k{amount}"},
                        timeout=30,
                    )
                assert proxy.process.wait(15) == -signal.SIGKILL
            finally:
                proxy.kill()
        assert len(charges(fake)) == 2
        proxy = _proxy(ledger, fake, args, None)
        try:
            answers = {
                amount: httpx.post(
                    proxy.url + "/payments" + SEND,
                    json=charge(amount),
                    headers={"Idempotency-Key": f"k{amount}"},
                    timeout=30,
                )
                for amount in (1, 2, 3)
            }
        finally:
            proxy.stop()
        assert answers[1].status_code == 200, answers[1].text
        assert answers[1].headers["effectguard-recovered"] == "hook"
        assert answers[1].json()["id"] == "from-outbox"
        assert answers[2].status_code == 200 and "effectguard-recovered" not in answers[2].headers
        assert answers[3].status_code == 409, answers[3].text
        assert len(charges(fake)) == 3  # 1 and 3 once each, 2 (lost) sent once by the resend
        stages = {c["idempotency_key"]: c["stage"] for c in cli("calls", "--ledger", str(ledger))}
        assert stages == {"k1": "reconciled_applied", "k2": "completed", "k3": "effect_unknown"}
        assert cli("verify", "--ledger", str(ledger))["ok"] is True


@pytest.mark.parametrize(
    ("amount", "why"),
    [
        (4, "hook failed: TimeoutError"),
        (5, "the reconcile hook answered 'yes, it was sent'"),
        (6, "money must not be a float"),
        (7, "a cost must be between"),
        (8, "is not JSON serializable"),
    ],
)
async def test_a_hook_that_hangs_or_answers_nonsense_decides_nothing(
    tmp_path: Path, make_transport: MakeTransport, finish: Finish, amount: int, why: str
) -> None:
    """A hook past its timeout, or one answering no answer (not Applied / NotApplied /
    Unknown, a float or negative cost, a result that is not JSON), counts as unknown: the
    resend is refused 409 effect_unknown, nothing is recorded or sent, and the sweeper
    (which asks the hook too) decides nothing either."""
    folder = declare(tmp_path, freshness=None)
    settings = dataclasses.replace(FAST, reconcile_hook_timeout_s=0.2)
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        t = lossy_transport(
            make_transport, folder, fake, reconcile_hook=hookapp.answer, settings=settings
        )
        client = httpx.AsyncClient(transport=t, headers={"Idempotency-Key": "k"})
        call_id = await lost_send(client, fake.url + SEND, charge(amount))
        refused = await client.post(fake.url + SEND, json=charge(amount))
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["type"] == "effect_unknown"
        guard = await t.guard()
        assert await guard.resolver.sweep() == []
        assert charges(fake) == []
        assert [e.kind for e in await t.ledger.events(call_id) if e.kind == "call.reconciled"] == []
        facts = await facts_of(t.ledger, call_id)  # and why, as the resolver reads it
        assert facts is not None
        evidence = await guard.resolver.decide(facts)
        assert evidence.verdict == "unknown" and why in evidence.note, evidence
    await finish(t)


async def test_the_sweeper_asks_the_hook_and_keeps_its_result(
    tmp_path: Path, make_transport: MakeTransport, finish: Finish
) -> None:
    """With no lookup declared, the sweeper asks the hook: applied is recorded by hook with
    its cost and its result, which the client's later keyed resend gets as a replay (no
    provider call); not applied frees the key for one new attempt."""
    folder = declare(tmp_path, freshness=None)
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        t = lossy_transport(make_transport, folder, fake, reconcile_hook=hookapp.answer)
        client = httpx.AsyncClient(transport=t)
        url = fake.url + SEND
        ids = {}
        for amount in (1, 2):
            t.inner.dropped = False  # type: ignore[attr-defined]
            key = {"Idempotency-Key": f"s{amount}"}
            ids[amount] = await lost_send(client, url, charge(amount), headers=key)
        guard = await t.guard()
        assert sorted(await guard.resolver.sweep()) == sorted(ids.values())
        applied, not_applied = (await t.ledger.call(ids[1]), await t.ledger.call(ids[2]))
        assert (applied.stage, applied.cost) == ("reconciled_applied", usd_to_nanos("0.02"))
        assert not_applied.stage == "reconciled_not_applied"
        assert charges(fake) == []
        replay = await client.post(url, json=charge(1), headers={"Idempotency-Key": "s1"})
        assert replay.status_code == 200, replay.text
        assert replay.headers["effectguard-replayed"] == "true"
        assert replay.headers["effectguard-recovered"] == "hook"
        assert replay.json() == {"id": "from-outbox", "op": ids[1]}
        resent = await client.post(url, json=charge(2), headers={"Idempotency-Key": "s2"})
        assert resent.status_code == 200 and "effectguard-recovered" not in resent.headers
        assert len(charges(fake)) == 1  # only the not-applied call, sent once
    await finish(t)


async def test_the_hook_decides_when_the_lookup_cannot_tell(
    tmp_path: Path, make_transport: MakeTransport, finish: Finish
) -> None:
    """A lookup whose "not found" proves nothing yet (the call is younger than its
    freshness) hands over to the hook: applied by hook (no resend), not applied by hook
    (one new attempt); the lookup's own answer is no decision."""
    folder = declare(tmp_path, freshness=3600)
    with fake_provider(tmp_path / "receipts.jsonl", extra_args=["--lookup-key", KEY]) as fake:
        url = fake.url + SEND
        answers = {}
        for amount in (1, 2):
            t = lossy_transport(make_transport, folder, fake, reconcile_hook=hookapp.answer)
            client = httpx.AsyncClient(
                transport=t, headers={**AUTH, "Idempotency-Key": f"h{amount}"}
            )
            call_id = await lost_send(client, url, charge(amount))
            answers[amount] = await client.post(url, json=charge(amount))
            (decided,) = [
                e.data for e in await t.ledger.events(call_id) if e.kind == "call.reconciled"
            ]
            assert (decided["by"], decided["applied"]) == ("hook", amount == 1)
            await t.aclose()
        assert (
            answers[1].status_code == 200 and answers[1].headers["effectguard-recovered"] == "hook"
        )
        assert answers[2].status_code == 200 and "effectguard-recovered" not in answers[2].headers
        assert len(charges(fake)) == 1
    t = make_transport(providers=[folder], upstreams={"payments": fake.url})
    await t.guard()
    await finish(t)
