"""A late answer that arrives after a person decided the call "not applied".

The decision frees the call's ``Idempotency-Key``, and ``show`` used to offer the keyed
resend that such a decision usually calls for, even when the provider's own answer,
kept as evidence afterwards, says the effect happened: following it made the effect a
second time. Effects are counted from the fake provider's receipts.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from operatorkit import ADMIN_KEY, ADMIN_NAME, PAGE
from test_dead_owner import UnderWay, call_under_way, paused, run, short_lease
from test_reconcile_auto import SEND, email
from toolkit import cli_json as cli

from effectguard.config.keysettings import hash_key
from effectguard.testing import fake_provider

pytestmark = pytest.mark.slow


def _decide_not_applied_while_it_waits(call: UnderWay, where: tuple[str, ...]) -> None:
    """Pause ``call``'s ``serve`` past its 2 s lease while the provider answers, take the
    call over and decide it not applied; then let the server resume and its client end."""
    with paused(call.proxy):
        run("reconcile", call.call_id, "--not-applied", "--note", "n", *where)  # takes over
        decided = run("reconcile", call.call_id, "--not-applied", "--note", "none seen", *where)
        assert decided.returncode == 0, decided.stdout + decided.stderr
    call.client.join(30)


def test_show_warns_against_a_resend_when_a_late_answer_contradicts_not_applied(
    tmp_path: Path,
) -> None:
    """A call taken over from a paused ``serve`` and decided ``--not-applied``; the server
    resumes and its late 200 is kept: ``show`` then says not to resend, and names the
    late answer, instead of offering the resend."""
    ledger = tmp_path / "ledger.db"
    where = ("--ledger", str(ledger))
    headers = {"x-fake-delay": "2", "Idempotency-Key": "q"}
    with (
        fake_provider(tmp_path / "receipts.jsonl", idempotent=True) as fake,
        call_under_way(ledger, fake, "q@x", headers, short_lease(tmp_path)) as call,
    ):
        call_id = call.call_id
        _decide_not_applied_while_it_waits(call, where)
        assert call.answers and call.answers[0].status_code == 502, call.answers
        shown = cli("show", call_id, *where)
        assert shown["stage"] == "reconciled_not_applied"
        assert [e["status"] for e in shown["evidence"]] == [200], shown["evidence"]
        assert shown["next_command"].startswith("do not resend"), shown["next_command"]
        text = run("show", call_id, *where).stdout
        assert "resend the request with the same Idempotency-Key" not in text
        # Its head says so too: the stage's usual next operation would be resend.
        assert "stage      reconciled_not_applied (effect none; next: none)" in text, text
        assert "do not resend: a late answer kept for attempt 1 (status 200)" in text
        assert len(fake.effects()) == 1


def test_the_late_answers_502_does_not_tell_its_client_to_resend_a_contradicted_call(
    tmp_path: Path,
) -> None:
    """The client of that call gets 502 ``observe_refused`` naming the stage the ledger
    holds (``reconciled_not_applied``); its ``next_operation`` is not the ``resend`` that
    stage usually calls for but ``none``, and its message says what ``show`` says: do
    not resend."""
    ledger = tmp_path / "ledger.db"
    where = ("--ledger", str(ledger))
    headers = {"x-fake-delay": "2", "Idempotency-Key": "r"}
    with (
        fake_provider(tmp_path / "receipts.jsonl", idempotent=True) as fake,
        call_under_way(ledger, fake, "r@x", headers, short_lease(tmp_path)) as call,
    ):
        call_id = call.call_id
        _decide_not_applied_while_it_waits(call, where)
        (answer,) = call.answers
        assert answer.status_code == 502, answer.text
        error = answer.json()["error"]
        assert error["type"] == "observe_refused", error
        assert error["call_id"] == call_id
        assert error["stage"] == "reconciled_not_applied", error
        assert error["next_operation"] == "none", error
        assert answer.headers["x-should-retry"] == "false"
        advice = "do not resend: a late answer kept for attempt 1 (status 200)"
        assert advice in error["message"], error["message"]
        assert cli("show", call_id, *where)["next_command"].startswith(advice)
        assert len(fake.effects()) == 1


def test_a_keyed_resend_of_a_contradicted_call_is_refused_not_sent(tmp_path: Path) -> None:
    """A client that resends that call's request with its Idempotency-Key anyway is
    refused 409 ``late_answer_applied`` (next_operation ``none``, show's advice in the
    message), and nothing is sent: to a provider that does not deduplicate, the resend
    the decision freed was a second effect."""
    ledger = tmp_path / "ledger.db"
    where = ("--ledger", str(ledger))
    headers = {"x-fake-delay": "2", "Idempotency-Key": "s"}
    with (
        fake_provider(tmp_path / "receipts.jsonl") as fake,  # does not deduplicate
        call_under_way(ledger, fake, "s@x", headers, short_lease(tmp_path)) as call,
    ):
        call_id = call.call_id
        _decide_not_applied_while_it_waits(call, where)
        assert call.answers and call.answers[0].status_code == 502, call.answers
        resent = httpx.post(
            call.proxy.url + SEND, json=email("s@x"), headers={"Idempotency-Key": "s"}, timeout=30
        )
        assert resent.status_code == 409, resent.text
        error = resent.json()["error"]
        assert error["type"] == "late_answer_applied", error
        assert (error["call_id"], error["stage"]) == (call_id, "reconciled_not_applied")
        assert error["next_operation"] == "none", error
        assert resent.headers["x-should-retry"] == "false"
        assert "do not resend: a late answer kept for attempt 1 (status 200)" in error["message"]
        assert len(fake.effects()) == 1
        assert cli("show", call_id, *where)["attempts"] == 1


def test_the_operator_page_does_not_offer_the_resend_either(tmp_path: Path) -> None:
    """The operator page's call page says what ``show`` says for that call: next
    operation none and do not resend, not the ``resend`` its stage usually calls for."""
    ledger = tmp_path / "ledger.db"
    where = ("--ledger", str(ledger))
    config = tmp_path / "effectguard.toml"
    admin = f'[[admin.keys]]\nname = "{ADMIN_NAME}"\nsha256 = "{hash_key(ADMIN_KEY)}"\n'
    config.write_text(f"[server]\nlease_s = 2\nheartbeat_s = 0.5\n{admin}")
    headers = {"x-fake-delay": "2", "Idempotency-Key": "t"}
    with (
        fake_provider(tmp_path / "receipts.jsonl", idempotent=True) as fake,
        call_under_way(ledger, fake, "t@x", headers, ("--config", str(config))) as call,
    ):
        call_id = call.call_id
        _decide_not_applied_while_it_waits(call, where)
        assert call.answers and call.answers[0].status_code == 502, call.answers
        page = httpx.get(
            f"{call.proxy.url}{PAGE}calls/{call_id}",
            headers={"authorization": f"Bearer {ADMIN_KEY}"},
            timeout=30,
        )
        assert page.status_code == 200, page.text
        text = html.unescape(page.text)
        assert "do not resend: a late answer kept for attempt 1 (status 200)" in text, text
        assert "next operation: resend" not in text
        assert "<th>next operation</th><td>resend</td>" not in text


@pytest.mark.parametrize(
    "marks",
    [
        pytest.param(lambda call_id: {"Effectguard-Retry-Of": call_id}, id="retry-of"),
        pytest.param(lambda call_id: {"x-stainless-retry-count": "1"}, id="by-hash"),
    ],
)
def test_a_keyless_declared_retry_of_a_contradicted_call_is_refused_not_sent(
    tmp_path: Path, marks: Callable[[str], dict[str, str]]
) -> None:
    """A key-less call decided not applied, that its late 200 says the provider applied:
    a request that declares itself its retry (``Effectguard-Retry-Of``, or an SDK's
    ``x-stainless-retry-count`` matched by hash) is refused 409 ``late_answer_applied``
    as the keyed resend is, and nothing is sent. A decision not applied makes a retry
    new work; this one was a second effect at a provider that does not deduplicate."""
    ledger = tmp_path / "ledger.db"
    where = ("--ledger", str(ledger))
    with (
        fake_provider(tmp_path / "receipts.jsonl") as fake,  # does not deduplicate
        call_under_way(ledger, fake, "u@x", {"x-fake-delay": "2"}, short_lease(tmp_path)) as call,
    ):
        call_id = call.call_id
        _decide_not_applied_while_it_waits(call, where)
        assert call.answers and call.answers[0].status_code == 502, call.answers
        retried = httpx.post(
            call.proxy.url + SEND, json=email("u@x"), headers=marks(call_id), timeout=30
        )
        assert retried.status_code == 409, retried.text
        error = retried.json()["error"]
        assert error["type"] == "late_answer_applied", error
        assert (error["call_id"], error["stage"]) == (call_id, "reconciled_not_applied")
        assert error["next_operation"] == "none", error
        assert retried.headers["x-should-retry"] == "false"
        assert "do not resend: a late answer kept for attempt 1 (status 200)" in error["message"]
        assert len(fake.effects()) == 1
        assert [c["call_id"] for c in cli("calls", *where)] == [call_id]
