"""The ``effectguard`` command (docs/contract.md §8) on a ledger written by real guarded traffic.

Traffic goes through ``AsyncGuardTransport`` to a respx-mocked OpenAI: completed
calls, and effect-unknown calls made by an upstream ``ReadTimeout``. Commands run
in-process through ``effectguard.ops.cli.main`` (the entry point's own code) where
output is checked, and as subprocesses where the process exit code and ``--help``
are the point.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import getpass
import json
import re
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx

from effectguard import AsyncGuardTransport, GuardSettings
from effectguard.ops.cli import build_parser, main
from effectguard.providers import load_providers
from effectguard.rules.money import nanos_to_usd
from effectguard.rules.usage import Usage, cost, estimate

CHAT_URL = "https://api.openai.com/v1/chat/completions"
MODEL = "gpt-4o-mini"
PRICE = load_providers()["openai"].price_for(MODEL)
assert PRICE is not None
USAGE = Usage(10, 5)
CONTRACT = Path(__file__).resolve().parent.parent / "docs" / "contract.md"
MONEY = re.compile(r"^\d+\.\d+$")
CALL_FIELDS = {
    "call_id",
    "idempotency_key",
    "stage",
    "effect",
    "next_operation",
    "budget",
    "provider",
    "model",
    "attempts",
    "reserved_usd",
    "cost_usd",
    "held_usd",
}
BUDGET_FIELDS = {"path", "limit_usd", "reserved_usd", "spent_usd", "held_usd"}
ZERO = "0.000000000"


def chat_request(content: str) -> dict[str, Any]:
    """A chat completion request body."""
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 10}


def reserve_usd(content: str) -> str:
    """The reservation of ``chat_request(content)``, as the CLI prints it."""
    assert PRICE is not None
    return nanos_to_usd(estimate(PRICE, chat_request(content)))


COST_USD = nanos_to_usd(cost(PRICE, USAGE))


@dataclass
class Traffic:
    """A ledger and the calls written to it."""

    ledger: str
    completed: list[str]  # budgets team-a/run-1, then default
    unknown: list[str]  # budget team-a/run-2, prompts "timeout 0", "timeout 1", ...


def _answer(request: httpx.Request) -> httpx.Response:
    if b"timeout" in request.content:
        raise httpx.ReadTimeout("upstream read timed out", request=request)
    usage = {
        "prompt_tokens": USAGE.input_tokens,
        "completion_tokens": USAGE.output_tokens,
        "total_tokens": USAGE.input_tokens + USAGE.output_tokens,
    }
    return httpx.Response(
        200,
        json={
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "hi"},
                    "finish_reason": "stop",
                }
            ],
            "usage": usage,
        },
    )


async def _traffic(ledger: str, unknown: int) -> Traffic:
    plan = [("team-a/run-1", "done 0", 200), ("default", "done 1", 200)]
    plan += [("team-a/run-2", f"timeout {i}", 504) for i in range(unknown)]
    ids: list[str] = []
    with respx.mock(assert_all_called=True) as mock:
        mock.post(CHAT_URL).mock(side_effect=_answer)
        transport = AsyncGuardTransport(
            ledger=ledger, settings=GuardSettings(retry_wait_s=0, retry_wait_max_s=0)
        )
        async with httpx.AsyncClient(transport=transport, timeout=10) as client:
            for budget, content, status in plan:
                response = await client.post(
                    CHAT_URL, json=chat_request(content), headers={"Effectguard-Budget": budget}
                )
                assert response.status_code == status, response.text
                ids.append(response.headers["effectguard-call-id"])
    return Traffic(ledger, ids[:2], ids[2:])


@pytest.fixture
def traffic(tmp_path: Path) -> Traffic:
    """A ledger with two completed calls and three effect-unknown calls."""
    return asyncio.run(asyncio.wait_for(_traffic(str(tmp_path / "l.db"), 3), timeout=30))


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``effectguard ARGV`` in-process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse usage errors
        code = exc.code if isinstance(exc.code, int) else 2
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    """``effectguard ARGV --json`` in-process; must exit 0."""
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def calls(capsys: pytest.CaptureFixture[str], t: Traffic) -> dict[str, dict[str, Any]]:
    """``calls --json`` keyed by call id."""
    return {c["call_id"]: c for c in run_json(capsys, "calls", "--ledger", t.ledger)}


def budgets(capsys: pytest.CaptureFixture[str], t: Traffic) -> dict[str, dict[str, Any]]:
    """``budgets --json`` keyed by path."""
    return {b["path"]: b for b in run_json(capsys, "budgets", "--ledger", t.ledger)}


def subprocess_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """``effectguard ARGV`` as a real process (bounded in time)."""
    return subprocess.run(
        [sys.executable, "-m", "effectguard", *argv],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


# -- help ----------------------------------------------------------------------------------------
def _commands(
    parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], argparse.ArgumentParser, str | None]]:
    """Every (sub)command path under ``parser``, its parser and its help string."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                path = (*prefix, name)
                found.append((path, sub, helps.get(name)))
                found += _commands(sub, path)
    return found


