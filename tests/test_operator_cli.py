"""``effectguard show`` and ``calls`` as an operator works from them: ISO times, no
Python ``None``, the request, every attempt and why it ended, the money, and the exact
next command; ``calls`` with time and age columns and ``--since``/``--provider``."""

from __future__ import annotations

import asyncio
import json
import re
import shlex
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx
from pgkit import DSN, scratch_schema

from effectguard import AsyncGuardTransport, GuardSettings
from effectguard.ops.cli import main as cli_main

OPENAI = "https://api.openai.com"
CHAT = OPENAI + "/v1/chat/completions"
FAST = GuardSettings(retry_wait_s=0, retry_wait_max_s=0)
ISO = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")


def _chat(content: str) -> dict[str, Any]:
    return {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": content}]}


def _answer() -> dict[str, Any]:
    return {
        "id": "c",
        "object": "chat.completion",
        "model": "gpt-4o-mini",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
    }


def _two_calls(tmp_path: Path, prompt: str) -> tuple[str, str, str]:
    """A completed call and an effect-unknown one (read timeout); their ids and the ledger."""
    return asyncio.run(_make_calls(str(tmp_path / "l.db"), prompt))


async def _make_calls(ledger: str, prompt: str) -> tuple[str, str, str]:
    transport = AsyncGuardTransport(ledger=ledger, settings=FAST)
    with respx.mock() as mock:
        mock.post(CHAT).mock(
            side_effect=[httpx.Response(200, json=_answer()), httpx.ReadTimeout("slow")]
        )
        async with httpx.AsyncClient(transport=transport) as client:
            done = await client.post(CHAT, json=_chat("short"))
            unknown = await client.post(CHAT, json=_chat(prompt))
    await transport.aclose()
    return done.headers["effectguard-call-id"], unknown.headers["effectguard-call-id"], ledger


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    capsys.readouterr()
    assert cli_main(list(argv)) == 0
    return capsys.readouterr().out


def test_show_tells_the_story_of_an_unknown_call(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``show`` prints ISO times, the pretty request (cut unless --full), the attempt's
    interruption reason, the money and the exact reconcile command; never ``None``."""
    long_prompt = "p" * 5000
    _, call_id, ledger = _two_calls(tmp_path, long_prompt)
    text = _run(capsys, "show", call_id, "--ledger", ledger)
    assert "None" not in text
    assert ISO.search(text)
    assert not re.search(r"\b1\d{9}\.\d+", text)  # no raw Unix seconds
    assert '"model": "gpt-4o-mini"' in text  # pretty-printed request
    assert long_prompt not in text and "--full shows all" in text
    assert "interrupted by" in text and "ReadTimeout" in text
    assert "held" in text and "reserved at admission" in text
    # the attempt shown: copied after another attempt began, the command is refused
    decide = f"effectguard reconcile {call_id} --ledger {ledger}"
    assert f"{decide} --applied [--cost USD] --note TEXT --attempt 1" in text
    assert f"{decide} --not-applied --note TEXT --attempt 1" in text
    full = _run(capsys, "show", call_id, "--full", "--ledger", ledger)
    assert long_prompt in full


def test_show_says_a_not_processed_attempt_released_its_reservation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 429 (declared not processed, with no usage) released its reservation and was
    charged nothing: ``show`` says so (it said "settled at the reservation")."""
    ledger = str(tmp_path / "l.db")

    async def busy() -> str:
        transport = AsyncGuardTransport(ledger=ledger, settings=GuardSettings(max_retries=0))
        with respx.mock() as mock:
            mock.post(CHAT).mock(return_value=httpx.Response(429, json={"error": {}}))
            async with httpx.AsyncClient(transport=transport) as client:
                answer = await client.post(CHAT, json=_chat("busy"))
        await transport.aclose()
        assert answer.status_code == 429
        return answer.headers["effectguard-call-id"]

    call_id = asyncio.run(busy())
    text = _run(capsys, "show", call_id, "--ledger", ledger)
    assert "observed 429 (a status the provider declares not processed)" in text
    assert "its reservation released" in text and "settled at the reservation" not in text


def test_show_json_keeps_its_fields_and_adds_iso_times(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``show --json`` keeps the contract fields and events, and adds ISO times, the request,
    the attempts and the next command."""
    done, call_id, ledger = _two_calls(tmp_path, "hi")
    payload = json.loads(_run(capsys, "show", call_id, "--json", "--ledger", ledger))
    for field in ("call_id", "stage", "effect", "next_operation", "events", "created_at"):
        assert field in payload
    assert ISO.fullmatch(payload["created_at_iso"])
    assert all(ISO.fullmatch(e["at_iso"]) for e in payload["events"])
    assert payload["request"]["messages"][0]["content"] == "hi"
    assert payload["attempts_detail"][0]["ended"].startswith("interrupted")
    assert "effectguard reconcile" in payload["next_command"]
    completed = json.loads(_run(capsys, "show", done, "--json", "--ledger", ledger))
    assert completed["next_command"] is None
    assert completed["attempts_detail"][0]["ended"].startswith("observed 200")


def test_calls_has_time_and_age_and_filters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``calls`` shows CREATED (ISO) and AGE; ``--since`` and ``--provider`` filter and
    ``--json`` keeps its fields plus ``created_at_iso``."""
    done, unknown, ledger = _two_calls(tmp_path, "hi")
    text = _run(capsys, "calls", "--ledger", ledger)
    header = text.splitlines()[0].split()
    assert header[:3] == ["CREATED", "AGE", "CALL_ID"]
    assert "None" not in text and len(ISO.findall(text)) == 2
    rows = json.loads(_run(capsys, "calls", "--json", "--since", "1h", "--ledger", ledger))
    assert {r["call_id"] for r in rows} == {done, unknown}
    assert all(ISO.fullmatch(r["created_at_iso"]) and "reserved_usd" in r for r in rows)
    future = json.loads(
        _run(capsys, "calls", "--json", "--since", "2999-01-01", "--ledger", ledger)
    )
    assert future == []
    assert (
        json.loads(_run(capsys, "calls", "--json", "--provider", "anthropic", "--ledger", ledger))
        == []
    )
    one = json.loads(
        _run(capsys, "calls", "--json", "--provider", "openai", "--limit", "1", "--ledger", ledger)
    )
    assert [r["call_id"] for r in one] == [unknown]  # newest first


def test_since_refuses_what_it_cannot_read(capsys: pytest.CaptureFixture[str]) -> None:
    """``--since yesterday`` is a usage error naming the accepted forms."""
    with pytest.raises(SystemExit) as exit_:
        cli_main(["calls", "--since", "yesterday"])
    assert exit_.value.code == 2
    assert "duration" in capsys.readouterr().err


def test_reconcile_with_attempt_decides_only_the_attempt_shown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``reconcile --attempt N`` records the decision only while N is the call's last
    attempt (what ``show`` printed): another number is refused (exit 3, nothing written);
    a number that is no attempt is a usage error (exit 2)."""
    _, unknown, ledger = _two_calls(tmp_path, "which attempt")
    shown = json.loads(_run(capsys, "show", unknown, "--ledger", ledger, "--json"))
    assert shown["attempts"] == 1
    assert shown["next_command"].count("--attempt 1") == 2  # what an operator copies
    decide = ["reconcile", unknown, "--not-applied", "--note", "checked", "--ledger", ledger]
    capsys.readouterr()
    assert cli_main([*decide, "--attempt", "2"]) == 3
    assert "attempt 2" in capsys.readouterr().err
    stage = json.loads(_run(capsys, "show", unknown, "--ledger", ledger, "--json"))["stage"]
    assert stage == "effect_unknown"
    for bad in ("0", "-1", "x"):
        with pytest.raises(SystemExit) as exit_:
            cli_main([*decide, "--attempt", bad])
        assert exit_.value.code == 2
    decided = json.loads(_run(capsys, *decide, "--attempt", "1", "--json"))
    assert decided["stage"] == "reconciled_not_applied"


def _next_commands(text: str) -> list[str]:
    """The commands under ``show``'s ``next`` heading, as an operator copies them."""
    lines = text.split("\nnext\n", 1)[1].splitlines()
    return [line.strip().removeprefix("or ") for line in lines]


@pytest.mark.parametrize("found_by", ["--ledger", "relative", "--config", "environment"])
def test_the_printed_command_decides_the_call_in_the_ledger_shown(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    found_by: str,
) -> None:
    """``show --ledger PATH`` printed its reconcile command without the ledger: copied as
    printed, it went to ``./effectguard.db`` (refused, or another ledger). The command now
    names the ledger ``show`` read, however it was found, quoted for a shell, and run in
    another folder with another environment it decides the call it shows."""
    folder = tmp_path / "a ledger's folder"
    folder.mkdir()
    _, unknown, ledger = asyncio.run(_make_calls(str(folder / "l.db"), "which ledger"))
    config = folder / "serve.toml"
    config.write_text(f"ledger = {json.dumps(ledger)}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(folder if found_by == "relative" else elsewhere)
    monkeypatch.setenv("EFFECTGUARD_LEDGER", ledger)
    where = {
        "--ledger": ["--ledger", ledger],
        "relative": ["--ledger", "l.db"],
        "--config": ["--config", str(config)],
    }
    text = _run(capsys, "show", unknown, *where.get(found_by, []))
    monkeypatch.delenv("EFFECTGUARD_LEDGER")
    monkeypatch.chdir(elsewhere)
    printed = _next_commands(text)
    argv = shlex.split(next(c for c in printed if "--not-applied" in c).replace("TEXT", "ok"))
    assert argv[:3] == ["effectguard", "reconcile", unknown]
    assert json.loads(_run(capsys, *argv[1:], "--json"))["stage"] == "reconciled_not_applied"
    assert not (elsewhere / "effectguard.db").exists()


@pytest.mark.skipif(not DSN or "://postgres@" not in DSN, reason="needs a password-less DSN")
def test_the_printed_command_names_a_postgres_ledger_without_its_password(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A DSN's password is never printed: the command shows ``***`` in its place."""
    with scratch_schema() as url:
        secret = url.replace("://postgres@", "://postgres:s3cret-pw@", 1)  # trust auth
        _, unknown, _ = asyncio.run(_make_calls(secret, "which ledger"))
        text = _run(capsys, "show", unknown, "--ledger", secret)
        shown = json.loads(_run(capsys, "show", unknown, "--ledger", secret, "--json"))
    assert "s3cret-pw" not in text + json.dumps(shown)
    masked = shlex.quote(secret.replace("s3cret-pw", "***"))
    assert all(f"{unknown} --ledger {masked}" in c for c in _next_commands(text))
    assert shown["next_command"].count(f"--ledger {masked}") == 2


@pytest.mark.parametrize(
    "verb", [["--resend", "--note", "accept a duplicate"], ["--accept-evidence"]]
)
def test_attempt_guards_a_resend_and_an_evidence_decision_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], verb: list[str]
) -> None:
    """``--attempt N`` with ``--resend`` or ``--accept-evidence`` was dropped without a
    word: a resend was authorized for whatever attempt the call had reached. Both are
    about the attempt a person examined, so another number is refused (exit 3, naming
    the attempt) and nothing is written."""
    _, unknown, ledger = _two_calls(tmp_path, "which attempt again")
    capsys.readouterr()
    assert cli_main(["reconcile", unknown, *verb, "--attempt", "2", "--ledger", ledger]) == 3
    assert "attempt 2" in capsys.readouterr().err
    shown = json.loads(_run(capsys, "show", unknown, "--ledger", ledger, "--json"))
    assert shown["stage"] == "effect_unknown"
    assert "call.resend_authorized" not in [e["kind"] for e in shown["events"]]


@pytest.mark.parametrize("extra", [["--attempt", "1"], ["--by", "bob"]])
def test_auto_refuses_what_only_a_person_decision_takes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str]
) -> None:
    """``reconcile --auto`` decides every call by its lookup and records ``by`` as
    ``lookup:<provider>``: an ``--attempt`` or ``--by`` given with it was ignored. It is a
    usage error (exit 2), as ``--note`` is."""
    _, _, ledger = _two_calls(tmp_path, "auto")
    capsys.readouterr()
    assert cli_main(["reconcile", "--auto", *extra, "--ledger", ledger]) == 2
    assert extra[0] in capsys.readouterr().err
