"""Config ``[budgets]`` against ``effectguard budget set``: an operator's limit survives a restart.

The rule (effectguard.config.precedence): a path an operator set with ``budget set`` keeps
the ledger's limit, and ``serve`` warns at start when the config disagrees; every other
configured path follows the config file.
"""

from __future__ import annotations

import json
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import httpx
import pytest

from effectguard.config.precedence import operator_limits, plan_limits
from effectguard.rules.events import StoredEvent
from effectguard.testing import fake_provider, running_proxy


def limit_event(seq: int, path: str, limit: int | None, generation: int) -> StoredEvent:
    """A stored ``budget.limit_set`` written at ``generation`` (0: an operator tool)."""
    return StoredEvent(
        seq=seq,
        kind="budget.limit_set",
        call_id=None,
        data={"path": path, "limit": limit},
        worker="operator" if generation == 0 else "w",
        generation=generation,
        at=0.0,
        prev_digest="",
        digest="",
    )


def test_config_seeds_paths_no_operator_set_and_yields_to_those_one_did() -> None:
    """Unset or config-managed paths follow the file; an operator's differing limit warns."""
    by_operator = operator_limits(
        [
            limit_event(1, "seeded", 5, generation=3),
            limit_event(2, "ops", 80, generation=0),
            limit_event(3, "agreed", 10, generation=0),
        ]
    )
    plan = plan_limits(
        {"new": 1, "seeded": 6, "ops": 50, "agreed": 10},
        {"seeded": 5, "ops": 80, "agreed": 10},
        by_operator,
    )
    assert plan.apply == {"new": 1, "seeded": 6}
    assert len(plan.warnings) == 1
    assert "'ops'" in plan.warnings[0] and "budget set ops --limit" in plan.warnings[0]


def test_an_operator_clearing_a_limit_also_wins() -> None:
    """budget set --no-limit is an operator's decision too: the config's limit is not restored."""
    by_operator = operator_limits([limit_event(1, "ops", None, generation=0)])
    plan = plan_limits({"ops": 50}, {"ops": None}, by_operator)
    assert plan.apply == {}
    assert "no limit" in plan.warnings[0]


def test_an_operator_setting_only_a_rate_leaves_the_limit_to_the_file() -> None:
    """budget set --rpm rewrites the policy with the same limit: the file still owns the limit."""
    by_operator = operator_limits(
        [limit_event(1, "team", 5, generation=3), limit_event(2, "team", 5, generation=0)]
    )
    plan = plan_limits({"team": 6}, {"team": 5}, by_operator)
    assert plan.apply == {"team": 6} and plan.warnings == []


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``effectguard ARGS`` as a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "effectguard", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def limits(config: Path) -> dict[str, str | None]:
    """Every node's limit, read with ``budgets --config`` (serve's ledger)."""
    result = cli("budgets", "--json", "--config", str(config))
    assert result.returncode == 0, result.stderr
    return {n["path"]: n["limit_usd"] for n in json.loads(result.stdout)}


@pytest.mark.slow
def test_a_restart_keeps_the_operators_limit_and_warns(tmp_path: Path) -> None:
    """serve does not reset a budget-set limit to [budgets]; it warns on stderr instead."""
    ledger = tmp_path / "ledger.db"
    config = tmp_path / "effectguard.toml"
    config.write_text(f'ledger = "{ledger}"\n\n[budgets]\n"ops" = "50"\n"team" = "5"\n')
    args = ["--config", str(config)]
    with running_proxy(ledger, args=args, log_path=tmp_path / "first.log"):
        pass
    assert limits(config) == {"ops": "50.000000000", "team": "5.000000000"}
    assert cli("budget", "set", "ops", "--limit", "80", "--config", str(config)).returncode == 0
    config.write_text(f'ledger = "{ledger}"\n\n[budgets]\n"ops" = "50"\n"team" = "6"\n')
    with running_proxy(ledger, args=args, log_path=tmp_path / "second.log") as proxy:
        pass
    assert limits(config) == {"ops": "80.000000000", "team": "6.000000000"}
    log = proxy.log()
    assert "budget 'ops'" in log and "80.000000000 USD" in log and "50.000000000 USD" in log
    assert "'team'" not in log  # a config-managed path changes without a warning
    assert "budget 'ops'" not in (tmp_path / "first.log").read_text()


@pytest.mark.slow
def test_serve_warns_when_the_config_sets_a_limit_below_this_periods_spending(
    tmp_path: Path,
) -> None:
    """A [budgets] limit that serve writes below what the node's current period has
    already spent is written all the same, with a warning naming the period (as
    `budget set` warns); a limit above the spending gives none."""
    ledger = tmp_path / "ledger.db"
    config = tmp_path / "effectguard.toml"

    def configure(limit: str) -> None:
        config.write_text(f'ledger = "{ledger}"\n\n[budgets]\n"team" = "{limit}"\n')

    configure("10")
    args = ["--config", str(config)]
    with fake_provider(tmp_path / "receipts.jsonl") as provider:
        upstreams = {"openai": provider.url}
        with running_proxy(
            ledger, upstreams=upstreams, args=args, log_path=tmp_path / "a.log"
        ) as p:
            monthly = cli("budget", "set", "team", "--period", "month", "--config", str(config))
            assert monthly.returncode == 0, monthly.stderr
            body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
            sent = httpx.post(
                p.url + "/openai/v1/chat/completions",
                json={**body, "max_tokens": 8},
                headers={"effectguard-budget": "team"},
                timeout=15,
            )
            assert sent.status_code == 200, sent.text
    assert "already spent" not in (tmp_path / "a.log").read_text()
    (team,) = json.loads(cli("budgets", "--json", "--config", str(config)).stdout)
    spent = Decimal(team["spent_usd"])
    assert team["resets"] == "month"
    below, above = spent - Decimal("0.000000001"), spent + Decimal("0.000000001")
    assert below >= 0
    configure(str(below))
    with running_proxy(ledger, args=args, log_path=tmp_path / "b.log") as proxy:
        pass
    log = proxy.log()
    assert f"budget 'team' has already spent {spent:.9f} USD in period {team['period']}" in log
    assert limits(config) == {"team": f"{below:.9f}"}
    configure(str(above))
    with running_proxy(ledger, args=args, log_path=tmp_path / "c.log") as proxy:
        pass
    assert "already spent" not in proxy.log()
