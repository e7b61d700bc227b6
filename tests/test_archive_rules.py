"""What ``effectguard archive`` keeps live, through the CLI on real ledgers.

The retention rule (docs/operations.md, "Retention and archives"): never an unresolved
call, never one resolved after the cut-off (retention counts from the resolution), never
one inside its provider's idempotency window; an archive is a prefix of the chain, so the
first call that must stay holds back everything after it, and ``archive`` names it.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import httpx
import pytest
from eventkit import completion
from observing import call_stages
from test_archive import CHAT, archive, chat, cli, later, send_chats
from test_verify import R, request

from effectguard.ledger import Ledger, Writer, operations, sqliteevents
from effectguard.ops.cli import main
from effectguard.testing import fake_provider, running_proxy
from effectguard.testing.clock import ManualClock

DAY_S = 86_400.0
SEND = "/send_email/v1/send"


async def admitted_long_ago(path: Path, at: float) -> tuple[str, str]:
    """At ``at``: one call completed, then one left ``effect_unknown`` (its attempt
    interrupted). Returns their ids."""
    async with Ledger.open(str(path), clock=ManualClock(at)) as ledger:
        writer = await ledger.store.write(
            Writer("boot", 0),
            lambda tx: operations.register_worker(tx, worker="w1", host="h", pid=1, lease_s=30),
        )
        done = await ledger.admit(writer, request("done"))
        events = completion(done.call_id, budget="team/run", reserved=R, actual=R)
        await ledger.record(writer, done.call_id, 1, events)
        unknown = await ledger.admit(writer, request("unknown"))
        await ledger.interrupt(writer, unknown.call_id, 1, "read timeout")
    return done.call_id, unknown.call_id


def test_a_call_admitted_long_ago_but_resolved_recently_is_not_archived(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A call admitted 60 days ago and reconciled today stays live under a 30-day
    retention, and ``archive`` names it as what holds the cut; the call admitted and
    resolved before it leaves."""
    ledger = tmp_path / "ledger.db"
    done, unknown = asyncio.run(admitted_long_ago(ledger, time.time() - 60 * DAY_S))
    code, out = cli(
        capsys, "reconcile", unknown, "--applied", "--note", "seen", "--ledger", str(ledger)
    )
    assert code == 0, out
    code, moved = cli(capsys, "archive", "--ledger", str(ledger), "--before", "30d")
    assert code == 0, moved
    assert moved["calls"] == 1
    assert call_stages(ledger) == {unknown: "reconciled_applied"}
    assert (moved["held_by"], moved["held_because"]) == (unknown, "resolved after the cut-off")
    code, report = cli(capsys, "verify", "--ledger", str(ledger))
    assert code == 0, report["problems"]
    code, report = cli(capsys, "verify", "--archive", moved["path"], "--ledger", str(ledger))
    assert code == 0 and report["calls"] == 1, report["problems"]
    assert done not in call_stages(ledger)


