"""Unknown effects of providers that declare a read path or an idempotency guarantee.

* ``effectguard reconcile --auto`` asks each effect-unknown call's provider
  through its declared lookup path and records ``call.reconciled`` by
  ``lookup:<provider>``; calls of providers without a lookup wait for a person.
* A provider that declares an idempotency guarantee gets an effect-unknown call
  resent with the same key inside its window, and the fake provider's dedup
  proves one effect; outside the window the resend is refused.

Calls become effect-unknown through real crashes (``EFFECTGUARD_CRASH_AT``).
Effects are counted only from the fake provider's receipt log.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
from toolkit import cli_json as cli

from effectguard.testing import FakeProvider, fake_provider, start_proxy

pytestmark = pytest.mark.slow

SEND = "/send_email/v1/send"
CHAT = "/openai/v1/chat/completions"


def email(to: str) -> dict[str, Any]:
    """A request to the flat ``send_email`` tool."""
    return {"to": to, "subject": "hello", "body": "hi"}


def upstreams(fake: FakeProvider) -> dict[str, str]:
    """Both providers of these tests point at the fake."""
    return {"send_email": fake.url, "openai": fake.url}


def crash(
    ledger: Path,
    fake: FakeProvider,
    point: str,
    path: str,
    body: Any,
    headers: dict[str, str] | None = None,
    args: tuple[str, ...] = (),
) -> None:
    """One request through a proxy that kills itself at ``point``."""
    proxy = start_proxy(
        ledger, upstreams=upstreams(fake), args=args, env={"EFFECTGUARD_CRASH_AT": point}
    )
    try:
        with pytest.raises(httpx.TransportError):
            httpx.post(proxy.url + path, json=body, headers=headers or {}, timeout=30)
        assert proxy.process.wait(15) == -signal.SIGKILL
    finally:
        proxy.kill()


def send(
    ledger: Path,
    fake: FakeProvider,
    requests: list[tuple[str, Any, dict[str, str]]],
    args: tuple[str, ...] = (),
) -> list[httpx.Response]:
    """Requests through one fresh proxy (its start-up sweep resolves dead workers first)."""
    proxy = start_proxy(ledger, upstreams=upstreams(fake), args=args)
    try:
        return [
            httpx.post(proxy.url + path, json=body, headers=headers, timeout=30)
            for path, body, headers in requests
        ]
    finally:
        proxy.stop()


def restart_without_lookups(ledger: Path) -> None:
    """A proxy started and stopped: its start-up sweep marks the dead workers' calls
    effect_unknown, and its lookups reach no provider (nothing listens at the upstream it
    is given), so the calls are left for ``reconcile --auto``."""
    proxy = start_proxy(ledger, upstreams={"send_email": "http://127.0.0.1:9"})
    proxy.stop()


def test_auto_reconcile_records_each_providers_answer(tmp_path: Path) -> None:
    """--auto asks the lookup path: applied and not-applied are recorded by lookup:send_email;
    a provider without a lookup is left for a person; the decisions then rule resends."""
    ledger = tmp_path / "ledger.db"
    with fake_provider(tmp_path / "receipts.jsonl", idempotent=True) as fake:
        # Reached the provider (keyed), a provider that declares no lookup, and never
        # reached it (key-less: looked up by call id). Each crash's successor marks its
        # predecessor's call unknown; the keyed one is inside its idempotency window, left
        # to its client's resend, and the key-less one is crashed last, so no start-up
        # sweep with a provider to ask decides either.
        crash(ledger, fake, "after:dispatch", SEND, email("sent@x"), {"Idempotency-Key": "sent"})
        chat = {
            "model": "gpt-4o-mini",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
        }
        crash(ledger, fake, "after:dispatch", CHAT, chat, {"Idempotency-Key": "chat"})
        crash(ledger, fake, "after:admit", SEND, email("never@x"))
        restart_without_lookups(ledger)  # a fresh worker sweeps the last dead one
        unknown = {
            c["idempotency_key"] or "keyless": c
            for c in cli("calls", "--ledger", str(ledger), "--state", "effect_unknown")
        }
        assert sorted(unknown) == ["chat", "keyless", "sent"]
        assert len(fake.effects()) == 2

        results = cli(
            "reconcile", "--auto", "--ledger", str(ledger), "--upstream", f"send_email={fake.url}"
        )
        by_call = {r["call_id"]: r["result"] for r in results}
        assert by_call == {
            unknown["sent"]["call_id"]: "applied",
            unknown["keyless"]["call_id"]: "not_applied",
        }

        for name, stage in [
            ("sent", "reconciled_applied"),
            ("keyless", "reconciled_not_applied"),
            ("chat", "effect_unknown"),
        ]:
            shown = cli("show", unknown[name]["call_id"], "--ledger", str(ledger))
            assert shown["stage"] == stage, shown
            decided = [e for e in shown["events"] if e["kind"] == "call.reconciled"]
            if stage == "effect_unknown":
                assert decided == []
            else:
                (event,) = decided
                assert event["data"]["by"] == "lookup:send_email"
                assert "/ops/" in event["data"]["note"]
        applied = cli("show", unknown["sent"]["call_id"], "--ledger", str(ledger))
        assert applied["cost_usd"] == applied["reserved_usd"] and Decimal(applied["held_usd"]) == 0

        # A second pass finds nothing more to decide (the chat call waits for a person).
        assert (
            cli(
                "reconcile",
                "--auto",
                "--ledger",
                str(ledger),
                "--upstream",
                f"send_email={fake.url}",
            )
            == []
        )

        # The decisions rule the resends: applied is refused, not-applied is sent once.
        refused, resent = send(
            ledger,
            fake,
            [
                (SEND, email("sent@x"), {"Idempotency-Key": "sent"}),
                (SEND, email("never@x"), {"Effectguard-Retry-Of": unknown["keyless"]["call_id"]}),
            ],
        )
        assert refused.status_code == 409
        assert refused.json()["error"]["type"] == "reconciled_applied"
        # A key-less declared retry of a reconciled call is new work (it is not unresolved).
        assert resent.status_code == 200, resent.text
        assert len(fake.effects()) == 3
        assert cli("calls", "--ledger", str(ledger), "--state", "in_flight") == []
        assert cli("verify", "--ledger", str(ledger))["ok"] is True


def test_auto_reconcile_asked_elsewhere_or_in_another_account_decides_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--auto runs in its own process, with its own --upstream and keys. A lookup asked
    where the call was not sent (another upstream than serve's) or with another credential
    than it carried (another account) finds nothing whether it happened or not: its "not
    found" leaves the call unknown, the note saying why. Asked where and as it was sent,
    the same lookup decides it."""
    ledger = tmp_path / "ledger.db"
    monkeypatch.delenv("SEND_EMAIL_API_KEY", raising=False)
    with (
        fake_provider(tmp_path / "receipts.jsonl", idempotent=True) as fake,
        fake_provider(tmp_path / "elsewhere.jsonl", idempotent=True) as elsewhere,
    ):
        crash(ledger, fake, "after:admit", SEND, email("never@x"))  # sent with no key
        restart_without_lookups(ledger)
        (call,) = cli("calls", "--ledger", str(ledger), "--state", "effect_unknown")

        def auto(upstream: str) -> list[dict[str, Any]]:
            args = ("--ledger", str(ledger), "--upstream", f"send_email={upstream}")
            return cli("reconcile", "--auto", *args)  # type: ignore[no-any-return]

        (asked,) = auto(elsewhere.url)
        assert asked["result"] == "unknown", asked
        assert f"this lookup asks {elsewhere.url}" in asked["note"], asked
        assert f"sent to: {fake.url}" in asked["note"], asked
        monkeypatch.setenv("SEND_EMAIL_API_KEY", "another-accounts-key")
        (asked,) = auto(fake.url)
        assert asked["result"] == "unknown", asked
        assert "another credential" in asked["note"], asked
        assert cli("show", call["call_id"], "--ledger", str(ledger))["stage"] == "effect_unknown"

        monkeypatch.delenv("SEND_EMAIL_API_KEY")
        (asked,) = auto(fake.url)
        assert asked["result"] == "not_applied", asked
        shown = cli("show", call["call_id"], "--ledger", str(ledger))
        assert shown["stage"] == "reconciled_not_applied"
        assert [a["sent_to"] for a in shown["attempts_detail"]] == [fake.url]
        assert fake.effects() == elsewhere.effects() == []
        assert cli("verify", "--ledger", str(ledger))["ok"] is True