COMMANDS = _commands(build_parser())
LEAVES = [
    path
    for path, sub, _ in COMMANDS
    if not any(isinstance(a, argparse._SubParsersAction) for a in sub._actions)
]


def test_the_parser_has_every_spec_command() -> None:
    """The contract.md §8/§11 commands exist (so the walks below cannot pass on an empty parser)."""
    paths = {" ".join(path) for path, _, _ in COMMANDS}
    assert paths >= {
        "serve",
        "fake-provider",
        "calls",
        "show",
        "reconcile",
        "budgets",
        "budget",
        "budget set",
        "verify",
        "key",
        "key new",
    }


def test_every_command_and_option_has_help_text() -> None:
    """Each command, subcommand and option carries a help string and a description."""
    for path, sub, help_text in COMMANDS:
        assert help_text and help_text.strip(), f"{' '.join(path)}: no help"
        assert sub.description and sub.description.strip(), f"{' '.join(path)}: no description"
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            assert action.help and action.help.strip(), f"{' '.join(path)} {action.dest}: no help"


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["key", "new", "--root", "a b"], "effectguard key new"),
        (["key", "new", "--admin", "\x1b"], "effectguard key new"),
        (["budget", "set", "a", "--limit", "1", "--no-limit"], "effectguard budget set"),
    ],
)
def test_a_problem_found_after_parsing_shows_the_commands_own_usage(
    capsys: pytest.CaptureFixture[str], argv: list[str], usage: str
) -> None:
    """A usage problem a command checks after argparse (a bad budget root, two exclusive
    flags) is exit 2 under that command's usage line, as argparse's own errors are."""
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert err.startswith(f"usage: {usage} ") and f"\n{usage}: error: " in err, err


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["sim"], ["default 1 on SQLite, 3 on PostgreSQL"]),
        (["budgets"], ["YYYY-MM-DD", "YYYY-Www", "YYYY-MM", "total"]),
        (["calls"], ["90s, 30m, 2h, 7d, 2w"]),
        (["budget", "set"], ["total: never; the default"]),
    ],
)
def test_help_states_the_defaults_and_forms_the_code_takes(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    needles: list[str],
) -> None:
    """sim's replica default, budgets --period's label forms, the durations --since takes
    and budget set --period's default are the ones the code uses."""
    monkeypatch.setenv("COLUMNS", "400")  # argparse would break YYYY-Www at its hyphen
    code, out, _ = run(capsys, *argv, "--help")
    assert code == 0
    flat = " ".join(out.split())
    assert all(needle in flat for needle in needles), flat


def test_every_command_help_exits_0() -> None:
    """``effectguard CMD --help`` prints usage and exits 0 for every (sub)command."""
    argvs = [[], *([*path] for path, _, _ in COMMANDS)]
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "effectguard", *argv, "--help"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for argv in argvs
    ]
    try:
        for argv, process in zip(argvs, processes, strict=True):
            out, err = process.communicate(timeout=30)
            assert process.returncode == 0, (argv, err)
            assert out.startswith("usage: effectguard"), (argv, out)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def test_every_command_is_in_the_contract_docs() -> None:
    """docs/contract.md documents every command as ``effectguard CMD`` (leaves: ``budget set``)."""
    assert CONTRACT.is_file(), f"{CONTRACT} is missing"
    text = CONTRACT.read_text()
    missing = [" ".join(p) for p in LEAVES if f"effectguard {' '.join(p)}" not in text]
    assert not missing, f"docs/contract.md does not mention: {missing}"


def _docs_section(name: str, start: str, end: str) -> str:
    text = (CONTRACT.parent / name).read_text()
    return text[text.index(start) : text.index(end) if end else len(text)]


def test_every_option_is_in_its_commands_docs() -> None:
    """Each flag of each command is named where that command is documented: contract §8
    (serve: §1.1; fake-provider: §11.2; bench: performance.md). A flag missing there is
    one an operator reading the reference cannot know of (``sim --lookups`` was)."""
    sections = {
        "serve": _docs_section("contract.md", "### §1.1 The proxy", "### §1.2"),
        "fake-provider": _docs_section("contract.md", "### §11.2 The fake provider", "### §11.3"),
        "bench": _docs_section("performance.md", "", ""),
    }
    rest = _docs_section("contract.md", "## §8 The command line", "## §9 Errors")
    missing = {
        " ".join(path): [o for o in options if o not in sections.get(path[0], rest)]
        for path, sub, _ in COMMANDS
        for options in [
            [o for a in sub._actions for o in a.option_strings if o not in ("-h", "--help")]
        ]
    }
    assert not {cmd: opts for cmd, opts in missing.items() if opts}


