"""The operator's night, as docs/operations.md tells it: what the commands say.

A proxy crashes with calls in flight (``EFFECTGUARD_CRASH_AT``); the operator follows
"Reconciling an unknown call, step by step" with the CLI alone. These tests hold the
commands to telling that operator what happened and what to do next. Effects are counted
from the fake provider's receipt log only.
"""

from __future__ import annotations

import html
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
from toolkit import cli_json, cli_run

from effectguard.testing import FakeProvider, fake_provider, start_proxy

pytestmark = pytest.mark.slow

#: A tool provider of the operator's own, declared idempotent (docs/contract.md §2), with
#: the provider-wide lookup ``reconcile --auto`` asks.
MAILER = """
name = "mailer"
base_url = "http://127.0.0.1:9"
dialect = "flat"
prices_taken = "2026-12-01"
not_processed = [400, 429]
lookup = "{base_url}/ops/{key}"

[transient]
500 = "unknown"
502 = "unknown"
503 = "unknown"
504 = "unknown"

[[endpoints]]
path = "/v1/send"
effect = "idempotent"
idempotency = { header = "Idempotency-Key", window_seconds = 86400 }

[models.default]
per_call = "0.002"
max_output_tokens = 0
"""


def declare_mailer(tmp_path: Path) -> Path:
    """A ``--providers`` directory holding the mailer's declaration."""
    folder = tmp_path / "providers"
    folder.mkdir()
    (folder / "mailer.toml").write_text(MAILER)
    return folder


def crash_mid_send(ledger: Path, fake: FakeProvider, providers: Path, key: str) -> None:
    """One keyed email through a proxy that dies once the provider has answered."""
    proxy = start_proxy(
        ledger,
        upstreams={"mailer": fake.url},
        args=("--providers", str(providers)),
        env={"EFFECTGUARD_CRASH_AT": "after:dispatch"},
    )
    try:
        with pytest.raises(httpx.TransportError):
            httpx.post(
                proxy.url + "/mailer/v1/send",
                json={"to": "a@example.com", "subject": "night"},
                headers={"Idempotency-Key": key},
                timeout=30,
            )
        assert proxy.process.wait(15) == -signal.SIGKILL
    finally:
        proxy.kill()


def unknown_calls(ledger: Path) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = cli_json(
        "calls", "--ledger", str(ledger), "--state", "effect_unknown"
    )
    return calls


def test_auto_without_the_providers_flag_says_which_calls_it_could_not_ask(
    tmp_path: Path,
) -> None:
    """README step 5 is `effectguard reconcile --auto`. Run so, without the `--providers`
    that declares the call's provider, it used to answer "no effect-unknown calls with a
    lookup path" and exit 0, while a call of a provider that declares one waited: the
    operator concluded there was nothing to look up. It must name the provider it does not
    know and the flag that loads it; with the flag, the lookup decides the call."""
    ledger = tmp_path / "ledger.db"
    providers = declare_mailer(tmp_path)
    with fake_provider(tmp_path / "receipts.jsonl", idempotent=True) as fake:
        crash_mid_send(ledger, fake, providers, "night-1")
        assert len(fake.effects()) == 1

        bare = cli_run("reconcile", "--auto", "--ledger", str(ledger))
        assert bare.returncode == 0, bare.stderr
        assert "mailer" in bare.stderr and "--providers" in bare.stderr, (
            f"reconcile --auto skipped a call of an undeclared provider in silence: "
            f"stdout {bare.stdout!r}, stderr {bare.stderr!r}"
        )
        (call,) = unknown_calls(ledger)  # nothing was decided, and it says so
        assert call["provider"] == "mailer"
        as_json = cli_run("reconcile", "--auto", "--ledger", str(ledger), "--json")
        assert as_json.stdout.strip() == "[]" and "mailer" in as_json.stderr

        results = cli_json(
            "reconcile",
            "--auto",
            "--ledger",
            str(ledger),
            "--providers",
            str(providers),
            "--upstream",
            f"mailer={fake.url}",
        )
        assert [(r["call_id"], r["result"]) for r in results] == [(call["call_id"], "applied")]
        assert unknown_calls(ledger) == []
        assert len(fake.effects()) == 1