@pytest.mark.parametrize("point", ["after:admit", "after:dispatch", "after:upstream-response"])
def test_idempotent_provider_resend_inside_window_has_one_effect(
    tmp_path: Path, point: str
) -> None:
    """Inside the declared window, the resend of an effect-unknown call goes out as a new
    attempt with the same provider key: the provider dedups it, so one effect in all."""
    ledger = tmp_path / "ledger.db"
    headers = {"Idempotency-Key": f"mail-{point}"}
    with fake_provider(tmp_path / "receipts.jsonl", idempotent=True) as fake:
        crash(ledger, fake, point, SEND, email("a@x"), headers)
        (answer,) = send(ledger, fake, [(SEND, email("a@x"), headers)])
        assert answer.status_code == 200, answer.text
        receipts = fake.receipts()
        (call,) = cli("calls", "--ledger", str(ledger))
        # The provider's key is the call's id (contract §4), the same on every attempt.
        assert {r["idempotency_key"] for r in receipts} == {call["call_id"]}
        assert len(fake.effects()) == 1
        assert len(receipts) == (1 if point == "after:admit" else 2)
        assert call["stage"] == "completed" and call["attempts"] == 2
        shown = cli("show", call["call_id"], "--ledger", str(ledger))
        keys = [
            e["data"]["provider_idempotency_key"]
            for e in shown["events"]
            if e["kind"] == "attempt.started"
        ]
        assert keys == [call["call_id"]] * 2
        assert cli("verify", "--ledger", str(ledger))["ok"] is True