# -- calls and show --------------------------------------------------------------------------------
def test_calls_json_has_spec_fields_and_exact_money(
    traffic: Traffic, capsys: pytest.CaptureFixture[str]
) -> None:
    """``calls --json``: contract.md §8 fields, money as decimal strings, values from traffic."""
    rows = calls(capsys, traffic)
    assert set(rows) == {*traffic.completed, *traffic.unknown}
    for row in rows.values():
        assert set(row) >= CALL_FIELDS
        for field in ("reserved_usd", "held_usd"):
            assert isinstance(row[field], str) and MONEY.match(row[field]), row
        assert row["provider"] == "openai" and row["model"] == MODEL
        assert row["attempts"] == 1 and row["idempotency_key"] is None
    done = rows[traffic.completed[0]]
    assert (done["stage"], done["effect"], done["next_operation"]) == (
        "completed",
        "applied",
        "none",
    )
    assert done["budget"] == "team-a/run-1"
    assert done["reserved_usd"] == reserve_usd("done 0")
    assert done["cost_usd"] == COST_USD
    assert done["held_usd"] == ZERO
    unknown = rows[traffic.unknown[0]]
    assert (unknown["stage"], unknown["effect"], unknown["next_operation"]) == (
        "effect_unknown",
        "unknown",
        "reconcile",
    )
    assert unknown["cost_usd"] is None
    assert unknown["held_usd"] == unknown["reserved_usd"] == reserve_usd("timeout 0")


