"""Budget-tree arithmetic (contract.md §5): paths, ancestors, admission, and the fold invariant."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    rule,
)

from effectguard.rules import budget
from effectguard.rules.budget import BudgetNode, Delta, Exceeded, ancestors, check_admission
from effectguard.rules.events import (
    BudgetCorrected,
    BudgetHeld,
    BudgetLimitSet,
    BudgetReleased,
    BudgetReserved,
    BudgetSettled,
    BudgetUnheld,
    CallManifest,
    Event,
)
from effectguard.rules.money import MAX_CALL_NANOS, MAX_NANOS

# -- paths ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    ["default", "team-a", "team-a/run-42", "a.b_c-D9", "0", "/".join("abcdefgh"), "x" * 64],
)
def test_valid_paths_are_accepted(path: str) -> None:
    """Paths of 1-8 segments of letters, digits, '.', '_' and '-' are valid."""
    assert budget.validate_path(path) == path


@pytest.mark.parametrize(
    "path",
    [
        "",
        "/a",
        "a/",
        "a//b",
        "-a",
        ".a",
        "_a",
        "a b",
        "a/b c",
        "a\nb",
        "é",
        "a%2Fb",
        "/".join("abcdefghi"),
        "x" * 65,
        "../etc",
    ],
)
def test_invalid_paths_are_refused(path: str) -> None:
    """Empty segments, bad characters, a leading symbol, depth > 8 or a long segment are refused."""
    with pytest.raises(ValueError, match="invalid budget path"):
        budget.validate_path(path)


def test_ancestors_are_root_first_and_end_with_the_path() -> None:
    """ancestors lists the root first and the path itself last."""
    assert ancestors("a/b/c") == ["a", "a/b", "a/b/c"]
    assert ancestors("a") == ["a"]


def test_root_and_is_under() -> None:
    """root_of takes the first segment; is_under does not confuse a prefix with a parent."""
    assert budget.root_of("team/run/1") == "team"
    assert budget.is_under("team/run", "team")
    assert budget.is_under("team", "team")
    assert not budget.is_under("team-b/run", "team")
    assert not budget.is_under("tea", "team")


# -- admission -------------------------------------------------------------------


def nodes_of(*nodes: BudgetNode) -> dict[str, BudgetNode]:
    """A node mapping keyed by path."""
    return {n.path: n for n in nodes}


def test_admission_fits_exactly_at_the_limit() -> None:
    """spent + reserved + held + R == limit is admitted; one nano more is refused."""
    nodes = nodes_of(BudgetNode("a", limit=100, spent=10, reserved=20, held=30))
    assert check_admission(nodes, "a", 40) is None
    assert check_admission(nodes, "a", 41) == Exceeded(path="a", limit=100, room=40, amount=41)


def test_admission_checks_every_limited_ancestor() -> None:
    """A limit on a middle ancestor refuses a charge to a deeper path."""
    nodes = nodes_of(
        BudgetNode("a", limit=None, spent=10**12),
        BudgetNode("a/b", limit=50, held=45),
        BudgetNode("a/b/c", limit=1000),
    )
    refused = check_admission(nodes, "a/b/c", 6)
    assert refused == Exceeded(path="a/b", limit=50, room=5, amount=6)
    assert check_admission(nodes, "a/b/c", 5) is None


def test_admission_ignores_nodes_outside_the_path() -> None:
    """A sibling's or a child's limit does not constrain a charge to its parent or sibling."""
    nodes = nodes_of(BudgetNode("a/x", limit=0), BudgetNode("a/b/c", limit=0))
    assert check_admission(nodes, "a/b", 10**9) is None


def test_missing_nodes_are_unlimited() -> None:
    """Paths never seen are unlimited."""
    assert check_admission({}, "new/path", 10**15) is None


def test_refusal_names_the_root_most_overflowing_node() -> None:
    """When several nodes overflow, the root-most one and its room are named."""
    nodes = nodes_of(
        BudgetNode("a", limit=100, spent=90),
        BudgetNode("a/b", limit=5),
        BudgetNode("a/b/c", limit=1),
    )
    assert check_admission(nodes, "a/b/c", 20) == Exceeded(path="a", limit=100, room=10, amount=20)


def test_room_is_never_negative_after_overshoot() -> None:
    """A node already past its limit (settle overshoot) has room 0 and refuses any charge."""
    node = BudgetNode("a", limit=100, spent=150)
    assert node.room == 0
    assert check_admission(nodes_of(node), "a", 1) == Exceeded("a", 100, 0, 1)
    assert check_admission(nodes_of(node), "a", 0) == Exceeded("a", 100, 0, 0)


def test_zero_limit_refuses_everything_but_a_zero_charge() -> None:
    """A limit of 0 admits only a zero reservation."""
    nodes = nodes_of(BudgetNode("a", limit=0))
    assert check_admission(nodes, "a", 0) is None
    assert check_admission(nodes, "a", 1) is not None


def test_unlimited_node_has_no_room_value() -> None:
    """An unlimited node's room is None (not a number that could be mistaken for zero)."""
    assert BudgetNode("a").room is None


