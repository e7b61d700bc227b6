"""The fast canonical encoder writes exactly json's canonical text, for any JSON value.

The reference below is the canonical form as ledgers have always hashed it. Every
value either encodes to the same text with both, or is refused by both with the same
exception type: orjson is only allowed where it agrees, and the fallback is json.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import sys
import tracemalloc
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from effectguard.rules import canonical
from effectguard.rules.canonical import canonical_json
from effectguard.rules.events import CallManifest

REFERENCE = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)

#: Any code point, lone surrogates included (json keeps them; orjson refuses them).
TEXT = st.text(st.characters(min_codepoint=0, max_codepoint=sys.maxunicode, categories=None))
LEAVES = (
    st.none()
    | st.booleans()
    | st.integers()  # unbounded: past 64 bits orjson refuses, json writes them
    | st.integers(min_value=-(2**64), max_value=2**64)
    | st.floats()  # NaN, infinities, subnormals, -0.0
    | st.floats(min_value=1e-12, max_value=1e-3)
    | TEXT
)
KEYS = TEXT | st.sampled_from(["a", "b", "é", "\U0001f600", "\ud800"])
VALUES = st.recursive(
    LEAVES,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(KEYS, inner, max_size=4)
    ),
    max_leaves=12,
)


def _outcome(encode: Any, value: Any) -> tuple[str, Any]:
    try:
        return "ok", encode(value)
    except Exception as exc:  # the same refusal is part of the same behaviour
        return "raised", type(exc)


@settings(max_examples=1500)
@given(st.dictionaries(KEYS, VALUES, max_size=6))
@example({"x": 1e-5})
@example({"x": 1e-06})
@example({"x": 9.99e-05})
@example({"x": float("nan"), "y": float("inf"), "z": -float("inf")})
@example({"x": 2**64, "y": -(2**63) - 1})
@example({"x": "\ud800"})
@example({"\ud800": 1})
@example({"x": 1e16, "y": 1e22, "z": -0.0, "w": 5e-324})
@example({"x": '\x00\x1f\x7f\u2028\u2029"\\/'})
@example({"b": 1, "a": {"d": [1, {"c": 2}], "c": None}})
def test_fast_encoder_is_byte_identical_to_json(value: dict[str, Any]) -> None:
    """Any dict of JSON values (any text, any int, any float, nested) encodes the same."""
    assert _outcome(canonical_json, value) == _outcome(REFERENCE.encode, value)


@given(VALUES)
def test_any_value_encodes_the_same(value: Any) -> None:
    """Not only dicts: lists, scalars and tuples too (json handles them; so must we)."""
    assert _outcome(canonical_json, value) == _outcome(REFERENCE.encode, value)


@given(st.dictionaries(st.integers() | st.booleans() | st.none() | st.floats(), LEAVES))
def test_non_string_keys_encode_as_json_does(value: dict[Any, Any]) -> None:
    """json turns int, float, bool and None keys into strings (or refuses mixed ones)."""
    assert _outcome(canonical_json, value) == _outcome(REFERENCE.encode, value)


def test_a_subclass_falls_back_to_json() -> None:
    """A str/int/dict subclass goes to json (orjson would write it its own way)."""

    class Key(str):
        pass

    class Amount(int):
        def __repr__(self) -> str:
            return "forty-two"

    value = {"a": Key("x"), "b": Amount(42), "c": {Key("k"): 1}}
    assert canonical_json(value) == REFERENCE.encode(value)


@dataclasses.dataclass
class _Point:
    x: int


def test_what_json_refuses_is_refused() -> None:
    """A dataclass or a datetime inside the data is refused as json refuses it (orjson
    would otherwise write it, and a digest would cover text json never made)."""
    for value in ({"p": _Point(1)}, {"t": dt.datetime(2026, 1, 1)}, {"d": dt.date(2026, 1, 1)}):
        assert _outcome(canonical_json, value) == ("raised", TypeError)
        assert _outcome(REFERENCE.encode, value) == ("raised", TypeError)


def test_an_event_takes_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real event's data is written by orjson, not by the fallback."""
    manifest = CallManifest(
        call="call_x",
        request_hash="h",
        provider="openai",
        endpoint="/v1/chat/completions",
        method="POST",
        model="gpt-x",
        idempotency_key=None,
        budget="team/run",
        budget_root="team",
        effect_kind="billable",
        body='{"messages": [{"content": "é"}]}',
        at=1796100121.8168352,
        provider_idempotency_window_s=86400.0,
    )
    data = manifest.to_data()
    expected = REFERENCE.encode(data)

    class Refuse:
        def encode(self, value: Any) -> str:
            raise AssertionError("fell back to json")

    monkeypatch.setattr(canonical, "_CANONICAL", Refuse())
    assert canonical_json(data) == expected


def test_a_long_text_is_encoded_without_a_tenfold_buffer() -> None:
    """A large body stored in its manifest costs about twice its size to encode, not the
    ten times orjson reserves for a long string (1.4 GB for ten 10 MiB bodies at once)."""
    text = "x" * (4 * 2**20)
    tracemalloc.start()
    try:
        encoded = canonical_json({"body": text, "n": 1})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert encoded == json.dumps({"body": text, "n": 1}, sort_keys=True, separators=(",", ":"))
    assert peak < 3 * len(text), peak
