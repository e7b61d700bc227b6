"""``effectguard key new | list | revoke`` and ``--config`` on every ledger command."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from effectguard.config.settings import hash_key
from effectguard.ops.cli import main

KEY = re.compile(r"eg-[A-Za-z0-9_-]{32}")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``effectguard ARGV`` in this process: exit code, stdout, stderr."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def ledger(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """A migrated, empty SQLite ledger."""
    path = str(tmp_path / "l.db")
    assert run(capsys, "migrate", "--ledger", path)[0] == 0
    return path


def ledger_bytes(path: str) -> bytes:
    """The ledger file and its WAL, as stored on disk."""
    return b"".join(p.read_bytes() for p in Path(path).parent.glob(Path(path).name + "*"))


def test_key_new_prints_the_key_once_and_stores_only_its_hash(
    ledger: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """key new prints the key; the ledger holds its SHA-256 and never the key itself."""
    code, out, _ = run(capsys, "key", "new", "--root", "team-a", "--name", "ci", "--ledger", ledger)
    assert code == 0
    keys = KEY.findall(out)
    assert len(set(keys)) == 1
    stored = ledger_bytes(ledger)
    assert keys[0].encode() not in stored
    assert hash_key(keys[0]).encode() in stored


def test_key_list_shows_status_and_restrictions_but_no_hash(
    ledger: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """key list --json: name, root, status, times, restrictions; a revoked key says so."""
    code, out, _ = run(
        capsys,
        *("key", "new", "--root", "team-a", "--name", "a", "--ledger", ledger, "--json"),
        *("--models", "gpt-4o-mini,gpt-4o", "--providers", "openai", "--expires", "2099-01-31"),
    )
    assert code == 0
    made = json.loads(out)
    assert run(capsys, "key", "new", "--root", "team-b", "--name", "b", "--ledger", ledger)[0] == 0
    assert run(capsys, "key", "revoke", "b", "--ledger", ledger)[0] == 0
    code, out, _ = run(capsys, "key", "list", "--ledger", ledger, "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["a"] == {
        "name": "a",
        "budget_root": "team-a",
        "status": "active",
        "created_at": rows["a"]["created_at"],
        "expires_at": "2099-01-31T00:00:00Z",
        "revoked_at": None,
        "models": ["gpt-4o-mini", "gpt-4o"],
        "providers": ["openai"],
    }
    assert rows["b"]["status"] == "revoked" and rows["b"]["revoked_at"] is not None
    # key new --json is the key and its key list row (docs/contract.md §8), no digest.
    assert {k: v for k, v in made.items() if k != "key"} == rows["a"]
    assert hash_key(made["key"]) not in out
    code, text, _ = run(capsys, "key", "list", "--ledger", ledger)
    assert code == 0 and "revoked" in text and "gpt-4o-mini,gpt-4o" in text


def test_key_changes_the_ledger_refuses_exit_3(
    ledger: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Revoking an unknown or revoked key, or reusing a live name, exits 3 and says why."""
    assert run(capsys, "key", "new", "--root", "team-a", "--name", "a", "--ledger", ledger)[0] == 0
    code, _, err = run(capsys, "key", "new", "--root", "team-a", "--name", "a", "--ledger", ledger)
    assert code == 3 and "in use" in err
    code, _, err = run(capsys, "key", "revoke", "nobody", "--ledger", ledger)
    assert code == 3 and "no key named 'nobody'" in err
    assert run(capsys, "key", "revoke", "a", "--ledger", ledger)[0] == 0
    code, _, err = run(capsys, "key", "revoke", "a", "--ledger", ledger)
    assert code == 3 and "already revoked" in err
    assert run(capsys, "verify", "--ledger", ledger)[0] == 0


