"""rules/nesting: the depth limit, walked level by level, agrees with a plain recursion."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from effectguard.rules.nesting import MAX_JSON_DEPTH, depth_exceeds


def depth(value: Any) -> int:
    """The reference: how many levels of objects and arrays ``value`` nests (0: a scalar)."""
    if isinstance(value, dict):
        return 1 + max((depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((depth(v) for v in value), default=0)
    return 0


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=2), inner),
    max_leaves=30,
)


@given(json_values, st.integers(min_value=0, max_value=8))
def test_depth_exceeds_agrees_with_the_recursive_depth(value: Any, limit: int) -> None:
    assert depth_exceeds(value, limit) == (depth(value) > limit)


def nested(levels: int) -> Any:
    value: Any = 1
    for i in range(levels):
        value = [value] if i % 2 else {"k": value}
    return value


def test_the_limit_itself_is_allowed_and_one_more_is_not() -> None:
    assert not depth_exceeds(nested(MAX_JSON_DEPTH))
    assert depth_exceeds(nested(MAX_JSON_DEPTH + 1))
    assert depth_exceeds(nested(5000))  # far past Python's own recursion limit
    assert not depth_exceeds("scalar") and not depth_exceeds([])
