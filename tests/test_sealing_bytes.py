"""Sealing and the SQLite row give byte-identical digests and rows to the plain forms.

The write path caches what repeats between the events of one operation (the text of
their shared ``at``, the stored form of their call id). The references below are the
forms the ledgers were written with, without any caching: digests and rows must not
move, whatever order events and values come in.
"""

from __future__ import annotations

import hashlib
import re
import sys
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from effectguard.ledger import sqliteevents
from effectguard.rules.events import event_digest

TEXT = st.text(st.characters(min_codepoint=0, max_codepoint=sys.maxunicode, categories=None))
CALL_IDS = (
    st.binary(min_size=16, max_size=16).map(lambda b: "call_" + b.hex())
    | st.sampled_from(["call_x", "call_" + "A" * 32, "call_" + "0" * 31 + " ", "other"])
    | TEXT
)


def reference_digest(
    *,
    seq: int,
    kind: str,
    call_id: str | None,
    data_json: str,
    worker: str,
    generation: int,
    at: float,
    prev_digest: str,
) -> str:
    """The digest as ledgers have always been sealed (three updates, repr each time)."""
    h = hashlib.sha256()
    header = f"{seq}\x1f{kind}\x1f{call_id or ''}\x1f{worker}\x1f{generation}\x1f{at!r}\x1f"
    h.update(prev_digest.encode("ascii"))
    h.update(header.encode("utf-8"))
    h.update(data_json.encode("utf-8"))
    return h.hexdigest()


def _outcome(digest: Any, **fields: Any) -> tuple[str, Any]:
    try:
        return "ok", digest(**fields)
    except Exception as exc:  # a lone surrogate cannot be hashed: the same refusal
        return "raised", type(exc)


def reference_call_key(call_id: str) -> bytes | str:
    """The events' ``call_id`` column as format 2 defines it."""
    return bytes.fromhex(call_id[5:]) if re.fullmatch(r"call_[0-9a-f]{32}", call_id) else call_id


EVENTS = st.lists(
    st.fixed_dictionaries(
        {
            "seq": st.integers(min_value=1, max_value=2**40),
            "kind": TEXT,
            "call_id": st.none() | CALL_IDS,
            "data_json": TEXT,
            "worker": TEXT,
            "generation": st.integers(min_value=0, max_value=2**31),
            "prev_digest": st.text("0123456789abcdef", min_size=64, max_size=64),
        }
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=400)
@given(EVENTS, st.lists(st.floats(), min_size=1, max_size=3))
@example(
    [
        {
            "seq": 1,
            "kind": "k",
            "call_id": None,
            "data_json": "{}",
            "worker": "w",
            "generation": 0,
            "prev_digest": "0" * 64,
        }
    ]
    * 2,
    [0.0, -0.0],
)
def test_digests_are_the_reference_digests(events: list[dict[str, Any]], ats: list[float]) -> None:
    """Events sharing one ``at`` object, then another (equal or not), digest as before."""
    for at in ats:
        for fields in events:
            assert _outcome(event_digest, at=at, **fields) == _outcome(
                reference_digest, at=at, **fields
            )


def test_equal_times_with_different_text_are_not_confused() -> None:
    """0.0 and -0.0 are equal floats with different reprs: each digest covers its own."""
    fields: dict[str, Any] = {
        "seq": 1,
        "kind": "k",
        "call_id": None,
        "data_json": "{}",
        "worker": "w",
        "generation": 0,
        "prev_digest": "0" * 64,
    }
    plus, minus = 0.0, -0.0
    assert event_digest(at=plus, **fields) == reference_digest(at=plus, **fields)
    assert event_digest(at=minus, **fields) == reference_digest(at=minus, **fields)
    assert event_digest(at=plus, **fields) != event_digest(at=minus, **fields)


@settings(max_examples=400)
@given(st.lists(CALL_IDS, min_size=1, max_size=8))
def test_call_keys_are_the_reference_keys(call_ids: list[str]) -> None:
    """Repeated and alternating call ids are each stored as format 2 defines."""
    for call_id in call_ids + call_ids[::-1] + call_ids:
        assert sqliteevents.call_key(call_id) == reference_call_key(call_id)
        assert sqliteevents.call_from_key(sqliteevents.call_key(call_id)) == call_id