def test_a_decision_about_an_older_attempt_says_nothing_was_decided_and_what_to_do(
    tmp_path: Path,
) -> None:
    """The operator ran `show` (attempt 1), then the client's keyed resend inside the
    window went out as attempt 2 and was cut off too. The `reconcile ... --attempt 1`
    `show` printed is refused, rightly; its message used to be "this evidence is about
    attempt 1 of call C; the call's last attempt is 2": neither that nothing was
    recorded, nor what to do. It must say both, naming the attempt to look at."""
    ledger = tmp_path / "ledger.db"
    providers = declare_mailer(tmp_path)
    with fake_provider(tmp_path / "receipts.jsonl", idempotent=True) as fake:
        crash_mid_send(ledger, fake, providers, "night-2")
        crash_mid_send(ledger, fake, providers, "night-2")  # the keyed resend, attempt 2
        assert len(fake.effects()) == 1  # the provider deduplicated the resend
        (call,) = cli_json("calls", "--ledger", str(ledger))
        assert (call["stage"], call["attempts"]) == ("in_flight", 2), call
        refused = cli_run(
            "reconcile",
            call["call_id"],
            "--ledger",
            str(ledger),
            "--not-applied",
            "--note",
            "no such email",
            "--attempt",
            "1",
        )
        assert refused.returncode == 3, refused.stderr
        message = refused.stderr
        assert "nothing was decided" in message and "attempt 2" in message, message
        assert f"effectguard show {call['call_id']}" in message, message
        (still,) = unknown_calls(ledger)
        assert still["stage"] == "effect_unknown"


def _stale_alert_description() -> str:
    """The shipped `EffectguardUnknownEffectStale` rule's description, as written."""
    rules = (Path(__file__).parent.parent / "grafana" / "prometheus" / "alerts.yml").read_text()
    rule = rules.split("alert: EffectguardUnknownEffectStale", 1)[1].split("- alert:", 1)[0]
    (line,) = [x for x in rule.splitlines() if x.strip().startswith("description:")]
    return line.split("description:", 1)[1].strip().strip('"')


def test_the_pages_description_names_commands_that_run_in_the_runbooks_order(
    tmp_path: Path,
) -> None:
    """The page an operator wakes to is the alert's description. It said `effectguard
    reconcile CALL --applied|--not-applied --note TEXT` (a command no shell runs as
    written) and never `show`, the step that finds a late answer before a decision
    (docs/operations.md, step 3). Every command it names must run as written, with CALL
    replaced by the unknown call's id and the provider label filled in, and `show` must
    come before any decision."""
    ledger = tmp_path / "ledger.db"
    providers = declare_mailer(tmp_path)
    with fake_provider(tmp_path / "receipts.jsonl", idempotent=True) as fake:
        crash_mid_send(ledger, fake, providers, "night-3")
    cli_run("reconcile", "--auto", "--ledger", str(ledger))  # takes the dead worker over
    (call,) = unknown_calls(ledger)
    described = _stale_alert_description().replace("{{ $labels.provider }}", "mailer")
    commands = [c for c in described.split("`")[1::2] if c.startswith("effectguard ")]
    assert any(c.startswith("effectguard show ") for c in commands), described
    for command in commands:
        argv = command.replace("CALL", call["call_id"]).split()[1:]
        done = cli_run(*argv, "--ledger", str(ledger))
        assert done.returncode == 0, f"{command!r} from the alert: {done.stderr}"
        if argv[0] == "calls":
            assert call["call_id"] in done.stdout, done.stdout
        if argv[0] == "show":
            assert f"effectguard reconcile {call['call_id']}" in done.stdout
    (still,) = unknown_calls(ledger)  # what the page names decides nothing by itself
    assert still["call_id"] == call["call_id"]


