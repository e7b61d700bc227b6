"""How a lookup's answer reads (docs/contract.md §2.2, §4). Pure: no I/O, no clock.

A provider lookup answers "was operation K applied?". Its declaration names a JSON path
whose presence means applied, the statuses that mean "not found", the JSON path of the
answer's result collection (``results``), and how far the provider's search lags
(``freshness_s``). "Not found" needs positive evidence: a declared not-found status that
is an error status (a 404), or a success whose body is well-formed JSON with the declared
result collection present and empty. A 200 that is an HTML error page, or JSON without the
collection, proves nothing. Anything else is unknown: effectguard never
guesses. "Not found" proves "not applied" only for an operation older than the
freshness, since a search index may not show a recent operation yet, and only for
one younger than the provider's declared retention (``retention_s``), since a provider
that forgets old operations (Postmark keeps messages 45 days by default, as little as 7)
answers "not found" for an operation it did apply long ago.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Final, Literal

Verdict = Literal["applied", "not_applied", "unknown"]

_STEP: Final = re.compile(r"([^.\[\]]+)|\[(\d+)\]")
_ABSENT: Final = object()


@dataclass(frozen=True, slots=True)
class Reading:
    """What a lookup's answer says: the verdict, why, and the applied object, if any."""

    verdict: Verdict
    why: str
    #: The value at the applied path, when the verdict is applied and it is a JSON object.
    found: dict[str, Any] | None = None


def digest(body: bytes) -> str:
    """The evidence's digest, as recorded with a decision: ``sha256:<hex>``."""
    return "sha256:" + hashlib.sha256(body).hexdigest()


def at_path(value: Any, path: str) -> Any:
    """The value at a JSON path (``data[0].id``, ``data.0``), or :data:`_ABSENT`."""
    node = value
    for name, index in _STEP.findall(path):
        key: str | int = int(index) if index else (int(name) if name.isdigit() else name)
        listed = isinstance(key, int) and isinstance(node, list) and 0 <= key < len(node)
        keyed = isinstance(key, str) and isinstance(node, dict) and key in node
        if not (listed or keyed):
            return _ABSENT
        node = node[key]
    return node


def present(value: Any) -> bool:
    """Whether a value counts as present: there, and not null, false or empty."""
    return value is not _ABSENT and value not in (None, False, "", [], {})


def empty(value: Any) -> bool:
    """Whether a result collection is there and empty: ``[]``, ``{}`` or ``false`` (the
    older ``{"applied": false}`` answer). Absent, null or anything else is not."""
    return value is False or (isinstance(value, list | dict) and not value)


def read_answer(
    status: int,
    body: bytes,
    *,
    applied: str,
    not_found: Collection[int],
    freshness_s: float,
    age_s: float,
    retention_s: float | None = None,
    results: str | None = None,
) -> Reading:
    """Read one lookup answer for an operation whose last attempt started ``age_s`` ago
    (``retention_s``: how long the provider keeps an operation findable, if it forgets;
    ``results``: the JSON path of the result collection a success must show empty to read
    "not found")."""
    success = 200 <= status < 300
    try:
        parsed: Any = json.loads(body) if body else _ABSENT
    except (ValueError, UnicodeDecodeError):
        parsed = _ABSENT
    if success and parsed is not _ABSENT:
        value = at_path(parsed, applied)
        if present(value):
            found = value if isinstance(value, dict) else None
            return Reading("applied", f"{applied} is present", found)
    if status not in not_found:
        return Reading("unknown", f"status {status} is neither applied nor not found")
    if success:
        # A success proves absence only by saying so: a well-formed answer whose result
        # collection is there and empty. An HTML page, or JSON of another shape, is not.
        if parsed is _ABSENT:
            return Reading("unknown", f"status {status} but the answer is not JSON")
        if results is None:
            return Reading("unknown", f"status {status}, and no result collection is declared")
        if not empty(at_path(parsed, results)):
            return Reading("unknown", f"status {status} but {results} is not an empty collection")
    if age_s < freshness_s:
        return Reading(
            "unknown",
            f"not found, but the operation is {age_s:.0f}s old and the provider's search "
            f"may lag {freshness_s:.0f}s",
        )
    if retention_s is not None and age_s > retention_s:
        # The provider no longer keeps what it did then: absence proves nothing.
        return Reading(
            "unknown",
            f"not found, but the operation is {age_s:.0f}s old and the provider keeps "
            f"operations findable for {retention_s:.0f}s",
        )
    return Reading("not_applied", f"not found (status {status}) past the {freshness_s:.0f}s lag")
