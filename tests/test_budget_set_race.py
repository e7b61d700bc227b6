# ruff: noqa: F811  (the store contract's fixtures are imported by name and used as arguments)
"""``effectguard budget set`` changes only the fields it is given, even when another
operator changes the same node while it runs (docs/contract.md §8).

The command used to read the node's policy, then write it back whole with its own
change: a ``budget set --limit`` committed in between was silently undone. Here the
other operator's change commits just before the command's write, the moment the race
leaves open, through a store that runs it there (a fake, not a patch).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from test_metrics import NodesRead
from test_store_contract import (  # noqa: F401  (fixtures)
    admit_ok,
    clock,
    completion,
    ledger,
    ledger_url,
    ns,
    req,
    store_kind,
    w1,
)

from effectguard.ingress.limitseed import seed_limits
from effectguard.ledger import Ledger, LedgerStore, Writer
from effectguard.ops.changes import cmd_budget_set
from effectguard.ops.cli import build_parser
from effectguard.rules.budget import BudgetPolicy
from effectguard.rules.events import StoredEvent

USD = 1_000_000_000


class ChangedBeforeWrite:
    """A store on which ``other`` (another operator's change) commits just before the
    next write, then behaves as the store it wraps."""

    def __init__(self, inner: LedgerStore, other: Callable[[], Awaitable[None]]) -> None:
        self._inner = inner
        self._other: Callable[[], Awaitable[None]] | None = other

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def write(self, writer: Writer, op: Any, *args: Any) -> Any:
        if self._other is not None:
            other, self._other = self._other, None
            await other()
        return await self._inner.write(writer, op, *args)


async def budget_set_racing(path: str, argv: list[str], other: BudgetPolicy) -> BudgetPolicy:
    """Run ``budget set`` while ``other`` is declared by another operator; the policy after."""
    args = build_parser().parse_args(["budget", "set", *argv, "--ledger", path])
    async with Ledger.open(path) as ledger:
        await ledger.set_policy(BudgetPolicy("team", 100 * USD, "month", "UTC"))
        racing = Ledger(ChangedBeforeWrite(ledger.store, lambda: ledger.set_policy(other)))
        assert await cmd_budget_set(args, racing) == 0
        return (await ledger.policies())["team"]


async def test_a_limit_lowered_meanwhile_survives_a_rate_change(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An emergency ``--limit 5`` committed while ``budget set --rpm 7`` runs stays 5 USD."""
    lowered = BudgetPolicy("team", 5 * USD, "month", "UTC")
    after = await budget_set_racing(str(tmp_path / "l.db"), ["team", "--rpm", "7"], lowered)
    assert (after.limit, after.rpm) == (5 * USD, 7)
    assert "team: limit 5.000000000 USD per month (UTC); rpm 7" in capsys.readouterr().out


async def test_a_rate_set_meanwhile_survives_a_limit_change(tmp_path: Path) -> None:
    """A ``--concurrency 3`` and ``--tz`` committed while ``budget set --limit 5`` runs are kept."""
    meanwhile = BudgetPolicy("team", 100 * USD, "month", "Asia/Kathmandu", concurrency=3)
    after = await budget_set_racing(str(tmp_path / "l.db"), ["team", "--limit", "5"], meanwhile)
    assert after == BudgetPolicy("team", 5 * USD, "month", "Asia/Kathmandu", concurrency=3)


async def test_change_policy_keeps_the_fields_it_is_not_given(ledger: Ledger, ns: str) -> None:
    """On every store, ``change_policy`` writes the named fields onto the stored policy."""
    path = f"{ns}/team"
    await ledger.set_policy(BudgetPolicy(path, 100 * USD, "week", "Pacific/Chatham", rpm=60))
    after = await ledger.change_policy(path, {"limit": 5 * USD, "tpm": 1000})
    assert after == BudgetPolicy(path, 5 * USD, "week", "Pacific/Chatham", rpm=60, tpm=1000)
    assert (await ledger.policies())[path] == after


async def test_an_operators_limit_set_while_serve_seeds_wins(
    ledger: Ledger, ns: str, w1: Writer
) -> None:
    """On every store: ``budget set --limit 1`` committed between ``serve``'s read of the
    ledger and its write of the config's ``[budgets]`` keeps 1 USD (contract §5.4), and
    the config's 5 USD is only warned about. Before, the seed wrote 5 over it."""
    path = f"{ns}/team"
    operator = BudgetPolicy(path, 1 * USD)
    racing = Ledger(ChangedBeforeWrite(ledger.store, lambda: ledger.set_policy(operator)))
    warnings = await seed_limits(racing, {path: 5 * USD}, w1)
    assert (await ledger.policies())[path] == operator
    assert any("an operator set 1.000000000 USD" in w for w in warnings), warnings


async def test_a_rate_set_while_serve_seeds_leaves_the_limit_to_the_file(
    ledger: Ledger, ns: str, w1: Writer
) -> None:
    """On every store: an operator's ``budget set --rpm 7`` committed while ``serve``
    seeds a path the file manages keeps the rate and still gets the file's limit (a rate
    is not a limit, §8 ``budget set``)."""
    path = f"{ns}/team"
    await ledger.set_policy(BudgetPolicy(path, 2 * USD), writer=w1)  # seeded before
    await ledger.change_policy(path, {"rpm": 3})  # the operator's first rate
    rate = BudgetPolicy(path, 2 * USD, rpm=7)
    racing = Ledger(ChangedBeforeWrite(ledger.store, lambda: ledger.set_policy(rate)))
    assert await seed_limits(racing, {path: 5 * USD}, w1) == []
    assert (await ledger.policies())[path] == BudgetPolicy(path, 5 * USD, rpm=7)


async def test_seeding_reads_only_the_nodes_it_wrote(ledger: Ledger, ns: str, w1: Writer) -> None:
    """On every store: ``serve``'s seed of ``[budgets]`` reads the nodes it wrote, not the
    tree (a node per run makes millions), and still warns of one already spent past its
    new limit."""
    path = f"{ns}/team"
    for run in range(5):
        budget = f"{path}/run-{run}"
        admitted = await admit_ok(ledger, w1, req(ns, request_hash=f"h{run}", budget=budget))
        await ledger.record(w1, admitted.call_id, 1, completion(admitted.call_id, budget, 700))
    store = NodesRead(ledger.store)
    warnings = await seed_limits(Ledger(store), {path: 1000, f"{ns}/other": 5 * USD}, w1)
    assert store.paths == {path}  # the other node was never charged: it has no row
    assert len(warnings) == 1, warnings
    assert f"budget {path!r} has already spent 0.000003500 USD" in warnings[0], warnings
    assert warnings[0].endswith("(set from the config's [budgets])")


class ArchivedByAnEarlierRelease:
    """A store whose limit events an archive of a release before 2026-12-04 moved out:
    its checkpoint's state has the policies but no ``operator_limits``."""

    def __init__(self, inner: LedgerStore, policies: list[list[Any]]) -> None:
        self._inner = inner
        self._policies = policies

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def limit_events(self) -> list[StoredEvent]:
        return []

    async def checkpoint_events(self) -> list[StoredEvent]:
        state = {"policies": self._policies}
        return [
            StoredEvent(1, "ledger.archived", None, {"state": state}, "operator", 0, 0.0, "", "")
        ]


async def test_a_limit_whose_setter_an_old_archive_hid_is_kept_with_a_warning(
    ledger: Ledger, ns: str, w1: Writer
) -> None:
    """On every store: where the last archive (made by a release before 2026-12-04) does
    not say who set a limit, serve keeps the ledger's limit as an operator's and warns
    with the command that takes the config's: the file never loosens a limit it cannot
    tell was its own. A path the checkpoint has no policy for follows the file."""
    path = f"{ns}/team"
    await ledger.set_policy(BudgetPolicy(path, 1 * USD))
    policies = [[path, USD, "total", "UTC", None, None, None]]
    old = Ledger(ArchivedByAnEarlierRelease(ledger.store, policies))
    warnings = await seed_limits(old, {path: 100 * USD, f"{ns}/new": USD}, w1)
    assert (await ledger.policies())[path].limit == 1 * USD
    assert (await ledger.policies())[f"{ns}/new"].limit == USD
    assert len(warnings) == 1, warnings
    assert "set before an archive made by a release that did not record who set it" in warnings[0]
    assert f"`effectguard budget set {path} --limit 100.000000000`" in warnings[0]
