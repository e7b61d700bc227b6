"""rules/counts: a count written as text, read without trusting str.isdigit() or int()."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from effectguard.rules.counts import parse_count


@pytest.mark.parametrize(
    ("text", "most", "expected"),
    [
        ("0", 5, 0),
        ("5", 5, 5),
        ("6", 5, 6),
        ("0007", 5, 6),
        ("9" * 5000, 5, 6),  # past int()'s 4,300-digit limit
        ("0" * 5000 + "3", 5, 3),
        ("²", 5, None),  # isdigit() is True, int() refuses it
        ("١٢", 50, None),  # Arabic-Indic digits: int() would take them
        ("", 5, None),
        ("-1", 5, None),
        ("+1", 5, None),
        (" 1", 5, None),
        ("1.0", 5, None),
    ],
)
def test_parse_count(text: str, most: int, expected: int | None) -> None:
    assert parse_count(text, most) == expected


@given(st.integers(min_value=0, max_value=10**30), st.integers(min_value=0, max_value=10**20))
def test_a_decimal_count_reads_as_itself_up_to_most_plus_one(value: int, most: int) -> None:
    assert parse_count(str(value), most) == min(value, most + 1)


@given(st.text(max_size=20))
def test_any_text_is_a_count_or_none_and_never_raises(text: str) -> None:
    got = parse_count(text, 1000)
    assert got is None or (0 <= got <= 1001 and text.isascii())