# -- deltas and fold ---------------------------------------------------------------


def test_deltas_follow_spec_section_5() -> None:
    """Each budget event moves the counters exactly as docs/contract.md §5 says."""
    assert budget.deltas(BudgetReserved(call="c", budget="a", amount=7)) == Delta("a", reserved=7)
    assert budget.deltas(BudgetSettled(call="c", budget="a", reserved=7, actual=9)) == Delta(
        "a", reserved=-7, spent=9
    )
    assert budget.deltas(BudgetReleased(call="c", budget="a", amount=7)) == Delta("a", reserved=-7)
    assert budget.deltas(BudgetHeld(call="c", budget="a", amount=7)) == Delta(
        "a", reserved=-7, held=7
    )
    assert budget.deltas(BudgetUnheld(call="c", budget="a", amount=7, spent=3)) == Delta(
        "a", held=-7, spent=3
    )
    assert budget.deltas(BudgetCorrected(call="c", budget="a", settled=7, actual=2)) == Delta(
        "a", spent=-5
    )
    assert budget.deltas(BudgetLimitSet(path="a", limit=None)) is None


@pytest.mark.parametrize(("actual", "spent"), [(0, 0), (4, 4), (10, 10), (25, 25)])
def test_reconciling_a_failed_call_sets_its_spending_to_the_decided_cost(
    actual: int, spent: int
) -> None:
    """A failed call settled at its reservation R, corrected to C: spent is C on every node."""
    nodes = budget.fold(
        [
            BudgetReserved(call="c", budget="a/b", amount=10),
            BudgetSettled(call="c", budget="a/b", reserved=10, actual=10),
            BudgetCorrected(call="c", budget="a/b", settled=10, actual=actual),
        ]
    )
    assert nodes.node("a") == BudgetNode("a", spent=spent)
    assert nodes.node("a/b") == BudgetNode("a/b", spent=spent)


def test_fold_charges_every_ancestor() -> None:
    """A reservation on a/b/c shows on a, a/b and a/b/c, and not on a sibling."""
    nodes = budget.fold(
        [
            BudgetLimitSet(path="a/x", limit=10),
            BudgetReserved(call="c", budget="a/b/c", amount=7),
        ]
    )
    reserved = {p: n.reserved for (p, _), n in nodes.nodes.items()}
    assert reserved == {"a": 7, "a/b": 7, "a/b/c": 7}
    assert nodes.node("a/x") == BudgetNode("a/x", limit=10)


def test_settle_overshoot_is_spent_in_full() -> None:
    """Actual cost above the reservation is spent, and the overshoot is reported."""
    settled = BudgetSettled(call="c", budget="a", reserved=10, actual=25)
    nodes = budget.fold([BudgetReserved(call="c", budget="a", amount=10), settled])
    assert nodes.node("a") == BudgetNode("a", reserved=0, spent=25)
    assert settled.overshoot == 15
    assert BudgetSettled(call="c", budget="a", reserved=10, actual=4).overshoot == 0


