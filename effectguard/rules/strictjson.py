"""A request body's JSON, read as every reader reads it alike (docs/contract.md §12). Pure.

Python's ``json`` accepts more than JSON, and what it accepts it cannot always give back:

* ``NaN``, ``Infinity`` and ``-Infinity`` are not JSON (RFC 8259 §6): a strict provider
  refuses them, a lenient one reads a number;
* a number beyond a double's range (``1e400``) is read as infinity: ``1e400`` and
  ``2e400`` would hash as one request, and a body effectguard rewrites (a JSON operation
  id, callpath/opfields) would go upstream as ``Infinity``, which is not JSON;
* a ``\\uD800`` escape that pairs with no other is no character: it cannot be hashed,
  stored or sent as UTF-8, and the request failed with a 500.

Each is refused (:class:`NotStrict`), before anything is recorded or sent.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Final

from effectguard.rules import jsonkeys

#: An escape that decodes to half of a surrogate pair; only a body holding one can hold a
#: lone half, so the full check runs only on those.
_SURROGATE_ESCAPE: Final = re.compile(rb"\\u[dD][89a-fA-F]")


class NotStrict(ValueError):
    """The body is JSON to a lenient reader only."""


def loads(raw: bytes) -> Any:
    """``raw`` parsed, with no key repeated in an object (:class:`jsonkeys.RepeatedKey`),
    nothing but strict JSON (:class:`NotStrict`), or ``ValueError`` as ``json.loads``."""
    value = json.loads(
        raw,
        object_pairs_hook=jsonkeys.unique_keys,
        parse_constant=_constant,
        parse_float=_finite,
    )
    if _SURROGATE_ESCAPE.search(raw):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise NotStrict(
                "a \\u escape names half a surrogate pair, which is no character"
            ) from exc
    return value


def _constant(name: str) -> float:
    raise NotStrict(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise NotStrict(f"the number {text[:40]} is beyond what a double holds")
    return value