def test_a_refused_calls_key_stays_free_after_it_is_archived(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two keyed requests refused for budget under one key (a refused call's key is free,
    so the second is a call of its own) are archived without keeping the key: the archive
    succeeds, and the key then admits new work instead of answering 409 archived."""
    ledger = tmp_path / "ledger.db"
    headers = {"Idempotency-Key": "order-1", "Effectguard-Budget": "team"}
    with (
        fake_provider(tmp_path / "receipts.jsonl") as fake,
        running_proxy(ledger, upstreams={"openai": fake.url}) as proxy,
    ):
        code, out = cli(
            capsys, "budget", "set", "team", "--limit", "0.000000001", "--ledger", str(ledger)
        )
        assert code == 0, out
        for _ in range(2):
            r = httpx.post(proxy.url + CHAT, json=chat(1), headers=headers, timeout=30)
            assert r.status_code == 402, r.text
        code, out = cli(capsys, "budget", "set", "team", "--no-limit", "--ledger", str(ledger))
        assert code == 0, out
        moved = archive(ledger, capsys)
        assert (moved["calls"], moved["keys"]) == (2, 0)
        r = httpx.post(proxy.url + CHAT, json=chat(1), headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        assert len(fake.receipts()) == 1
        code, report = cli(capsys, "verify", "--ledger", str(ledger))
        assert code == 0, report["problems"]


def test_a_call_inside_its_providers_idempotency_window_is_not_archived(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A completed call to a provider that deduplicates keys for 24 h (send_email) stays
    live while inside that window, holding the cut; the call before it leaves."""
    ledger = tmp_path / "ledger.db"
    with (
        fake_provider(tmp_path / "receipts.jsonl", idempotent=True) as fake,
        running_proxy(ledger, upstreams={"openai": fake.url, "send_email": fake.url}) as proxy,
    ):
        before = httpx.post(proxy.url + CHAT, json=chat(0), timeout=30)
        email = {"to": "a@example.com", "subject": "hello", "body": "hi"}
        sent = httpx.post(
            proxy.url + SEND, json=email, headers={"Idempotency-Key": "mail-1"}, timeout=30
        )
        after = httpx.post(proxy.url + CHAT, json=chat(1), timeout=30)
        assert [r.status_code for r in (before, sent, after)] == [200, 200, 200]
        call_id = sent.headers["effectguard-call-id"]
        moved = archive(ledger, capsys)
        assert moved["calls"] == 1
        assert (moved["held_by"], moved["held_because"]) == (
            call_id,
            "inside its provider's idempotency window",
        )
        live = call_stages(ledger)
        assert live[call_id] == "completed" and len(live) == 2
        said = archive_text(ledger, capsys)
        assert "resolve it" not in said and "once that window has passed" in said, said
        assert before.headers["effectguard-call-id"] not in live
        code, report = cli(capsys, "verify", "--ledger", str(ledger))
        assert code == 0, report["problems"]


@pytest.mark.parametrize("keyed", [False, True])
def test_a_call_the_provider_refused_does_not_hold_the_cut(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], keyed: bool
) -> None:
    """A request the provider answered 400 (``not_processed``) had no effect, so it is
    archived with the calls around it instead of holding every later call live for ever
    (an SDK's 400s and 429s are routine). Under a key, a resend once resumed it; the
    call's key is kept, and a resend after the archive answers 409 ``archived``, nothing
    sent, while the same request under a new key is new work. Kept live until its key
    came again, one such call held the cut for ever, and no command could release it."""
    ledger = tmp_path / "ledger.db"
    key = {"Idempotency-Key": "order-1"} if keyed else {}
    with (
        fake_provider(tmp_path / "refusing.jsonl", error_status=400) as refusing,
        running_proxy(ledger, upstreams={"openai": refusing.url}) as proxy,
    ):
        refused = httpx.post(proxy.url + CHAT, json=chat(0), headers=key, timeout=30)
        assert refused.status_code == 400, refused.text
    with (
        fake_provider(tmp_path / "receipts.jsonl") as fake,
        running_proxy(ledger, upstreams={"openai": fake.url}) as proxy,
    ):
        send_chats(proxy, [1])
    assert call_stages(ledger)[refused.headers["effectguard-call-id"]] == "not_processed"
    moved = archive(ledger, capsys)
    assert (moved["calls"], moved["keys"], moved["held_by"]) == (2, int(keyed), None), moved
    assert call_stages(ledger) == {}
    code, report = cli(capsys, "verify", "--ledger", str(ledger))
    assert code == 0, report["problems"]
    code, report = cli(capsys, "verify", "--archive", moved["path"], "--ledger", str(ledger))
    assert code == 0 and report["calls"] == 2, report["problems"]
    if not keyed:
        return
    with (
        fake_provider(tmp_path / "receipts.jsonl") as fake,
        running_proxy(ledger, upstreams={"openai": fake.url}) as proxy,
    ):
        again = httpx.post(proxy.url + CHAT, json=chat(0), headers=key, timeout=30)
        fresh = httpx.post(
            proxy.url + CHAT, json=chat(0), headers={"Idempotency-Key": "order-2"}, timeout=30
        )
        effects = len(fake.effects())
    assert again.status_code == 409 and again.json()["error"]["type"] == "archived", again.text
    assert again.headers["effectguard-call-id"] == refused.headers["effectguard-call-id"]
    assert fresh.status_code == 200, fresh.text
    assert effects == 2  # the chat before the archive, and the new key's


