"""How a lookup's answer reads (docs/contract.md §2.2, §4). Pure: no I/O, no clock.

A provider lookup answers "was operation K applied?". Its declaration names a JSON path
whose presence means applied, the statuses that mean "not found", the JSON path of the
answer's result collection (``results``), and how far the provider's search lags
(``freshness_s``). "Not found" needs positive evidence: a declared not-found status that
is an error status (a 404), or a success whose body is well-formed JSON with the declared
result collection present and empty. A 200 that is an HTML error page, or JSON without the
collection, proves nothing, and so does any success that is not plainly the shape its
declaration names: not served as JSON; JSON that two readers may read differently
(duplicate keys, ``NaN``, nesting past the request limit); a collection that is not a
list of objects; or, where the declaration says where a found object carries its
operation id (``match``), an object for another operation. Anything else is unknown:
effectguard never guesses. "Not found" proves "not applied" only for an operation the
provider was given on every attempt, where and in the account the lookup searched
(``blind``: why a search finds nothing either way, :mod:`effectguard.rules.searched`),
only for one older than the freshness, since a search index may not
show a recent operation yet, and only for one younger than the provider's declared
retention (``retention_s``), since a provider that forgets old operations (Postmark
keeps messages 45 days by default, as little as 7) answers "not found" for an operation
it did apply long ago.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Final, Literal

from effectguard.rules import jsonkeys, nesting

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
    """Whether a value counts as present: there, and not null, false, 0 or empty."""
    return value is not _ABSENT and value not in (None, False, "", [], {})


def empty(value: Any, flag: bool = False) -> bool:
    """Whether a result collection is there and empty: ``[]``, or, where the collection
    is the older answer's flag (``flag``: ``{"applied": false}``), ``false``. An object,
    a string, null or absence is not: a search that answers so answered something else."""
    return value is False if flag else value == []


def parse_json(body: bytes, content_type: str | None) -> tuple[Any, str]:
    """An answer's JSON, strictly, or :data:`_ABSENT` with why not.

    A lookup answer is evidence about money, so it is read only where every reader would
    read it the same way: declared as JSON by its ``Content-Type``, UTF-8, no duplicate
    keys (one reader takes the first, another the last), no ``NaN`` or ``Infinity`` (not
    JSON, and never replayable as a result), nested no deeper than a request may be.
    """
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if not (media.endswith("/json") or media.endswith("+json")):
        return _ABSENT, f"its Content-Type is {media or 'missing'}, not JSON"
    try:
        parsed = json.loads(
            body.decode("utf-8"),
            object_pairs_hook=jsonkeys.unique_keys,
            parse_constant=_no_constant,
        )
    except (ValueError, UnicodeDecodeError) as exc:
        return _ABSENT, f"the answer is not JSON ({type(exc).__name__}: {exc!s:.80})"
    except RecursionError:  # deeper than the parser's own stack
        return _ABSENT, f"the answer nests deeper than {nesting.MAX_JSON_DEPTH} levels"
    if isinstance(parsed, dict | list) and nesting.depth_exceeds(parsed):
        return _ABSENT, f"the answer nests deeper than {nesting.MAX_JSON_DEPTH} levels"
    return parsed, ""


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def malformed(parsed: Any, applied: str, results: str | None) -> str | None:
    """Why a well-formed JSON answer is not the shape its declaration names (None: it
    is). The result collection, where declared and present, is a list of JSON objects;
    where it is the applied path itself (the older ``{"applied": true|false}``), a
    boolean. Anything else there is an answer to some other question."""
    if results is None:
        return None
    value = at_path(parsed, results)
    if value is _ABSENT:
        return None  # no collection: proves neither way (read below)
    if results == applied:
        return None if isinstance(value, bool) else f"{results} is neither true nor false"
    if not isinstance(value, list):
        return f"{results} is {type(value).__name__}, not a list"
    if not all(isinstance(item, dict) for item in value):
        return f"{results} holds something that is not a JSON object"
    return None


def applied_reading(value: Any, applied: str, match: str | None, op: str | None) -> Reading:
    """The reading of an answer whose ``applied`` path is present. Where the declaration
    names ``match`` (the path, inside the found object, of the operation id it carries),
    the object must be this operation's: one for another operation proves nothing."""
    found = value if isinstance(value, dict) else None
    if match is not None:
        carried = at_path(found, match) if found is not None else _ABSENT
        if op is None or carried != op:
            shown = "absent" if carried is _ABSENT else f"{carried!r:.80}"
            return Reading("unknown", f"{applied} is not this operation's: {match} is {shown}")
    return Reading("applied", f"{applied} is present", found)


def read_answer(
    status: int,
    body: bytes,
    *,
    content_type: str | None,
    applied: str,
    not_found: Collection[int],
    freshness_s: float,
    age_s: float,
    retention_s: float | None = None,
    results: str | None = None,
    match: str | None = None,
    op: str | None = None,
    blind: str | None,
) -> Reading:
    """Read one lookup answer for operation ``op`` whose last attempt started ``age_s``
    ago (``retention_s``: how long the provider keeps an operation findable, if it
    forgets; ``results``: the JSON path of the result collection a success must show
    empty to read "not found"; ``match``: where a found object carries its op id;
    ``blind``: why "not found" cannot prove "not applied", if it cannot)."""
    success = 200 <= status < 300
    if success:
        parsed, why = parse_json(body, content_type)
        if parsed is _ABSENT:
            return Reading("unknown", f"status {status} but {why}")
        shape = malformed(parsed, applied, results)
        if shape is not None:
            return Reading("unknown", f"status {status} but {shape}")
        value = at_path(parsed, applied)
        if present(value):
            return applied_reading(value, applied, match, op)
    if status not in not_found:
        return Reading("unknown", f"status {status} is neither applied nor not found")
    if not success:
        # An error status says "not found" only in the provider's own words: a gateway's
        # or a moved endpoint's HTML 404 would otherwise make every unknown call resend.
        parsed, why = parse_json(body, content_type)
        if parsed is _ABSENT:
            return Reading("unknown", f"status {status} but {why}")
    if success:
        # A success proves absence only by saying so: a well-formed answer whose result
        # collection is there and empty. An HTML page, or JSON of another shape, is not.
        if results is None:
            return Reading("unknown", f"status {status}, and no result collection is declared")
        if not empty(at_path(parsed, results), flag=results == applied):
            return Reading("unknown", f"status {status} but {results} is not an empty collection")
    if blind is not None:
        # A search for an id the provider may never have been given, or made elsewhere,
        # finds nothing either way.
        return Reading("unknown", f"not found, but {blind}")
    return _not_found(status, freshness_s, age_s, retention_s)


def _not_found(status: int, freshness_s: float, age_s: float, retention_s: float | None) -> Reading:
    """ "Not found", as far as the operation's age lets it prove "not applied"."""
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
