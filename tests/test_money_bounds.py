"""Money never overflows a stored counter: request fields are bounded, counters saturate.

Pure-core properties with huge values (docs/contract.md §12, isolation): whatever a request or a
provider says, no amount the rules produce exceeds what a signed 64-bit column holds.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from effectguard.rules import budget
from effectguard.rules.budget import BudgetNode, check_admission
from effectguard.rules.events import (
    BudgetHeld,
    BudgetLimitSet,
    BudgetReleased,
    BudgetReserved,
    BudgetSettled,
    BudgetUnheld,
    Event,
)
from effectguard.rules.money import MAX_CALL_NANOS, MAX_NANOS, check_amount, usd_to_nanos
from effectguard.rules.prices import ModelPrice
from effectguard.rules.settlement import Answer, settle
from effectguard.rules.usage import (
    MAX_CHOICES,
    OutOfBounds,
    Usage,
    UsageResult,
    estimate,
)

PRICE = ModelPrice(input=usd_to_nanos("3"), output=usd_to_nanos("15"), max_output_tokens=16384)
HUGE = st.integers(min_value=-(2**200), max_value=2**200)
ANY_JSON_NUMBER = st.one_of(HUGE, st.floats(allow_nan=False), st.booleans(), st.text(max_size=3))


@given(
    field=st.sampled_from(["max_tokens", "max_completion_tokens", "max_output_tokens"]),
    value=ANY_JSON_NUMBER,
)
def test_token_caps_are_bounded_by_the_declared_maximum(field: str, value: Any) -> None:
    """A token cap counts only as an integer up to the model's maximum; else refused by name."""
    request = {"messages": [{"role": "user", "content": "hi"}], field: value}
    valid = type(value) is int and 0 <= value <= PRICE.max_output_tokens
    if valid:
        assert 0 <= estimate(PRICE, request) <= MAX_CALL_NANOS
    else:
        with pytest.raises(OutOfBounds) as caught:
            estimate(PRICE, request)
        assert caught.value.field == field


@given(field=st.sampled_from(["n", "best_of"]), value=ANY_JSON_NUMBER)
def test_choice_counts_are_bounded(field: str, value: Any) -> None:
    """n and best_of multiply the output only as integers in 1..MAX_CHOICES; else refused."""
    request = {"messages": [], "max_tokens": 10, field: value}
    if type(value) is int and 1 <= value <= MAX_CHOICES:
        assert estimate(PRICE, request) == 10 * value * PRICE.output // 1_000_000
    else:
        with pytest.raises(OutOfBounds) as caught:
            estimate(PRICE, request)
        assert caught.value.field == field


def test_the_poisoned_requests_of_issue_13_are_refused() -> None:
    """The two bodies that overflowed a SQLite INTEGER are refused, naming their field."""
    for field, value in (("max_tokens", 20000000000000000), ("n", 1e17), ("n", 10**17)):
        with pytest.raises(OutOfBounds) as caught:
            estimate(PRICE, {"messages": [], field: value})
        assert caught.value.field == field


@given(price=st.integers(min_value=0, max_value=2**80))
def test_a_reservation_never_exceeds_one_calls_bound(price: int) -> None:
    """However a model is priced, a reservation is at most MAX_CALL_NANOS or refused."""
    model = ModelPrice(input=price, output=price, max_output_tokens=128_000)
    request = {"messages": [{"role": "user", "content": "x" * 1000}], "n": MAX_CHOICES}
    with contextlib.suppress(OutOfBounds):
        assert 0 <= estimate(model, request) <= MAX_CALL_NANOS


def test_flat_tool_bodies_are_not_read_as_token_caps() -> None:
    """A per-call priced tool's own fields (n, max_tokens) are not choice counts or caps."""
    tool = ModelPrice(input=0, output=0, max_output_tokens=0, per_call=usd_to_nanos("0.001"))
    assert estimate(tool, {"n": 10**30, "max_tokens": -1}, dialect="flat") == tool.per_call