def archive_text(ledger: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """What ``effectguard archive`` prints without ``--json``: what holds the cut, and
    what an operator can do about it (nothing to resolve for a call that is not
    unresolved: ``archive`` once told them to resolve it all the same)."""
    capsys.readouterr()
    assert main(["archive", "--ledger", str(ledger), "--before", later()]) == 0
    return capsys.readouterr().out


def test_what_409_archived_tells_an_operator_to_run_works(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The 409 ``archived`` answer told the operator to ``effectguard show`` the call,
    which then said only "no call ... in the ledger": an archived call is not there. The
    answer now points at the archive, and ``show`` says where an archived call went."""
    ledger = tmp_path / "ledger.db"
    headers = {"Idempotency-Key": "order-1"}
    with (
        fake_provider(tmp_path / "receipts.jsonl") as fake,
        running_proxy(ledger, upstreams={"openai": fake.url}) as proxy,
    ):
        first = httpx.post(proxy.url + CHAT, json=chat(1), headers=headers, timeout=30)
        assert first.status_code == 200, first.text
        assert archive(ledger, capsys)["calls"] == 1
        again = httpx.post(proxy.url + CHAT, json=chat(1), headers=headers, timeout=30)
    assert again.status_code == 409 and again.json()["error"]["type"] == "archived"
    message = again.json()["error"]["message"]
    assert "effectguard show" not in message and "archive" in message, message
    call_id = first.headers["effectguard-call-id"]
    capsys.readouterr()
    assert main(["show", call_id, "--ledger", str(ledger)]) == 3
    err = capsys.readouterr().err
    assert f"no call '{call_id}' in the ledger" in err and "archive" in err, err


@pytest.mark.parametrize("tamper", ["edit", "delete"])
def test_tampering_with_the_live_checkpoint_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tamper: str
) -> None:
    """On SQLite, the ledger.archived checkpoint the live chain starts from, edited or
    deleted (the events table's triggers dropped, as an intruder would), fails verify
    naming it."""
    ledger = tmp_path / "ledger.db"
    with (
        fake_provider(tmp_path / "receipts.jsonl") as fake,
        running_proxy(ledger, upstreams={"openai": fake.url}) as proxy,
    ):
        send_chats(proxy, range(2))
        moved = archive(ledger, capsys)
        assert moved["calls"] == 2, moved
        send_chats(proxy, [2])
    mark = moved["checkpoint_seq"]
    code, report = cli(capsys, "verify", "--ledger", str(ledger))
    assert code == 0, report["problems"]
    conn = sqlite3.connect(ledger, isolation_level=None)
    try:
        conn.execute("DROP TRIGGER events_no_update")
        conn.execute("DROP TRIGGER events_no_delete")
        if tamper == "edit":  # one more archived event than it archived
            conn.execute(
                "UPDATE events SET data = json_set(data, '$.events', json_extract(data, "
                "'$.events') + 1) WHERE seq = ?",
                (mark,),
            )
        else:
            conn.execute("DELETE FROM events WHERE seq = ?", (mark,))
        # The first event of the first row (which may be a record: ledger/sqliterecords).
        first = conn.execute(
            f"SELECT {sqliteevents.first_seq()} FROM events e ORDER BY seq LIMIT 1"
        ).fetchone()[0]
    finally:
        conn.close()
    code, report = cli(capsys, "verify", "--ledger", str(ledger))
    assert code == 1
    if tamper == "edit":
        assert report["first_broken_seq"] == mark
        assert report["problems"][0] == f"event {mark}: digest does not match its content"
    else:
        assert report["first_broken_seq"] == first
        assert report["problems"][0] == (
            f"event {first}: the live chain starts at event {first}, but no ledger.archived "
            f"checkpoint says the events through {first - 1} were archived: the last "
            "archive's checkpoint is missing (deleted, or edited to name another range)"
        )
