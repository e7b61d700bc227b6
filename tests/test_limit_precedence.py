"""Config ``[budgets]`` against ``effectguard budget set``: an operator's limit survives a restart.

The rule (effectguard.config.precedence): a path an operator set with ``budget set`` keeps
the ledger's limit, and ``serve`` warns at start when the config disagrees; every other
configured path follows the config file.
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from effectguard.config.precedence import carried_limits, operator_limits, plan_limits
from effectguard.ops.audit import checkpoint
from effectguard.ops.audit.budgets import Budgets
from effectguard.ops.audit.verifier import Verifier
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


def test_an_operator_setting_only_a_period_is_read_as_a_rate_change_is() -> None:
    """budget set --period on a seeded path keeps the file's limit with the file; on a path
    with no policy yet it writes no limit, which counts as an operator's (contract §8)."""
    seeded = operator_limits(
        [limit_event(1, "team", 5, generation=3), limit_event(2, "team", 5, generation=0)]
    )
    assert plan_limits({"team": 6}, {"team": 5}, seeded).apply == {"team": 6}
    unseeded = operator_limits([limit_event(1, "team", None, generation=0)])
    plan = plan_limits({"team": 6}, {"team": None}, unseeded)
    assert plan.apply == {} and "no limit" in plan.warnings[0]


def test_what_a_checkpoint_carries_continues_the_rule() -> None:
    """After an archive, the paths an operator had set (``carried``) stay set; an operator's
    rate-only change after the cut is judged against the limit at the cut, and a worker's
    write after it does not take the path back from the operator."""
    carried = {"ops": 7}
    at_cut = {"ops": 80, "team": 5, "rated": 3}
    by_operator = operator_limits(
        [
            limit_event(20, "team", 5, generation=0),  # a rate set by hand: same limit
            limit_event(21, "new", 9, generation=0),
            limit_event(22, "ops", 80, generation=4),
        ],
        carried,
        at_cut,
    )
    assert by_operator == {"ops": 7, "new": 21}


@given(
    st.lists(
        st.tuples(st.sampled_from(["a", "b"]), st.sampled_from([None, 1, 2]), st.integers(0, 2)),
        max_size=12,
    ),
    st.integers(0, 12),
)
def test_the_verifier_folds_operator_limits_as_serve_reads_them(
    changes: list[tuple[str, int | None, int]], cut: int
) -> None:
    """``verify``'s fold (which writes a checkpoint's ``operator_limits``) and serve's rule
    agree on any run of limit changes, whole or cut anywhere by an archive."""
    events = [limit_event(n + 1, p, limit, generation=g) for n, (p, limit, g) in enumerate(changes)]
    folded = Budgets()
    for e in events[:cut]:
        folded.feed(e.seq, e.kind, e.data, generation=e.generation)
    at_cut = {path: policy[0] for path, policy in folded.policies.items()}
    after = operator_limits(events[cut:], dict(folded.operator_set), at_cut)
    for e in events[cut:]:
        folded.feed(e.seq, e.kind, e.data, generation=e.generation)
    assert after == folded.operator_set == operator_limits(events)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c"]), st.sampled_from([None, 1, 2]), st.integers(0, 2)
        ),
        max_size=8,
    ),
    st.lists(st.sampled_from(["a", "b"]), unique=True),
)
def test_a_checkpoint_that_does_not_say_who_set_a_limit_is_read_alike(
    changes: list[tuple[str, int | None, int]], declared: list[str]
) -> None:
    """A checkpoint written before 2026-12-04 has policies but no ``operator_limits``:
    verify's fold (seeded from it, as the archive that follows it is) and serve's reading
    of it agree, each counting every path with a policy as set by an operator."""
    state: dict[str, Any] = {
        "workers": [], "registered": [], "fenced": [], "top_generation": 0, "budgets": [],
        "keys": [], "policies": [[p, 5, "total", "UTC", None, None, None] for p in declared],
    }  # fmt: skip
    folded = Verifier()
    checkpoint.seed(folded, state, next_seq=10, prev_digest="0" * 64)
    carried, at_cut = carried_limits(state)
    assert folded.budgets.operator_set == carried == dict.fromkeys(declared, 0)
    events = [limit_event(n + 10, p, v, generation=g) for n, (p, v, g) in enumerate(changes)]
    for e in events:
        folded.budgets.feed(e.seq, e.kind, e.data, generation=e.generation)
    assert folded.budgets.operator_set == operator_limits(events, carried, at_cut)


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
def test_setting_the_files_value_ends_the_warning_but_keeps_the_path_the_operators(
    tmp_path: Path,
) -> None:
    """budget set PATH --limit <the file's value> ends serve's warning; a later edit of the
    file is then warned about, not applied (operations.md: no command hands a path back)."""
    ledger = tmp_path / "ledger.db"
    config = tmp_path / "effectguard.toml"
    config.write_text(f'ledger = "{ledger}"\n\n[budgets]\n"ops" = "50"\n')
    args = ["--config", str(config)]
    with running_proxy(ledger, args=args, log_path=tmp_path / "first.log"):
        pass
    for limit in ("80", "50"):  # the operator's own limit, then the file's value
        assert cli("budget", "set", "ops", "--limit", limit, *args).returncode == 0
    with running_proxy(ledger, args=args, log_path=tmp_path / "agreed.log") as proxy:
        pass
    assert "budget 'ops'" not in proxy.log()
    config.write_text(f'ledger = "{ledger}"\n\n[budgets]\n"ops" = "60"\n')
    with running_proxy(ledger, args=args, log_path=tmp_path / "edited.log") as proxy:
        pass
    assert limits(config) == {"ops": "50.000000000"}
    assert "budget 'ops'" in proxy.log() and "60.000000000 USD" in proxy.log()