def test_calls_filters_by_state_and_budget(
    traffic: Traffic, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--state`` picks one stage; ``--budget`` picks a subtree."""
    ledger = ("--ledger", traffic.ledger)
    unknown = run_json(capsys, "calls", "--state", "effect_unknown", *ledger)
    assert sorted(c["call_id"] for c in unknown) == sorted(traffic.unknown)
    completed = run_json(capsys, "calls", "--state", "completed", *ledger)
    assert sorted(c["call_id"] for c in completed) == sorted(traffic.completed)
    team = run_json(capsys, "calls", "--budget", "team-a", *ledger)
    assert sorted(c["call_id"] for c in team) == sorted([traffic.completed[0], *traffic.unknown])
    assert (
        run_json(capsys, "calls", "--budget", "team-a/run-1", *ledger)[0]["call_id"]
        == (traffic.completed[0])
    )
    assert run_json(capsys, "calls", "--state", "in_flight", *ledger) == []


def test_calls_prints_a_table_by_default(
    traffic: Traffic, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without ``--json``, ``calls`` prints a human table with a header and one row per call."""
    code, out, _ = run(capsys, "calls", "--ledger", traffic.ledger)
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[0].split()[:4] == ["CREATED", "AGE", "CALL_ID", "STAGE"]
    assert "RESERVED_USD" in lines[0]
    assert len(lines) == 1 + 5
    for call_id in (*traffic.completed, *traffic.unknown):
        assert sum(call_id in line for line in lines) == 1
    with pytest.raises(json.JSONDecodeError):
        json.loads(out)


def test_show_json_lists_the_events(traffic: Traffic, capsys: pytest.CaptureFixture[str]) -> None:
    """``show --json``: the call's contract fields plus its events in order."""
    shown = run_json(capsys, "show", traffic.unknown[0], "--ledger", traffic.ledger)
    assert set(shown) >= CALL_FIELDS | {"events"}
    assert shown["stage"] == "effect_unknown"
    kinds = [e["kind"] for e in shown["events"]]
    assert kinds[:3] == ["call.manifest", "budget.reserved", "attempt.started"]
    assert set(kinds[3:]) == {"attempt.interrupted", "budget.held"}
    seqs = [e["seq"] for e in shown["events"]]
    assert seqs == sorted(seqs)
    done = run_json(capsys, "show", traffic.completed[0], "--ledger", traffic.ledger)
    assert [e["kind"] for e in done["events"]][-3:] == [
        "attempt.observed",
        "budget.settled",
        "call.completed",
    ]


def test_show_prints_text_by_default(traffic: Traffic, capsys: pytest.CaptureFixture[str]) -> None:
    """Without ``--json``, ``show`` prints the state and one line per event."""
    code, out, _ = run(capsys, "show", traffic.completed[0], "--ledger", traffic.ledger)
    assert code == 0
    assert f"call {traffic.completed[0]}" in out
    assert "stage      completed" in out
    assert "call.manifest" in out and "call.completed" in out


def test_show_unknown_call_exits_3(traffic: Traffic, capsys: pytest.CaptureFixture[str]) -> None:
    """``show`` of a call id the ledger does not hold exits 3 with a message."""
    code, _, err = run(capsys, "show", "call_doesnotexist", "--ledger", traffic.ledger)
    assert code == 3
    assert "call_doesnotexist" in err


def test_missing_ledger_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ``--ledger`` path that does not exist exits 2 and creates nothing."""
    missing = tmp_path / "nope.db"
    code, _, err = run(capsys, "calls", "--ledger", str(missing))
    assert code == 2
    assert "no ledger" in err
    assert not missing.exists()


# -- budgets ---------------------------------------------------------------------------------------
def test_budgets_json_charges_every_ancestor(
    traffic: Traffic, capsys: pytest.CaptureFixture[str]
) -> None:
    """``budgets --json``: contract fields; spent and held roll up to each ancestor."""
    nodes = budgets(capsys, traffic)
    assert {"default", "team-a", "team-a/run-1", "team-a/run-2"} <= set(nodes)
    for node in nodes.values():
        assert set(node) >= BUDGET_FIELDS
        for field in ("reserved_usd", "spent_usd", "held_usd"):
            assert MONEY.match(node[field]), node
        assert node["limit_usd"] is None
        assert node["reserved_usd"] == ZERO
    held = sum(Decimal(reserve_usd(f"timeout {i}")) for i in range(3))
    assert nodes["team-a/run-1"]["spent_usd"] == COST_USD
    assert Decimal(nodes["team-a/run-2"]["held_usd"]) == held
    assert Decimal(nodes["team-a"]["held_usd"]) == held
    assert nodes["team-a"]["spent_usd"] == COST_USD
    assert nodes["default"]["spent_usd"] == COST_USD


def test_budgets_under_a_path_lists_its_subtree_only(
    traffic: Traffic, capsys: pytest.CaptureFixture[str]
) -> None:
    """``budgets --under team-a``: that node and its descendants, nothing else; a pattern
    character is a character, not a wildcard."""
    code, out, _ = run(capsys, "budgets", "--ledger", traffic.ledger, "--under", "team-a", "--json")
    assert code == 0
    assert {n["path"] for n in json.loads(out)} == {"team-a", "team-a/run-1", "team-a/run-2"}
    code, out, _ = run(capsys, "budgets", "--ledger", traffic.ledger, "--under", "team-_", "--json")
    assert (code, json.loads(out)) == (0, [])


def test_budgets_prints_a_table_by_default(
    traffic: Traffic, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without ``--json``, ``budgets`` prints a table with one row per node."""
    code, out, _ = run(capsys, "budgets", "--ledger", traffic.ledger)
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[0].split() == [
        "PATH",
        "PERIOD",
        "TZ",
        "LIMIT_USD",
        "RESERVED_USD",
        "SPENT_USD",
        "HELD_USD",
        "RPM",
        "TPM",
        "CONCURRENCY",
    ]
    assert any(line.split()[0] == "team-a/run-2" for line in lines[1:])


def test_budget_set_sets_and_removes_a_limit(
    traffic: Traffic, capsys: pytest.CaptureFixture[str]
) -> None:
    """``budget set PATH --limit USD`` sets an exact limit; ``--no-limit`` removes it."""
    node = run_json(
        capsys, "budget", "set", "team-a", "--limit", "12.5", "--ledger", traffic.ledger
    )
    assert node["path"] == "team-a" and node["limit_usd"] == "12.500000000"
    assert budgets(capsys, traffic)["team-a"]["limit_usd"] == "12.500000000"
    code, out, _ = run(
        capsys, "budget", "set", "new/node", "--limit", "0.1", "--ledger", traffic.ledger
    )
    assert code == 0 and "new/node" in out and "0.100000000" in out
    run_json(capsys, "budget", "set", "team-a", "--no-limit", "--ledger", traffic.ledger)
    assert budgets(capsys, traffic)["team-a"]["limit_usd"] is None
    code, _, _ = run(capsys, "verify", "--ledger", traffic.ledger)
    assert code == 0


@pytest.mark.parametrize(
    "args",
    [[], ["--limit", "1", "--no-limit"], ["--limit", "-1"], ["--limit", "lots"]],
    ids=["no-limit-flag", "both", "negative", "not-a-number"],
)
def test_budget_set_usage_errors_exit_2(
    traffic: Traffic, capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    """``budget set`` without one valid ``--limit``/``--no-limit`` exits 2, changes nothing."""
    before = budgets(capsys, traffic)
    code, _, err = run(capsys, "budget", "set", "team-a", *args, "--ledger", traffic.ledger)
    assert code == 2
    assert err.strip()
    assert budgets(capsys, traffic) == before


# -- verify ----------------------------------------------------------------------------------------
def test_verify_passes_on_real_traffic(
    traffic: Traffic, capsys: pytest.CaptureFixture[str]
) -> None:
    """``verify`` exits 0 on a ledger written by the guard."""
    report = run_json(capsys, "verify", "--ledger", traffic.ledger)
    assert report["ok"] is True
    assert report["calls"] == 5
    code, out, _ = run(capsys, "verify", "--ledger", traffic.ledger)
    assert code == 0 and out.startswith("ok")


def test_verify_fails_on_a_corrupted_counter(traffic: Traffic) -> None:
    """A budget counter that is not the fold of the events makes ``verify`` exit 1."""
    with sqlite3.connect(traffic.ledger) as db:
        db.execute("UPDATE budget_periods SET spent = spent + 1 WHERE path = 'team-a'")
    result = subprocess_cli("verify", "--ledger", traffic.ledger)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "BROKEN" in result.stdout
    assert "team-a" in result.stdout
    as_json = subprocess_cli("verify", "--json", "--ledger", traffic.ledger)
    assert as_json.returncode == 1
    assert json.loads(as_json.stdout)["ok"] is False


# -- reconcile -------------------------------------------------------------------------------------
def test_reconcile_applied_with_cost_moves_held_to_spent(
    traffic: Traffic, capsys: pytest.CaptureFixture[str]
) -> None:
    """``reconcile --applied --cost 0.5``: held -= R, spent += 0.5 on the node and ancestors."""
    call_id = traffic.unknown[0]
    before = budgets(capsys, traffic)
    held = Decimal(reserve_usd("timeout 0"))
    state = run_json(
        capsys,
        "reconcile",
        call_id,
        "--applied",
        "--cost",
        "0.5",
        "--note",
        "seen on the provider dashboard",
        "--ledger",
        traffic.ledger,
    )
    assert state["stage"] == "reconciled_applied"
    assert state["cost_usd"] == "0.500000000"
    assert state["held_usd"] == ZERO
    after = budgets(capsys, traffic)
    for path in ("team-a", "team-a/run-2"):
        assert Decimal(after[path]["held_usd"]) == Decimal(before[path]["held_usd"]) - held
        assert Decimal(after[path]["spent_usd"]) == (
            Decimal(before[path]["spent_usd"]) + Decimal("0.5")
        )
    assert after["default"] == before["default"]
    row = calls(capsys, traffic)[call_id]
    assert (row["stage"], row["effect"], row["next_operation"]) == (
        "reconciled_applied",
        "applied",
        "none",
    )
    assert run(capsys, "verify", "--ledger", traffic.ledger)[0] == 0


def test_reconcile_applied_without_cost_charges_the_reservation(
    traffic: Traffic, capsys: pytest.CaptureFixture[str]
) -> None:
    """``reconcile --applied`` without ``--cost`` charges C = R."""
    before = budgets(capsys, traffic)["team-a/run-2"]
    run_json(
        capsys,
        "reconcile",
        traffic.unknown[1],
        "--applied",
        "--note",
        "assume the worst",
        "--ledger",
        traffic.ledger,
    )
    after = budgets(capsys, traffic)["team-a/run-2"]
    r = Decimal(reserve_usd("timeout 1"))
    assert Decimal(after["spent_usd"]) == Decimal(before["spent_usd"]) + r
    assert Decimal(after["held_usd"]) == Decimal(before["held_usd"]) - r


def test_reconcile_not_applied_releases_held(
    traffic: Traffic, capsys: pytest.CaptureFixture[str]
) -> None:
    """``reconcile --not-applied``: held -= R, spent unchanged, next operation resend."""
    call_id = traffic.unknown[0]
    before = budgets(capsys, traffic)
    state = run_json(
        capsys,
        "reconcile",
        call_id,
        "--not-applied",
        "--note",
        "not in the logs",
        "--ledger",
        traffic.ledger,
    )
    assert state["stage"] == "reconciled_not_applied"
    assert (state["effect"], state["next_operation"]) == ("none", "resend")
    # The call had no Idempotency-Key: show must not send the operator looking for one.
    shown = run_json(capsys, "show", call_id, "--ledger", traffic.ledger)
    assert "Idempotency-Key: the resend is a new call" in shown["next_command"]
    after = budgets(capsys, traffic)
    held = Decimal(reserve_usd("timeout 0"))
    for path in ("team-a", "team-a/run-2"):
        assert Decimal(after[path]["held_usd"]) == Decimal(before[path]["held_usd"]) - held
        assert after[path]["spent_usd"] == before[path]["spent_usd"]
    assert run(capsys, "verify", "--ledger", traffic.ledger)[0] == 0


def _reconciled_event(capsys: pytest.CaptureFixture[str], t: Traffic, call_id: str) -> Any:
    shown = run_json(capsys, "show", call_id, "--ledger", t.ledger)
    events = [e for e in shown["events"] if e["kind"] == "call.reconciled"]
    assert len(events) == 1, shown["events"]
    return events[0]["data"]


def test_reconcile_by_defaults_to_the_login_name(
    traffic: Traffic, capsys: pytest.CaptureFixture[str]
) -> None:
    """``call.reconciled`` records ``--by``, defaulting to the login name, and the note."""
    run_json(
        capsys,
        "reconcile",
        traffic.unknown[0],
        "--not-applied",
        "--note",
        "n1",
        "--ledger",
        traffic.ledger,
    )
    data = _reconciled_event(capsys, traffic, traffic.unknown[0])
    assert data["by"] == getpass.getuser()
    assert data["note"] == "n1"
    assert data["applied"] is False
    run_json(
        capsys,
        "reconcile",
        traffic.unknown[1],
        "--applied",
        "--note",
        "n2",
        "--by",
        "alice",
        "--ledger",
        traffic.ledger,
    )
    data = _reconciled_event(capsys, traffic, traffic.unknown[1])
    assert (data["by"], data["note"], data["applied"]) == ("alice", "n2", True)


@pytest.mark.parametrize(
    "args",
    [
        ["--applied"],
        ["--not-applied"],
        ["--note", "x"],
        ["--applied", "--not-applied", "--note", "x"],
        ["--not-applied", "--cost", "1", "--note", "x"],
    ],
    ids=["applied-no-note", "not-applied-no-note", "no-decision", "both", "cost-not-applied"],
)
def test_reconcile_usage_errors_exit_2_and_change_nothing(
    traffic: Traffic, capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    """A reconcile missing ``--note`` or a single decision exits 2 and leaves the call unknown."""
    call_id = traffic.unknown[0]
    code, _, err = run(capsys, "reconcile", call_id, *args, "--ledger", traffic.ledger)
    assert code == 2
    assert err.strip()
    assert calls(capsys, traffic)[call_id]["stage"] == "effect_unknown"


def test_reconcile_without_note_exits_2_as_a_process(traffic: Traffic) -> None:
    """The installed command's exit status for a reconcile without ``--note`` is 2."""
    result = subprocess_cli(
        "reconcile", traffic.unknown[0], "--applied", "--ledger", traffic.ledger
    )
    assert result.returncode == 2
    assert "--note" in result.stderr


def test_reconcile_refuses_a_call_that_is_not_effect_unknown(
    traffic: Traffic, capsys: pytest.CaptureFixture[str]
) -> None:
    """Reconciling a completed (or already reconciled) call exits 3 and records nothing."""
    done = traffic.completed[0]
    code, _, err = run(
        capsys, "reconcile", done, "--applied", "--note", "x", "--ledger", traffic.ledger
    )
    assert code == 3
    assert err.strip()
    shown = run_json(capsys, "show", done, "--ledger", traffic.ledger)
    assert "call.reconciled" not in [e["kind"] for e in shown["events"]]
    assert shown["stage"] == "completed"
    run_json(
        capsys,
        "reconcile",
        traffic.unknown[2],
        "--not-applied",
        "--note",
        "x",
        "--ledger",
        traffic.ledger,
    )
    code, _, _ = run(
        capsys,
        "reconcile",
        traffic.unknown[2],
        "--applied",
        "--note",
        "again",
        "--ledger",
        traffic.ledger,
    )
    assert code == 3
    assert calls(capsys, traffic)[traffic.unknown[2]]["stage"] == "reconciled_not_applied"


def test_reconcile_unknown_call_id_exits_3(traffic: Traffic) -> None:
    """Reconciling a call id the ledger does not hold exits 3 (as a real process)."""
    result = subprocess_cli(
        "reconcile", "call_nope", "--applied", "--note", "x", "--ledger", traffic.ledger
    )
    assert result.returncode == 3
    assert "call_nope" in result.stderr


def test_migrate_says_what_it_applied(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``migrate`` said "migrations applied" whatever it did: it now says whether it made
    the ledger, which migrations it applied to an older one, or that none was pending."""
    ledger = str(tmp_path / "l.db")
    code, made, _ = run(capsys, "migrate", "--ledger", ledger)
    assert code == 0 and "created:" in made, made
    last = int(made.rsplit("migration ", 1)[1])
    with sqlite3.connect(ledger) as conn:  # the ledger as the release before wrote it
        conn.execute("DELETE FROM migrations WHERE version = ?", (last,))
        # What the last migration (23) added: a column, and the format-6 refusals (its
        # statements drop and make the triggers anew, so those may stay).
        conn.execute("ALTER TABLE rate_windows DROP COLUMN reached")
    code, upgraded, _ = run(capsys, "migrate", "--ledger", ledger)
    assert code == 0
    assert upgraded.strip() == f"ledger {ledger}: migration {last} applied, now at migration {last}"
    code, again, _ = run(capsys, "migrate", "--ledger", ledger)
    assert code == 0
    assert again.strip() == f"ledger {ledger}: up to date at migration {last}; nothing applied"


def test_a_sqlite_url_is_printed_as_the_files_absolute_path(
    traffic: Traffic, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``migrate --ledger sqlite:///rel.db`` names the file by its absolute path, as for a
    plain relative path (contract §8), and so do the commands ``show`` offers."""
    absolute = Path(traffic.ledger)
    monkeypatch.chdir(absolute.parent)
    url = f"sqlite:///{absolute.name}"
    code, said, _ = run(capsys, "migrate", "--ledger", url)
    assert code == 0 and said.startswith(f"ledger {absolute}: up to date"), said
    shown = run_json(capsys, "show", traffic.unknown[0], "--ledger", url)
    assert f" --ledger {absolute} " in shown["next_command"], shown["next_command"]


def test_a_reader_that_stops_early_is_not_an_error(tmp_path: Path) -> None:
    """``effectguard calls --json | head -c 1``: the CLI stops quietly, exit 0, no traceback."""
    ledger = tmp_path / "l.db"
    assert main(["migrate", "--ledger", str(ledger)]) == 0
    for i in range(300):
        assert main(["budget", "set", f"team-{i}", "--limit", "1", "--ledger", str(ledger)]) == 0
    done = subprocess.run(
        f"{sys.executable} -m effectguard budgets --json --ledger {ledger} | head -c 1",
        shell=True,
        capture_output=True,
        text=True,
        timeout=120,
        executable="/bin/bash",
    )
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


def test_show_prints_what_a_client_chose_with_its_controls_escaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A client chooses its Idempotency-Key and its body, and ``show`` prints both: a C1
    control (U+009B, a terminal's CSI) or a direction override in them reaches the
    operator's terminal as its escape, never as the character itself."""
    ledger = str(tmp_path / "l.db")
    key = "k-\u009b2J-\u202etxt"

    call_id = asyncio.run(_keyed_call(ledger, key, "body \u009d0;title\u0007 \u2066x"))
    code, out, _ = run(capsys, "show", call_id, "--full", "--ledger", ledger)
    assert code == 0
    assert not any(c in out for c in "\u009b\u202e\u009d\u0007\u2066"), repr(out)
    assert "\\x9b" in out and "\\u202e" in out
    shown = run_json(capsys, "show", call_id, "--ledger", ledger)  # JSON: the text as stored
    assert key in json.dumps(shown, ensure_ascii=False)


async def _keyed_call(ledger: str, key: str, content: str) -> str:
    """The id of a chat call of ``content`` sent under Idempotency-Key ``key`` (its bytes
    as they are) through the transport, the provider mocked, answered 200."""
    with respx.mock() as mock:
        mock.post(CHAT_URL).mock(side_effect=_answer)
        transport = AsyncGuardTransport(ledger=ledger)
        async with httpx.AsyncClient(transport=transport, timeout=10) as client:
            response = await client.post(
                CHAT_URL, json=chat_request(content), headers={"Idempotency-Key": key.encode()}
            )
    assert response.status_code == 200, response.text
    return response.headers["effectguard-call-id"]


#: Direction marks (U+200E, U+200F) and zero-width characters (U+200B-U+200D, U+2060,
#: U+FEFF): invisible, and a mark reorders the neutral text around it.
INVISIBLE = "\u200e\u200f\u200b\u200c\u200d\u2060\ufeff"


def test_show_and_calls_escape_direction_marks_and_zero_width_characters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As they escape overrides and isolates, ``show`` and ``calls`` print a direction mark
    or a zero-width character in what a client chose as its escape: two keys that differ
    only by one printed alike, and a mark made a key read other than it is."""
    ledger = str(tmp_path / "l.db")
    key = "k-" + "-".join(INVISIBLE)

    call_id = asyncio.run(_keyed_call(ledger, key, "body " + INVISIBLE))
    for argv in (("show", call_id, "--full"), ("calls",)):
        code, out, _ = run(capsys, *argv, "--ledger", ledger)
        assert code == 0
        assert not any(c in out for c in INVISIBLE), (argv, repr(out))
    code, out, _ = run(capsys, "show", call_id, "--ledger", ledger)
    assert "\\u200e" in out and "\\ufeff" in out, out


def test_ctrl_c_while_the_ledger_is_locked_exits_130_and_changes_nothing(tmp_path: Path) -> None:
    """Ctrl-C during a command that waits for SQLite's write lock (a backup tool holding
    it) is exit 130, as contract §8 lists: it was reported as 'ledger unavailable:
    database is locked', exit 4, sending the operator after a lock they had just
    chosen to stop waiting for.

    The Ctrl-C reaches the child while it waits, whatever the load: it is sent only once
    the child has the ledger open (never on a deadline, which once signalled a child still
    starting), and to the child frozen there, so its 5 s wait cannot run out meanwhile."""
    ledger = tmp_path / "l.db"
    assert main(["migrate", "--ledger", str(ledger)]) == 0
    holder = sqlite3.connect(ledger, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        for _ in range(3):  # a run whose child gave up before it was frozen tested nothing
            process = _frozen_waiting_for_the_lock(ledger)
            if process is not None:
                break
        else:
            pytest.fail("each child gave up waiting for the lock before it could be frozen")
        process.send_signal(signal.SIGINT)  # delivered as it goes on, inside the wait
        process.send_signal(signal.SIGCONT)
        _, err = process.communicate(timeout=60)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert process.returncode == 130, err
    assert "ledger unavailable" not in err, err
    budgets = sqlite3.connect(ledger).execute("SELECT count(*) FROM budgets").fetchone()
    assert budgets == (0,)


def _frozen_waiting_for_the_lock(ledger: Path) -> subprocess.Popen[str] | None:
    """``budget set`` on ``ledger`` in a child, frozen (SIGSTOP) as it waits for the write
    lock this test holds; None if it ended first (this process stood still for the whole
    of the child's 5 s wait).

    The child is ready once it has the ledger open: it waits for the lock from then on, or
    is about to, and a Ctrl-C is handled the same either way. Frozen, it cannot give up:
    SQLite's busy wait counts the sleeps it asked for, not the time that passed."""
    command = [sys.executable, "-m", "effectguard", "budget", "set", "team", "--limit", "5"]
    process = subprocess.Popen(
        [*command, "--ledger", str(ledger)], stderr=subprocess.PIPE, text=True
    )
    proc = Path(f"/proc/{process.pid}")
    deadline = time.monotonic() + 120  # a bound on a hang, not a timing assertion
    while not _has_open(proc, ledger):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"it never opened the ledger: {process.communicate()[1]}")
        time.sleep(0.01)
    process.send_signal(signal.SIGSTOP)
    while _process_state(proc) not in ("T", "Z"):  # stopped, or ended before the signal
        time.sleep(0.01)
    if _process_state(proc) == "T" and _has_open(proc, ledger):
        return process
    process.send_signal(signal.SIGCONT)
    process.communicate(timeout=60)
    return None


def _has_open(proc: Path, path: Path) -> bool:
    """Whether the process at ``proc`` (its /proc directory) has ``path`` open."""
    with contextlib.suppress(OSError):  # the descriptors move while we read them
        return any(fd.resolve() == path.resolve() for fd in (proc / "fd").iterdir())
    return False


def _process_state(proc: Path) -> str:
    """The state letter of the process at ``proc`` (``T`` stopped, ``Z`` ended)."""
    return (proc / "stat").read_text().rpartition(")")[2].split()[0]


#: Runs the CLI as an install without the ``postgres`` extra would: no psycopg to import.
WITHOUT_PSYCOPG = (
    "import sys; sys.modules['psycopg'] = None\n"
    "from effectguard.ops.cli import main\n"
    "sys.exit(main(sys.argv[1:]))"
)


@pytest.mark.parametrize(
    "verb",
    [
        ["calls"],
        ["migrate"],
        ["verify", "--archived"],
        ["archive", "--before", "1d"],
        ["serve", "--port", "0"],
    ],
    ids=lambda v: v[0] if v[0] != "verify" else "verify-archived",
)
def test_a_postgresql_ledger_without_its_driver_says_what_to_install(
    tmp_path: Path, verb: list[str]
) -> None:
    """``pip install effectguard`` has no PostgreSQL driver (it is the ``postgres`` extra):
    a PostgreSQL ledger is then exit 2 naming the extra, not a ModuleNotFoundError
    traceback from deep in the ledger (an upgrade probe met one on every command)."""
    dsn = "postgresql://postgres@127.0.0.1:1/none?schema=nodriver"
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_PSYCOPG, *verb, "--ledger", dsn],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert "needs the psycopg driver" in done.stderr
    assert "pip install 'effectguard[postgres]'" in done.stderr