def test_idempotent_provider_resend_outside_window_is_refused(tmp_path: Path) -> None:
    """Past the declared window the provider's dedup is no guarantee: never resent; the
    declared lookup decides the call instead."""
    ledger = tmp_path / "ledger.db"
    overrides = tmp_path / "providers"
    overrides.mkdir()
    (overrides / "short_window.toml").write_text(
        'extends = "send_email"\n\n[idempotency]\nheader = "Idempotency-Key"\nwindow_seconds = 1\n'
    )
    args = ("--providers", str(overrides))
    headers = {"Idempotency-Key": "late"}
    with fake_provider(tmp_path / "receipts.jsonl", idempotent=True) as fake:
        crash(ledger, fake, "after:dispatch", SEND, email("b@x"), headers, args)
        time.sleep(1.2)
        (answer,) = send(ledger, fake, [(SEND, email("b@x"), headers)], args)
        # Not resent: the provider's lookup decides the call instead (it was applied).
        assert answer.status_code == 409, answer.text
        assert answer.json()["error"]["type"] == "reconciled_applied"
        assert len(fake.receipts()) == 1
        (call,) = cli("calls", "--ledger", str(ledger))
        shown = cli("show", call["call_id"], "--ledger", str(ledger))
        (decided,) = [e for e in shown["events"] if e["kind"] == "call.reconciled"]
        assert decided["data"]["by"] == "lookup:send_email"
        assert "evidence sha256:" in decided["data"]["note"]
        assert cli("verify", "--ledger", str(ledger))["ok"] is True


def test_auto_reconcile_killed_after_a_decision_resumes(tmp_path: Path) -> None:
    """``after:reconcile`` applies to --auto too: killed right after its first recorded
    decision, that decision is durable and a second run decides the rest."""
    ledger = tmp_path / "ledger.db"
    with fake_provider(tmp_path / "receipts.jsonl", idempotent=True) as fake:
        crash(ledger, fake, "after:dispatch", SEND, email("one@x"), {"Idempotency-Key": "one"})
        crash(ledger, fake, "after:dispatch", SEND, email("two@x"), {"Idempotency-Key": "two"})
        restart_without_lookups(ledger)  # a fresh worker sweeps the last dead one
        assert len(cli("calls", "--ledger", str(ledger), "--state", "effect_unknown")) == 2
        env = {**os.environ, "EFFECTGUARD_CRASH_AT": "after:reconcile"}
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "effectguard",
                "reconcile",
                "--auto",
                "--ledger",
                str(ledger),
                "--upstream",
                f"send_email={fake.url}",
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr
        stages = sorted(c["stage"] for c in cli("calls", "--ledger", str(ledger)))
        assert stages == ["effect_unknown", "reconciled_applied"]
        (left,) = cli("calls", "--ledger", str(ledger), "--state", "effect_unknown")
        text = subprocess.run(
            [sys.executable, "-m", "effectguard", "reconcile", "--auto", "--ledger", str(ledger),
             "--upstream", f"send_email={fake.url}"],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout  # fmt: skip
        # One line a call, with what the lookup answered: an operator sees why.
        assert re.fullmatch(
            rf"{left['call_id']}: applied \(lookup .+ answered 200: .+; evidence sha256:\w+\)\n",
            text,
        ), text
        assert cli("verify", "--ledger", str(ledger))["ok"] is True
        assert len(fake.effects()) == 2
