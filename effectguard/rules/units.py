"""How many billed units a request names (an email's recipients), for an endpoint that
declares ``units``: the provider bills each, so a call is reserved and charged for all.

Counting errs on the side of too many, never too few, because a budget that undercounts
admits more than its worth:

* a field is matched in any case (``to``, ``TO`` as well as ``To``): a provider whose JSON
  reader ignores case (as .NET's commonly do) sends to a lowercase ``to`` just the same,
  and an object naming one field in two cases counts both;
* an entry is counted wherever the separator splits, so a display name holding one
  (``"Doe, Jo" <jo@example.com>``) counts twice;
* where the endpoint sends many messages in one request (``items``: Postmark's
  ``/email/batchWithTemplates`` takes ``{"Messages": [...]}``), every message counts, at
  least once each, whatever it names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class BadUnits(ValueError):
    """The request names its units in a shape that cannot be counted; ``param`` says where."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def count_units(
    body: dict[str, Any], fields: Sequence[str], separator: str, items: str | None = None
) -> int:
    """The units ``body`` names (at least one): the entries of its ``fields``, or, where
    ``items`` is declared and the body has it, the sum over each of its messages."""
    if items is None:
        return max(1, _entries(body, fields, separator))
    messages = [value for key, value in body.items() if _same(key, items)]
    if not messages:
        return max(1, _entries(body, fields, separator))
    total = 0
    for value in messages:
        if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
            raise BadUnits(f"{items} must be a list of JSON objects", items)
        total += sum(max(1, _entries(m, fields, separator)) for m in value)
    return max(1, total)


def _entries(body: dict[str, Any], fields: Sequence[str], separator: str) -> int:
    """The non-blank entries of every top-level string field named in ``fields``, in any
    case; a field that is present and not a string (or null) cannot be counted."""
    count = 0
    for key, value in body.items():
        if value is None or not any(_same(key, name) for name in fields):
            continue
        if not isinstance(value, str):
            raise BadUnits(f"{key} must be a string", key)
        count += sum(1 for entry in value.split(separator) if entry.strip())
    return count


def _same(key: str, name: str) -> bool:
    return key.casefold() == name.casefold()
