"""An effect-unknown call whose endpoint declares a lookup is offered ``effectguard
reconcile --auto`` before any decision by hand, by ``show`` and on the operator page.

A lookup asks the provider whether it applied the call and records only what the answer
proves: the cheapest sound step an operator has. A call of a provider with no lookup is
not offered it; a keyed call inside its provider's window keeps its keyed resend first.
The calls are written to the ledger as a crashed proxy's sweep leaves them.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest
from operatorkit import ADMIN_KEY, PAGE, config_text, interrupted

from effectguard.ledger import operations
from effectguard.ledger.sqlitesession import SqliteSession
from effectguard.ops.cli import main as cli_main
from effectguard.rules.events import AttemptStarted, BudgetReserved, CallManifest
from effectguard.testing import running_proxy

AUTO = "effectguard reconcile --auto"


def write_unknown(
    path: Path, provider: str, endpoint: str, key: str | None, provider_key: str | None = None
) -> str:
    """One ``effect_unknown`` call of ``provider``, its worker gone, and its id."""
    session = SqliteSession(str(path))
    try:
        session.begin()
        writer = operations.register_worker(session, worker="gone", host="h", pid=0, lease_s=0)
        call_id = operations.new_call_id()
        at = time.time() - 60
        manifest = CallManifest(
            call=call_id,
            request_hash=f"{abs(hash((provider, key))):064x}",
            provider=provider,
            endpoint=endpoint,
            method="POST",
            model="default" if provider == "send_email" else "gpt-4o-mini",
            idempotency_key=key,
            budget="ops",
            budget_root="ops",
            effect_kind="billable",
            body=json.dumps({"to": "a@x", "subject": "s", "body": "b"}),
            provider_idempotency_window_s=86_400.0 if provider_key else None,
            at=at,
        )
        started = AttemptStarted(
            call=call_id,
            attempt=1,
            worker=writer.worker,
            generation=writer.generation,
            at=at,
            provider_idempotency_key=provider_key,
        )
        reserved = BudgetReserved(call=call_id, budget="ops", amount=1_000_000)
        interrupted(session, writer, call_id, [manifest, reserved, started])
        session.commit()
    finally:
        session.close()
    return call_id


def show(capsys: pytest.CaptureFixture[str], ledger: Path, call_id: str) -> list[str]:
    """``effectguard show``'s ``next`` lines, as printed."""
    capsys.readouterr()
    assert cli_main(["show", call_id, "--ledger", str(ledger)]) == 0
    text = capsys.readouterr().out
    return [line.strip() for line in text.split("\nnext\n", 1)[1].splitlines()]


def test_show_offers_the_lookup_first_for_a_call_that_has_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A key-less send_email call (its provider declares a lookup) is offered
    ``reconcile --auto`` on the ledger shown, before ``--applied`` and ``--not-applied``;
    ``show --json``'s next_command says the same."""
    ledger = tmp_path / "l.db"
    call_id = write_unknown(ledger, "send_email", "/v1/send", None)
    lines = show(capsys, ledger, call_id)
    assert AUTO in lines[0], lines
    command = re.search(r"`(effectguard reconcile --auto[^`]*)`", lines[0])
    assert command is not None and command.group(1) == f"{AUTO} --ledger {ledger}", lines[0]
    assert any("--applied" in line for line in lines[1:]), lines
    assert any("--not-applied" in line for line in lines[1:]), lines
    capsys.readouterr()
    assert cli_main(["show", call_id, "--json", "--ledger", str(ledger)]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["next_command"].split(" | ")[0] == lines[0]


def test_show_offers_no_lookup_where_none_is_declared(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An OpenAI call (no lookup declared) is offered the decisions by hand alone."""
    ledger = tmp_path / "l.db"
    call_id = write_unknown(ledger, "openai", "/v1/chat/completions", "k1")
    lines = show(capsys, ledger, call_id)
    assert not any(AUTO in line for line in lines), lines
    assert "--applied" in lines[0], lines


def test_a_keyed_call_inside_its_window_keeps_its_resend_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A keyed send_email call inside its 24 h window: the keyed resend first (it settles
    the call without a guess), then the lookup, then the decisions by hand."""
    ledger = tmp_path / "l.db"
    call_id = write_unknown(ledger, "send_email", "/v1/send", "k2", provider_key="pk-2")
    lines = show(capsys, ledger, call_id)
    assert lines[0].startswith("resend the request"), lines
    assert AUTO in lines[1], lines
    assert "--applied" in lines[2], lines


@pytest.mark.slow
def test_the_operator_page_offers_the_lookup_first(tmp_path: Path) -> None:
    """The call's page says ``reconcile --auto`` above its decisions; an OpenAI call's
    page does not. (Nothing listens at send_email's upstream: the sweeper's lookup reaches
    nothing and leaves the call unknown.)"""
    ledger = tmp_path / "ledger.db"
    looked = write_unknown(ledger, "send_email", "/v1/send", None)
    plain = write_unknown(ledger, "openai", "/v1/chat/completions", "k3")
    config = tmp_path / "effectguard.toml"
    config.write_text(config_text())
    upstreams = {"send_email": "http://127.0.0.1:9", "openai": "http://127.0.0.1:9"}
    bearer = {"authorization": f"Bearer {ADMIN_KEY}"}
    with running_proxy(ledger, upstreams=upstreams, args=["--config", str(config)]) as proxy:
        page = httpx.get(f"{proxy.url}{PAGE}calls/{looked}", headers=bearer, timeout=30)
        other = httpx.get(f"{proxy.url}{PAGE}calls/{plain}", headers=bearer, timeout=30)
    assert page.status_code == 200 and other.status_code == 200
    decide = page.text.split("<h2>Decide</h2>", 1)[1]
    assert "effect_unknown" in page.text
    assert AUTO in decide.split('<form class="decide"', 1)[0], decide[:2000]
    assert AUTO not in other.text