def test_one_call_may_reserve_exactly_the_per_call_bound() -> None:
    """MAX_CALL_NANOS fits on an empty unlimited tree; one nano more is refused."""
    assert check_admission({}, "a/b", MAX_CALL_NANOS) is None
    refused = check_admission({}, "a/b", MAX_CALL_NANOS + 1)
    assert refused is not None and refused.path == "a"


@pytest.mark.parametrize("limit", [None, 0, 1, MAX_NANOS])
def test_a_limit_a_counter_can_hold_is_valid(limit: int | None) -> None:
    """validate_limit accepts no limit and 0..MAX_NANOS."""
    assert budget.validate_limit(limit) == limit


@pytest.mark.parametrize("limit", [-1, MAX_NANOS + 1])
def test_a_limit_no_counter_can_hold_is_refused(limit: int) -> None:
    """validate_limit refuses a negative limit and one past MAX_NANOS."""
    with pytest.raises(ValueError, match="between 0 and"):
        budget.validate_limit(limit)


def test_limit_set_on_a_new_path_creates_that_node() -> None:
    """budget.limit_set on a path never seen creates the node at that path, counters zero."""
    tree = budget.fold([BudgetLimitSet(path="a/b", limit=5)])
    assert tree.node("a/b") == BudgetNode("a/b", limit=5)


def test_limit_set_keeps_counters_and_can_be_cleared() -> None:
    """budget.limit_set changes only the limit; None clears it."""
    nodes = budget.fold(
        [
            BudgetReserved(call="c", budget="a", amount=7),
            BudgetLimitSet(path="a", limit=100),
            BudgetLimitSet(path="a", limit=None),
        ]
    )
    assert nodes.node("a") == BudgetNode("a", limit=None, reserved=7)


def test_apply_returns_the_changed_nodes_and_ignores_other_events() -> None:
    """apply reports the nodes it changed; a non-budget event changes nothing."""
    tree = budget.Tree()
    changed = tree.apply(BudgetReserved(call="c", budget="a/b", amount=3))
    assert [n.path for n in changed] == ["a", "a/b"]
    other = CallManifest(
        call="c",
        request_hash="h",
        provider="p",
        endpoint="/",
        method="POST",
        model=None,
        idempotency_key=None,
        budget="a/b",
        budget_root="a",
        effect_kind="billable",
        body="",
    )
    before = dict(tree.nodes)
    assert tree.apply(other) == []
    assert tree.nodes == before


def test_counters_saturate_at_zero() -> None:
    """Releasing more than is reserved never drives a counter negative."""
    nodes = budget.fold(
        [
            BudgetReleased(call="c", budget="a", amount=5),
            BudgetUnheld(call="c", budget="a", amount=5, spent=0),
        ]
    )
    assert nodes.node("a") == BudgetNode("a")


# -- periods and policies (mutation testing: docs/testing.md) ------------------------

MONTH = {"a": "2026-12"}


def test_every_budget_event_lands_in_the_periods_admission_recorded() -> None:
    """Each budget event's delta carries the periods fixed at admission, not ``total``."""
    events: list[Event] = [
        BudgetReserved(call="c", budget="a/b", amount=7, periods=MONTH),
        BudgetSettled(call="c", budget="a/b", reserved=7, actual=9, periods=MONTH),
        BudgetReleased(call="c", budget="a/b", amount=7, periods=MONTH),
        BudgetHeld(call="c", budget="a/b", amount=7, periods=MONTH),
        BudgetUnheld(call="c", budget="a/b", amount=7, spent=3, periods=MONTH),
        BudgetCorrected(call="c", budget="a/b", settled=7, actual=2, periods=MONTH),
    ]
    for event in events:
        delta = budget.deltas(event)
        assert delta is not None and delta.periods == MONTH, event.kind
        assert delta.targets() == [("a", "2026-12"), ("a/b", "total")], event.kind


def test_a_charge_in_a_period_changes_that_period_with_the_current_limit() -> None:
    """apply returns (and keeps) each changed node in its own period, carrying its policy's
    limit; a node without a policy has none."""
    tree = budget.Tree()
    tree.apply(BudgetLimitSet(path="a", limit=100, period="month"))
    changed = tree.apply(BudgetReserved(call="c", budget="a/b", amount=7, periods=MONTH))
    assert changed == [
        BudgetNode("a", limit=100, reserved=7, period="2026-12"),
        BudgetNode("a/b", limit=None, reserved=7),
    ]
    assert tree.nodes[("a", "2026-12")] == changed[0]