@pytest.mark.slow
def test_an_archive_does_not_hand_an_operators_limit_back_to_the_config(tmp_path: Path) -> None:
    """The events that say an operator set a limit can leave for an archive file: the
    checkpoint carries what they said, so the next start still keeps the operator's limit
    and warns (it used to write the config's 50 over the operator's 80, silently)."""
    ledger = tmp_path / "ledger.db"
    config = tmp_path / "effectguard.toml"
    config.write_text(f'ledger = "{ledger}"\n\n[budgets]\n"ops" = "50"\n"team" = "5"\n')
    args = ["--config", str(config)]
    with (
        fake_provider(tmp_path / "receipts.jsonl") as provider,
        running_proxy(
            ledger, upstreams={"openai": provider.url}, args=args, log_path=tmp_path / "first.log"
        ) as first,
    ):
        for path, change in (("ops", ["--limit", "80"]), ("team", ["--rpm", "9"])):
            done = cli("budget", "set", path, *change, "--config", str(config))
            assert done.returncode == 0, done.stderr
        # A call after them: an archive cuts after a settled call's last event.
        body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
        sent = httpx.post(
            first.url + "/openai/v1/chat/completions",
            json=body,
            headers={"effectguard-budget": "team"},
            timeout=15,
        )
        assert sent.status_code == 200, sent.text
    later = (dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)).isoformat()
    moved = cli("archive", "--before", later, "--json", "--config", str(config),
                "--out", str(tmp_path / "a.jsonl.gz"))  # fmt: skip
    assert moved.returncode == 0, moved.stderr
    assert json.loads(moved.stdout)["events"] > 0
    assert cli("verify", "--config", str(config)).returncode == 0
    config.write_text(f'ledger = "{ledger}"\n\n[budgets]\n"ops" = "50"\n"team" = "6"\n')
    with running_proxy(ledger, args=args, log_path=tmp_path / "second.log") as proxy:
        pass
    assert limits(config) == {"ops": "80.000000000", "team": "6.000000000"}
    log = proxy.log()
    assert "budget 'ops'" in log and "80.000000000 USD" in log and "50.000000000 USD" in log
    assert "'team'" not in log  # a rate set by hand leaves the limit to the file
    verified = cli("verify", "--archive", str(tmp_path / "a.jsonl.gz"), "--config", str(config))
    assert verified.returncode == 0, verified.stdout + verified.stderr


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
