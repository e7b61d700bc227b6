"""JSON objects that name a key once: RFC 8259 §4 leaves a repeated name's meaning to each
parser, so a document that repeats one means different things to different readers."""

from __future__ import annotations

from typing import Any


class RepeatedKey(ValueError):
    """A JSON object names one key twice."""


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A ``json.loads`` ``object_pairs_hook``: the object, or :class:`RepeatedKey`."""
    found = dict(pairs)
    if len(found) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise RepeatedKey(f"the key {key!r} appears twice in one object")
            seen.add(key)
    return found