def test_a_node_with_no_counters_in_a_period_is_zero_in_that_period() -> None:
    """Tree.node for a period never charged is an empty node keyed by that period."""
    assert budget.Tree().node("a", "2026-12").key == ("a", "2026-12")


def test_a_limit_set_event_declares_the_whole_policy() -> None:
    """policy_of keeps every part of a budget.limit_set: path, limit, period, zone, rates."""
    event = BudgetLimitSet(
        path="a/b", limit=5, period="week", tz="Europe/Paris", rpm=1, tpm=2, concurrency=3
    )
    assert budget.policy_of(event) == budget.BudgetPolicy(
        "a/b", 5, "week", "Europe/Paris", rpm=1, tpm=2, concurrency=3
    )
    with pytest.raises(ValueError, match="unknown period"):
        budget.policy_of(BudgetLimitSet(path="a", limit=5, period="fortnight"))


#: 2026-12-01 03:00 UTC: still November 30 in New York.
DEC_1_3AM = 1_796_094_000.0
POLICIES = {
    "a": budget.BudgetPolicy("a", 10, "month", "America/New_York"),
    "a/b": budget.BudgetPolicy("a/b", None, "total"),
    "a/b/c": budget.BudgetPolicy("a/b/c", 5, "day"),
}


def test_admission_records_the_period_of_each_ancestor_in_its_own_timezone() -> None:
    """labels_at names the current period of every ancestor with a period policy (read in
    that node's timezone) and leaves out total and policy-less ones."""
    assert budget.labels_at(POLICIES, "a/b/c/d", DEC_1_3AM) == {
        "a": "2026-11",
        "a/b/c": "2026-12-01",
    }


def test_admission_sees_each_ancestor_in_its_recorded_period_with_its_limit() -> None:
    """period_nodes gives every ancestor's counters in its recorded period (empty if none,
    total if unnamed) with its policy's limit (none without a policy)."""
    counters = {
        ("a", "2026-11"): BudgetNode("a", reserved=3, period="2026-11"),
        ("a", "2026-12"): BudgetNode("a", reserved=99, period="2026-12"),
        ("a/b", "total"): BudgetNode("a/b", spent=2),
    }
    labels = {"a": "2026-11", "a/b/c": "2026-12-01"}
    assert budget.period_nodes(POLICIES, counters, "a/b/c/d", labels) == {
        "a": BudgetNode("a", limit=10, reserved=3, period="2026-11"),
        "a/b": BudgetNode("a/b", spent=2),
        "a/b/c": BudgetNode("a/b/c", limit=5, period="2026-12-01"),
        "a/b/c/d": BudgetNode("a/b/c/d"),
    }


@pytest.mark.parametrize(
    "policy",
    [
        budget.BudgetPolicy("a"),
        budget.BudgetPolicy("a/b", MAX_NANOS, "week", "Europe/Paris", 0, MAX_NANOS, 1),
    ],
)
def test_a_policy_within_every_bound_is_valid(policy: budget.BudgetPolicy) -> None:
    """validate_policy accepts no rates and rates from 0 to MAX_NANOS."""
    assert budget.validate_policy(policy) is policy


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"path": "a//b"}, "invalid budget path"),
        ({"limit": -1}, "budget limit"),
        ({"period": "fortnight"}, "unknown period"),
        ({"tz": "Mars/Olympus"}, "unknown timezone"),
        *(
            ({name: v}, f"{name} must be between")
            for name in ("rpm", "tpm", "concurrency")
            for v in (-1, MAX_NANOS + 1)
        ),
    ],
)
def test_a_policy_out_of_any_bound_is_refused(change: dict[str, object], message: str) -> None:
    """validate_policy refuses a bad path, limit, period, timezone or rate, naming it."""
    policy = dataclasses.replace(budget.BudgetPolicy("a"), **change)
    with pytest.raises(ValueError, match=message):
        budget.validate_policy(policy)