def test_key_new_refuses_a_bad_expiry_or_name(
    ledger: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An unreadable --expires or a bad --name is a usage error (exit 2), nothing written."""
    for extra in (["--expires", "soon"], ["--name", "a b"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["key", "new", "--root", "team-a", "--ledger", ledger, *extra])
        assert exit_info.value.code == 2, extra
    capsys.readouterr()
    assert json.loads(run(capsys, "key", "list", "--ledger", ledger, "--json")[1]) == []


def test_key_new_with_expiry_in_the_past_is_refused(
    ledger: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A key that would be born expired is refused by the ledger (exit 3), nothing written."""
    code, _, err = run(
        capsys, "key", "new", "--root", "team-a", "--expires", "2001-01-01", "--ledger", ledger
    )
    assert code == 3 and "not in the future" in err
    assert json.loads(run(capsys, "key", "list", "--ledger", ledger, "--json")[1]) == []


def test_key_new_print_config_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--print-config prints [[keys]] lines for the config file and needs no ledger."""
    code, out, _ = run(capsys, "key", "new", "--root", "team-a", "--print-config")
    assert code == 0
    key = KEY.findall(out)[0]
    assert f'sha256 = "{hash_key(key)}"' in out and 'budget_root = "team-a"' in out
    assert not list(tmp_path.iterdir())


def test_every_ledger_command_finds_serves_ledger_through_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--config FILE reads the config's ledger = ...; --ledger still wins over it."""
    theirs, other = str(tmp_path / "serve.db"), str(tmp_path / "other.db")
    config = tmp_path / "effectguard.toml"
    config.write_text(f'ledger = "{theirs}"\n\n[budgets]\n"team-a" = "5.00"\n')
    assert run(capsys, "migrate", "--config", str(config))[0] == 0
    assert run(capsys, "migrate", "--ledger", other)[0] == 0
    assert Path(theirs).exists()
    assert run(capsys, "budget", "set", "team-a", "--limit", "7", "--config", str(config))[0] == 0
    assert run(capsys, "key", "new", "--root", "team-a", "--config", str(config))[0] == 0
    code, out, _ = run(capsys, "budgets", "--config", str(config), "--json")
    assert code == 0 and [n["limit_usd"] for n in json.loads(out)] == ["7.000000000"]
    code, out, _ = run(capsys, "budgets", "--config", str(config), "--ledger", other, "--json")
    assert code == 0 and json.loads(out) == []
    for argv in (["calls"], ["verify"], ["key", "list"]):
        code, out, err = run(capsys, *argv, "--config", str(config))
        assert code == 0, (argv, err)
    assert "team-a" in run(capsys, "key", "list", "--config", str(config))[1]


def test_a_config_without_a_ledger_falls_back_like_serve(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config that names no ledger leaves $EFFECTGUARD_LEDGER (then the default) in charge."""
    config = tmp_path / "c.toml"
    config.write_text("[server]\nport = 9999\n")
    env_ledger = str(tmp_path / "env.db")
    monkeypatch.setenv("EFFECTGUARD_LEDGER", env_ledger)
    assert run(capsys, "migrate", "--config", str(config))[0] == 0
    assert Path(env_ledger).exists()


def test_key_new_admin_prints_operator_page_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--admin NAME prints [[admin.keys]] lines for the operator page and writes nothing."""
    code, out, _ = run(capsys, "key", "new", "--admin", "alice")
    assert code == 0
    key = KEY.findall(out)[0]
    assert '[[admin.keys]]\nname = "alice"' in out and hash_key(key) in out
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", ["Ana 😀", 'O"Brien \\ ops', "Zoë"])
def test_key_new_admin_prints_lines_the_config_reads_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """The printed [[admin.keys]] lines load as they are (an emoji was once written as a
    surrogate-pair escape, which TOML refuses: ``serve`` exited, the key shown once lost)."""
    from effectguard.config.settings import load_settings

    code, out, _ = run(capsys, "key", "new", "--admin", name)
    assert code == 0
    key = KEY.findall(out)[0]
    config = tmp_path / "c.toml"
    config.write_text(out.split("config:\n", 1)[1], encoding="utf-8")
    admin = load_settings(config=config, environ={}).admin
    assert admin.key_for(key) is not None and admin.key_for(key).name == name


@pytest.mark.parametrize("name", ["", "   ", "tab\there", "line\nbreak"])
def test_key_new_admin_refuses_a_name_the_config_would_refuse(
    capsys: pytest.CaptureFixture[str], name: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["key", "new", "--admin", name])
    out, err = capsys.readouterr()
    assert exited.value.code == 2 and "printable, non-empty name" in err
    assert "admin key" not in out  # no key was shown, so none was lost


@pytest.mark.parametrize(
    "extra",
    [
        ["--expires", "2027-01-01"],
        ["--models", "gpt-4o-mini"],
        ["--providers", "openai"],
        ["--name", "bob"],
    ],
)
def test_key_new_admin_refuses_what_an_admin_key_cannot_hold(
    capsys: pytest.CaptureFixture[str], extra: list[str]
) -> None:
    """An operator page key has no expiry, restriction or name besides --admin's: asked for
    one, ``key new --admin`` once printed a key without it (a key meant to expire never
    did) and exited 0. It is a usage error, and no key is shown."""
    with pytest.raises(SystemExit) as exited:
        main(["key", "new", "--admin", "ana", *extra])
    out, err = capsys.readouterr()
    assert exited.value.code == 2 and extra[0] in err, err
    assert "admin key" not in out and not KEY.findall(out)


@pytest.mark.parametrize(
    ("argv", "table"),
    [(["--root", "team-a", "--print-config"], "keys"), (["--admin", "ana"], "admin")],
)
def test_key_new_config_lines_as_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], table: str
) -> None:
    """With --json, ``key new --print-config`` and ``--admin`` print JSON (they printed
    their text, which a script reading JSON cannot parse): the key, its name, its
    digest and the config lines, which load back as they are."""
    from effectguard.config.settings import load_settings

    code, out, _ = run(capsys, "key", "new", *argv, "--json")
    assert code == 0
    shown = json.loads(out)
    assert shown["sha256"] == hash_key(shown["key"])
    config = tmp_path / "c.toml"
    config.write_text(shown["config"], encoding="utf-8")
    settings = load_settings(config=config, environ={})
    if table == "admin":
        assert shown["name"] == "ana" and settings.admin.key_for(shown["key"]) is not None
    else:
        assert (shown["name"], shown["budget_root"]) == ("team-a", "team-a")
        assert [k.budget_root for k in settings.keys] == ["team-a"]


def test_key_new_text_says_what_the_key_may_do(
    ledger: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """key new's text names the key's budget root, models, providers and expiry, so the
    operator can check what was made before handing it over; the key is shown once."""
    argv = ["key", "new", "--root", "team-a", "--name", "ci", "--ledger", ledger]
    code, out, _ = run(
        capsys,
        *argv,
        "--models",
        "gpt-4o-mini,gpt-4o",
        "--providers",
        "openai",
        "--expires",
        "2099-01-31",
    )
    assert code == 0
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert "team-a" in lines.get("budget_root", ""), out
    assert "gpt-4o-mini, gpt-4o" in lines.get("models", ""), out
    assert "openai" in lines.get("providers", ""), out
    assert "2099-01-31T00:00:00Z" in lines.get("expires_at", ""), out
    assert len(KEY.findall(out)) == 1
    code, out, _ = run(capsys, "key", "new", "--root", "team-b", "--ledger", ledger)
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert "any model" in lines.get("models", ""), out
    assert "any provider" in lines.get("providers", ""), out
    assert "never" in lines.get("expires_at", ""), out
