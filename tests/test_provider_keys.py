"""The idempotency key a provider sees (docs/contract.md §4): a new call's is its call id,
never the client's ``Idempotency-Key``; every later attempt of a call repeats the key its
earlier attempt sent, read from the ledger.

Clients of two budget roots that share one provider account and happen to use the same
key string must get two effects, not one folded into the other by the provider's dedup.
The proxy tests run a real ``effectguard serve`` against the fake provider in idempotent
mode and count effects from its receipt log; the store test runs on every store.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_reconcile_auto import SEND, cli, crash, email, send
from test_store_contract import R, admit_ok, clock, ledger, ledger_url, ns, req, store_kind, w1

from effectguard.ledger import AdmitRequest, Ledger, Writer, operations
from effectguard.ledger.base import Tx
from effectguard.rules.events import AttemptStarted, BudgetReserved, CallManifest
from effectguard.rules.workstate import WorkState
from effectguard.testing import fake_provider

_ = (clock, ledger, ledger_url, ns, store_kind, w1)  # fixtures

WINDOW_S = 3600.0


def _attempt_keys(ledger: Path, call_id: str) -> list[str]:
    """The provider key each ``attempt.started`` of ``call_id`` recorded, in order."""
    shown = cli("show", call_id, "--ledger", str(ledger))
    return [
        e["data"]["provider_idempotency_key"]
        for e in shown["events"]
        if e["kind"] == "attempt.started"
    ]


@pytest.mark.slow
def test_two_roots_with_one_client_key_get_two_effects(tmp_path: Path) -> None:
    """The same Idempotency-Key and body from two budget roots: two calls, two provider keys,
    two real effects at the idempotent provider (none deduplicated into the other)."""
    ledger = tmp_path / "ledger.db"
    same = {"Idempotency-Key": "order-1"}
    with fake_provider(tmp_path / "receipts.jsonl", idempotent=True) as fake:
        answers = send(
            ledger,
            fake,
            [
                (SEND, email("a@x"), {**same, "Effectguard-Budget": "tenant-a"}),
                (SEND, email("a@x"), {**same, "Effectguard-Budget": "tenant-b"}),
            ],
        )
        assert [a.status_code for a in answers] == [200, 200]
        receipts = fake.receipts()
    calls = [a.headers["effectguard-call-id"] for a in answers]
    assert len(set(calls)) == 2
    assert [r["deduped"] for r in receipts] == [False, False]
    assert [r["idempotency_key"] for r in receipts] == calls
    assert [_attempt_keys(ledger, c) for c in calls] == [[c] for c in calls]


@pytest.mark.slow
def test_a_resend_carries_the_provider_key_of_its_first_attempt(tmp_path: Path) -> None:
    """A keyed call whose replica died after dispatch is resent inside the provider's window
    with its first attempt's provider key (its call id): the provider dedups it, one effect."""
    ledger = tmp_path / "ledger.db"
    headers = {"Idempotency-Key": "order-2", "Effectguard-Budget": "tenant-a"}
    with fake_provider(tmp_path / "receipts.jsonl", idempotent=True) as fake:
        crash(ledger, fake, "after:dispatch", SEND, email("b@x"), headers)
        (answer,) = send(ledger, fake, [(SEND, email("b@x"), headers)])
        assert answer.status_code == 200, answer.text
        receipts = fake.receipts()
        effects = fake.effects()
    call_id = answer.headers["effectguard-call-id"]
    assert [r["idempotency_key"] for r in receipts] == [call_id, call_id]
    assert len(effects) == 1
    assert _attempt_keys(ledger, call_id) == [call_id, call_id]
    assert cli("verify", "--ledger", str(ledger))["ok"] is True


async def test_a_call_already_in_the_ledger_keeps_the_key_it_sent(
    ledger: Ledger, w1: Writer, ns: str
) -> None:
    """A call whose attempt sent the client's own key (as before provider keys were derived)
    is resent with that key, read from its attempt.started: an upgrade never changes the
    provider key of an operation in flight."""
    request = req(ns, key="order-3", provider_idempotency_window_s=WINDOW_S)
    call_id = await ledger.store.write(w1, lambda tx: _legacy_call(tx, w1, request))
    await ledger.interrupt(w1, call_id, 1, "read timeout")
    resent = await ledger.admit(w1, request)
    assert (resent.action, resent.call_id) == ("provider_resend", call_id)
    assert resent.provider_idempotency_key == "order-3"
    fresh = await admit_ok(ledger, w1, req(ns, key="order-4", provider_idempotency_window_s=60))
    assert fresh.provider_idempotency_key == fresh.call_id


def _legacy_call(tx: Tx, writer: Writer, request: AdmitRequest) -> str:
    """Admission as it was written before: the client's key sent as the provider's."""
    call_id, now = operations.new_call_id(), tx.now()
    manifest = CallManifest(
        call=call_id,
        request_hash=request.request_hash,
        provider=request.provider,
        endpoint=request.endpoint,
        method=request.method,
        model=request.model,
        idempotency_key=request.idempotency_key,
        budget=request.budget,
        budget_root=request.budget_root,
        effect_kind=request.effect_kind,
        body=request.body,
        body_encoding=request.body_encoding,
        stream=request.stream,
        provider_idempotency_window_s=request.provider_idempotency_window_s,
        at=now,
    )
    started = AttemptStarted(
        call=call_id,
        attempt=1,
        worker=writer.worker,
        generation=writer.generation,
        provider_idempotency_key=request.idempotency_key,
        at=now,
    )
    reserved = BudgetReserved(call=call_id, budget=request.budget, amount=R)
    operations.append(tx, writer, [manifest, reserved, started], {call_id: WorkState()})
    return call_id