# -- a stateful model over random interleavings --------------------------------------

TREE_LIMITS: dict[str, int | None] = {
    "org": 6_000,
    "org/a": 3_000,
    "org/a/x": 1_200,
    "org/b": None,
    "org/b/y": 2_000,
}
PATHS = sorted(TREE_LIMITS)


@dataclasses.dataclass(frozen=True)
class Reservation:
    """One outstanding reservation in the model."""

    n: int
    path: str
    amount: int


class BudgetMachine(RuleBasedStateMachine):
    """Random reserve/settle/release/hold/reconcile interleavings against an independent model."""

    reservations = Bundle("reservations")
    holds = Bundle("holds")
    failures = Bundle("failures")

    def __init__(self) -> None:
        super().__init__()
        self.tree = budget.Tree()
        self.events: list[Event] = []
        self.counter = 0
        # The independent model: per-path sums of the charges made *to* that path.
        self.reserved_at: dict[str, int] = defaultdict(int)
        self.held_at: dict[str, int] = defaultdict(int)
        self.spent_at: dict[str, int] = defaultdict(int)
        self.open_reservations: set[int] = set()
        self.open_holds: set[int] = set()

    def emit(self, event: Event) -> None:
        """Apply one event to the tree and remember it."""
        self.events.append(event)
        self.tree.apply(event)

    def model(self, path: str, counters: dict[str, int]) -> int:
        """The model's counter for ``path``: the sum over the path and its descendants."""
        return sum(v for p, v in counters.items() if budget.is_under(p, path))

    def model_committed(self, path: str) -> int:
        """spent + reserved + held of ``path`` in the model."""
        return sum(self.model(path, c) for c in (self.spent_at, self.reserved_at, self.held_at))

    @initialize()
    def set_limits(self) -> None:
        """Declare the tree's limits as events, so the fold sees them too."""
        for path, limit in TREE_LIMITS.items():
            self.emit(BudgetLimitSet(path=path, limit=limit))

    @rule(
        target=reservations,
        path=st.sampled_from(PATHS),
        amount=st.integers(min_value=0, max_value=1_500),
    )
    def reserve(self, path: str, amount: int) -> Reservation | object:
        """Admit a reservation only when check_admission says it fits; check that it really fits."""
        fits = all(
            TREE_LIMITS[p] is None or self.model_committed(p) + amount <= TREE_LIMITS[p]  # type: ignore[operator]
            for p in ancestors(path)
        )
        refused = check_admission({p: self.tree.node(p) for p in PATHS}, path, amount)
        assert (refused is None) == fits
        if refused is not None:
            overflowing = [
                p
                for p in ancestors(path)
                if TREE_LIMITS[p] is not None and self.model_committed(p) + amount > TREE_LIMITS[p]  # type: ignore[operator]
            ]
            assert refused.path == overflowing[0]
            limit = TREE_LIMITS[refused.path]
            assert limit is not None
            assert refused.room == max(0, limit - self.model_committed(refused.path))
            assert refused.amount == amount
            return multiple()  # refused: nothing joins the bundle
        self.counter += 1
        res = Reservation(self.counter, path, amount)
        self.emit(BudgetReserved(call=f"c{res.n}", budget=path, amount=amount))
        self.reserved_at[path] += amount
        self.open_reservations.add(res.n)
        return res

    def _close_reservation(self, res: Reservation) -> None:
        assert res.n in self.open_reservations, "a reservation resolved twice"
        self.open_reservations.remove(res.n)
        self.reserved_at[res.path] -= res.amount

    @rule(res=consumes(reservations), extra=st.integers(min_value=-1_500, max_value=1_500))
    def settle(self, res: Reservation, extra: int) -> None:
        """Settle at any actual cost, including more than was reserved (overshoot)."""
        actual = max(0, res.amount + extra)
        self._close_reservation(res)
        self.emit(
            BudgetSettled(call=f"c{res.n}", budget=res.path, reserved=res.amount, actual=actual)
        )
        self.spent_at[res.path] += actual

    @rule(target=failures, res=consumes(reservations))
    def fail(self, res: Reservation) -> Reservation:
        """An error answer booked as applied (stage failed): settled at its reservation."""
        self._close_reservation(res)
        self.emit(
            BudgetSettled(call=f"c{res.n}", budget=res.path, reserved=res.amount, actual=res.amount)
        )
        self.spent_at[res.path] += res.amount
        return res

    @rule(res=consumes(failures), cost=st.none() | st.integers(min_value=0, max_value=3_000))
    def reconcile_failed(self, res: Reservation, cost: int | None) -> None:
        """A failed call reconciled: not applied (None here) gives R back; applied sets C."""
        actual = 0 if cost is None else cost
        self.emit(
            BudgetCorrected(call=f"c{res.n}", budget=res.path, settled=res.amount, actual=actual)
        )
        self.spent_at[res.path] += actual - res.amount

    @rule(res=consumes(reservations))
    def release(self, res: Reservation) -> None:
        """Not sent / not processed: the reservation is released."""
        self._close_reservation(res)
        self.emit(BudgetReleased(call=f"c{res.n}", budget=res.path, amount=res.amount))

    @rule(target=holds, res=consumes(reservations))
    def hold(self, res: Reservation) -> Reservation:
        """Effect unknown: the reservation moves to held."""
        self._close_reservation(res)
        self.emit(BudgetHeld(call=f"c{res.n}", budget=res.path, amount=res.amount))
        self.held_at[res.path] += res.amount
        self.open_holds.add(res.n)
        return res

    def _close_hold(self, res: Reservation, spent: int) -> None:
        assert res.n in self.open_holds, "a hold resolved twice"
        self.open_holds.remove(res.n)
        self.emit(BudgetUnheld(call=f"c{res.n}", budget=res.path, amount=res.amount, spent=spent))
        self.held_at[res.path] -= res.amount
        self.spent_at[res.path] += spent

    @rule(res=consumes(holds), cost=st.none() | st.integers(min_value=0, max_value=3_000))
    def reconcile_applied(self, res: Reservation, cost: int | None) -> None:
        """Reconciled applied with cost C (C defaults to R): held -> spent."""
        self._close_hold(res, res.amount if cost is None else cost)

    @rule(res=consumes(holds))
    def reconcile_not_applied(self, res: Reservation) -> None:
        """Reconciled not applied: the hold is released."""
        self._close_hold(res, 0)

    @invariant()
    def counters_match_the_model_and_the_fold(self) -> None:
        """Every node equals the independent model and the fold of the emitted events."""
        assert budget.fold(self.events) == self.tree
        for path in PATHS:
            node = self.tree.node(path)
            assert node.limit == TREE_LIMITS[path]
            assert node.reserved == self.model(path, self.reserved_at)
            assert node.held == self.model(path, self.held_at)
            assert node.spent == self.model(path, self.spent_at)

    @invariant()
    def money_is_non_negative_int(self) -> None:
        """Counters are never negative and never floats (exact nano-dollars)."""
        for node in self.tree.nodes.values():
            for value in (node.reserved, node.spent, node.held):
                assert type(value) is int
                assert value >= 0
            assert node.limit is None or type(node.limit) is int
        for event in self.events:
            for value in event.to_data().values():
                assert not isinstance(value, float)

    def teardown(self) -> None:
        """Resolving every outstanding reservation and hold leaves nothing reserved or held."""
        for n in sorted(self.open_reservations):
            path, amount = self._find(n)
            self._close_reservation(Reservation(n, path, amount))
            self.emit(BudgetReleased(call=f"c{n}", budget=path, amount=amount))
        for n in sorted(self.open_holds):
            path, amount = self._find(n)
            self._close_hold(Reservation(n, path, amount), 0)
        assert not self.open_reservations and not self.open_holds
        self.counters_match_the_model_and_the_fold()
        for node in self.tree.nodes.values():
            assert node.reserved == 0
            assert node.held == 0

    def _find(self, n: int) -> tuple[str, int]:
        for event in self.events:
            if isinstance(event, BudgetReserved) and event.call == f"c{n}":
                return event.budget, event.amount
        raise AssertionError(f"no reservation c{n}")


BudgetMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBudgetMachine = BudgetMachine.TestCase