def test_a_lookup_that_reaches_nothing_says_where_the_call_went(tmp_path: Path) -> None:
    """`reconcile --auto` with `serve`'s `--providers` but not its `--upstream`: the
    lookup goes to the declaration's base URL, where nothing listens. Its note used to be
    "lookup GET URL/ops/C failed: ConnectError", nothing more: the operator could not
    tell that the call had gone elsewhere, nor which `--upstream` to give. The note must
    name where the call's attempts were sent."""
    ledger = tmp_path / "ledger.db"
    providers = declare_mailer(tmp_path)
    with fake_provider(tmp_path / "receipts.jsonl", idempotent=True) as fake:
        crash_mid_send(ledger, fake, providers, "night-4")
        (result,) = cli_json(
            "reconcile", "--auto", "--ledger", str(ledger), "--providers", str(providers)
        )
        assert result["result"] == "unknown"
        assert "failed" in result["note"] and fake.url in result["note"], result["note"]
        (call,) = unknown_calls(ledger)
        assert call["call_id"] == result["call_id"]


def test_the_page_offers_the_keyed_resend_show_offers_first(tmp_path: Path) -> None:
    """A keyed call of a provider with an idempotency window, left unknown by a crash:
    `show` offers first "resend the request with the same Idempotency-Key before T ...,
    which the provider deduplicates", the way to settle it without a guess. The operator
    page offered only "Not applied" and "Applied", so the operator working from the page
    decided by guess. The page must say what `show` says first."""
    from operatorkit import ADMIN_KEY, PAGE, config_text
    from test_reconcile_auto import SEND, crash, email, upstreams

    from effectguard.testing import running_proxy

    ledger = tmp_path / "ledger.db"
    config = tmp_path / "page.toml"
    config.write_text(config_text())
    with fake_provider(tmp_path / "receipts.jsonl", idempotent=True) as fake:
        crash(ledger, fake, "after:dispatch", SEND, email("a@x"), {"Idempotency-Key": "a"})
        with running_proxy(ledger, upstreams=upstreams(fake), args=["--config", str(config)]) as p:
            (call,) = unknown_calls(ledger)
            shown = cli_json("show", call["call_id"], "--ledger", str(ledger))
            first = shown["next_command"].split(" | ")[0]
            assert first.startswith("resend the request with the same Idempotency-Key"), first
            page = httpx.get(
                f"{p.url}{PAGE}calls/{call['call_id']}",
                headers={"authorization": f"Bearer {ADMIN_KEY}"},
            )
            assert page.status_code == 200, page.text
            text = html.unescape(page.text)
            assert first in text, f"the page does not offer {first!r}"
            assert text.index(first) < text.index('id="reconcile-not_applied"')
        assert len(fake.effects()) == 1


def test_show_without_the_providers_flag_says_the_calls_provider_is_not_declared_here(
    tmp_path: Path,
) -> None:
    """`effectguard show CALL` offers `reconcile --auto` for an effect-unknown call only
    when it reads the declaration of the call's provider. Run without the `--providers`
    that declares it (as `serve` was run with), it used to offer nothing and say nothing:
    the operator could not tell "no lookup" from "not known here". It must say on stderr
    that the provider is not declared here and which flag shows its lookup; with the
    flag, it offers `reconcile --auto` and says nothing of the kind."""
    ledger = tmp_path / "ledger.db"
    providers = declare_mailer(tmp_path)
    with fake_provider(tmp_path / "receipts.jsonl", idempotent=True) as fake:
        crash_mid_send(ledger, fake, providers, "night-2")
    # The crashed proxy's call taken over (marked effect unknown), nothing decided.
    assert cli_run("reconcile", "--auto", "--ledger", str(ledger)).returncode == 0
    (call,) = unknown_calls(ledger)

    bare = cli_run("show", call["call_id"], "--ledger", str(ledger))
    assert bare.returncode == 0, bare.stderr
    notes = [line for line in bare.stderr.splitlines() if "mailer" in line]
    assert len(notes) == 1 and "--providers" in notes[0], (
        f"show offered no lookup for an undeclared provider in silence: "
        f"stdout {bare.stdout!r}, stderr {bare.stderr!r}"
    )
    assert "reconcile --auto" not in bare.stdout, bare.stdout
    as_json = cli_run("show", call["call_id"], "--ledger", str(ledger), "--json")
    assert as_json.returncode == 0 and "mailer" in as_json.stderr, as_json.stderr

    flagged = cli_run(
        "show", call["call_id"], "--ledger", str(ledger), "--providers", str(providers)
    )
    assert flagged.returncode == 0, flagged.stderr
    assert "reconcile --auto" in flagged.stdout, flagged.stdout
    assert "not declared" not in flagged.stderr, flagged.stderr