_AMOUNT = st.integers(min_value=0, max_value=2**70)
_EVENTS = st.lists(
    st.one_of(
        st.builds(BudgetReserved, call=st.just("c"), budget=st.just("a/b"), amount=_AMOUNT),
        st.builds(
            BudgetSettled,
            call=st.just("c"),
            budget=st.just("a/b"),
            reserved=_AMOUNT,
            actual=_AMOUNT,
        ),
        st.builds(BudgetReleased, call=st.just("c"), budget=st.just("a"), amount=_AMOUNT),
        st.builds(BudgetHeld, call=st.just("c"), budget=st.just("a/b"), amount=_AMOUNT),
        st.builds(
            BudgetUnheld, call=st.just("c"), budget=st.just("a/b"), amount=_AMOUNT, spent=_AMOUNT
        ),
        st.builds(BudgetLimitSet, path=st.just("a"), limit=st.one_of(st.none(), _AMOUNT)),
    ),
    max_size=30,
)


@given(events=_EVENTS)
def test_counters_stay_within_a_64_bit_column(events: list[Event]) -> None:
    """Folding any budget events, however huge, leaves every counter in 0..MAX_NANOS."""
    tree = budget.fold(events)
    for node in tree.nodes.values():
        for value in (node.reserved, node.spent, node.held, node.limit or 0):
            assert 0 <= value <= MAX_NANOS
    for policy in tree.policies.values():
        assert 0 <= (policy.limit or 0) <= MAX_NANOS


@given(
    committed=st.integers(min_value=0, max_value=MAX_NANOS),
    amount=st.integers(min_value=0, max_value=2**100),
    limit=st.one_of(st.none(), st.integers(min_value=0, max_value=MAX_NANOS)),
)
def test_admission_never_lets_a_counter_pass_its_bound(
    committed: int, amount: int, limit: int | None
) -> None:
    """An admitted charge leaves the node within MAX_NANOS and within one call's bound."""
    nodes = {"a": BudgetNode("a", limit=limit, spent=committed)}
    exceeded = check_admission(nodes, "a/b", amount)
    if exceeded is None:
        assert amount <= MAX_CALL_NANOS
        assert committed + amount <= MAX_NANOS
    else:
        assert exceeded.path == "a"
        assert 0 <= exceeded.room <= MAX_CALL_NANOS


def test_an_unlimited_budget_refuses_what_would_overflow_it() -> None:
    """Two huge reservations on an unlimited budget no longer push a counter past 2^63."""
    nodes = {"a": BudgetNode("a", reserved=MAX_NANOS - MAX_CALL_NANOS // 2)}
    exceeded = check_admission(nodes, "a", MAX_CALL_NANOS)
    assert exceeded is not None and exceeded.room == MAX_CALL_NANOS // 2


@given(tokens=st.integers(min_value=0, max_value=2**53))
def test_a_settlement_never_charges_more_than_one_call_may(tokens: int) -> None:
    """Believed usage whose cost is beyond MAX_CALL_NANOS is absurd: settled at the reservation."""
    usage = Usage(input_tokens=tokens, output_tokens=tokens)
    answer = Answer(200, False, {}, "{}", "utf-8", UsageResult(usage, None))
    settled = settle("c", 1, "a", 1000, PRICE, answer)
    assert settled.actual is not None and 0 <= settled.actual <= MAX_CALL_NANOS
    if settled.usage is None:
        assert settled.actual == 1000


@given(value=st.integers(min_value=-(2**100), max_value=2**100))
def test_check_amount_accepts_exactly_what_a_counter_holds(value: int) -> None:
    """check_amount passes 0..MAX_NANOS and refuses everything else."""
    if 0 <= value <= MAX_NANOS:
        assert check_amount(value) == value
    else:
        with pytest.raises(ValueError):
            check_amount(value)


def test_a_limit_beyond_a_counter_is_refused() -> None:
    """A budget limit no 64-bit column can hold is refused."""
    assert budget.validate_limit(MAX_NANOS) == MAX_NANOS
    with pytest.raises(ValueError):
        budget.validate_limit(MAX_NANOS + 1)


@pytest.mark.parametrize("text", ["1e999999", "-1e999999", "1e31"])
def test_an_amount_past_any_counter_is_a_value_error(text: str) -> None:
    """usd_to_nanos refuses an amount no counter holds before multiplying it out (Decimal
    would overflow, or build an integer of a million digits)."""
    with pytest.raises(ValueError, match="out of range"):
        usd_to_nanos(text)


def test_an_amount_below_a_nano_rounds_up_to_one_however_small() -> None:
    """Rounding up holds at any exponent: 1e-999999999 USD is one nano, not zero."""
    assert usd_to_nanos("1e-999999999") == usd_to_nanos("1e-10") == 1
    assert usd_to_nanos("-1e-999999999") == 0
