"""A config file's keys: every documented key is read, and one nothing reads (a typo) stops
``serve`` naming it, with the key it was probably meant to be."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from effectguard.config import settings as settings_module
from effectguard.config.settings import hash_key, load_settings
from effectguard.errors import ConfigError

DIGEST = "ab" * 32


def reference_config() -> str:
    """The reference config of ``effectguard.config.settings``'s docstring, with its
    placeholders filled in (a real digest, a hook that imports)."""
    doc = settings_module.__doc__ or ""
    block = doc.split("Config file reference (every table optional)::\n", 1)[1]
    block = block.split("\nThe environment variable", 1)[0]
    text = textwrap.dedent(block)
    # Each placeholder its own digest: a proxy key and an admin key are never one key.
    text = re.sub(r'"<hex digest of [^>]*>"', lambda m: f'"{hash_key(m.group(0))}"', text)
    text = text.replace('spool_dir = "/var/tmp"', 'spool_dir = "/tmp"')
    return text.replace('"app.hooks:did_it_happen"', '"hookapp:answer"')


def test_every_key_of_the_reference_config_is_read(tmp_path: Path) -> None:
    """The documented reference loads: no key of it is unknown."""
    config = tmp_path / "effectguard.toml"
    config.write_text(reference_config())
    settings = load_settings(config=config, environ={})
    assert settings.port == 8787 and settings.guard.reconcile_hook == "hookapp:answer"
    assert settings.admin.enabled and [k.name for k in settings.keys] == ["team-a"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "[server]\nheartbeet_s = 1\n",
            "unknown key server.heartbeet_s (did you mean 'heartbeat_s'?)",
        ),
        ("[guard]\nmax_retry = 0\n", "unknown key guard.max_retry (did you mean 'max_retries'?)"),
        ("ledgr = 'x.db'\n", "unknown key ledgr (did you mean 'ledger'?)"),
        ("[admin]\nsession_s = 1\n", "unknown key admin.session_s (did you mean 'session_hours'?)"),
        (
            f"[[keys]]\nname = 'a'\nsha256 = '{DIGEST}'\nbudget_root = 'a'\nmetric = true\n",
            "unknown key keys[0].metric (did you mean 'metrics'?)",
        ),
        ("[retention]\nkeep_days = 3\n", "unknown key retention.keep_days"),
        ("[sever]\nport = 1\n", "unknown key sever (did you mean 'server'?)"),
    ],
)
def test_a_key_nothing_reads_is_refused_naming_it(tmp_path: Path, text: str, message: str) -> None:
    """A misspelt key would leave its setting at the default without a word: refused."""
    config = tmp_path / "effectguard.toml"
    config.write_text(text)
    with pytest.raises(ConfigError) as refused:
        load_settings(config=config, environ={})
    assert str(refused.value).startswith(f"{config}: {message}"), refused.value


def test_budget_paths_are_data_not_keys(tmp_path: Path) -> None:
    """[budgets] is read whole: any path in it is a budget, never an unknown key."""
    config = tmp_path / "effectguard.toml"
    config.write_text('[budgets]\n"team-zz" = "1"\n"team-zz/sub" = "0.5"\n')
    limits = load_settings(config=config, environ={}).budget_limits
    assert set(limits) == {"team-zz", "team-zz/sub"}


@pytest.mark.parametrize("value", ["{ sub = 1 }", "true", '["5"]'])
def test_a_budget_limit_that_is_no_amount_is_refused_naming_it(tmp_path: Path, value: str) -> None:
    """A table, a boolean or an array where a limit goes says what a limit is."""
    config = tmp_path / "effectguard.toml"
    config.write_text(f"[budgets]\nteam = {value}\n")
    with pytest.raises(ConfigError) as refused:
        load_settings(config=config, environ={})
    assert str(refused.value) == f'{config}: budgets.team: a limit is USD as a string ("5.00")'
