"""The canonical JSON of an event's data: what its digest covers, written fast.

The canonical form is json's, sorted keys, no spaces, ``ensure_ascii=False``
(:data:`_CANONICAL`): ledgers hold digests over exactly that text. orjson writes
the same text several times faster for almost every value an event holds, and
:func:`canonical_json` uses it only where it provably agrees (property tests in
tests/test_canonical_json.py over any JSON value).
"""

from __future__ import annotations

import json
import math
from typing import Any

import orjson

# One encoder for the process: json.dumps builds a new one per call when given options.
# This is the definition of the canonical form; orjson below is only a faster way to
# write the same bytes.
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)
# Subclasses of str/int/dict/list, dataclasses and datetimes go to a `default` we do not
# give, so orjson raises where json would encode them differently (or refuse them).
_ORJSON = (
    orjson.OPT_SORT_KEYS
    | orjson.OPT_PASSTHROUGH_SUBCLASS
    | orjson.OPT_PASSTHROUGH_DATACLASS
    | orjson.OPT_PASSTHROUGH_DATETIME
)
#: Below this magnitude orjson writes some floats unlike ``repr`` (``1e-6`` for ``1e-06``).
_SMALLEST_SAME_FLOAT = 1e-4
#: Text longer than this (a large request body stored in its manifest) goes to json's
#: encoder: for a 13 MiB body orjson peaked at 140 MiB of heap, json at 27 MiB. json is
#: slower on it (31 ms against 6 ms), a price paid only by such bodies, for a heap that
#: ten of them at once cannot blow up (1.4 GB with orjson).
_LONG_TEXT = 64 * 1024


def _orjson_suits(values: Any) -> bool:
    """Whether orjson may write ``values`` (nested): every float is one it writes as json
    does (zero, or finite and at least 1e-4 in magnitude; NaN and infinities: json writes
    ``NaN``, orjson ``null``), and no text is long enough that orjson's output buffer
    (reserved at about ten bytes per character before it is shrunk) would cost more
    memory than the encoding saves time."""
    for v in values:
        t = type(v)
        # Most of an event's values are short text, integers and None: let them pass first.
        if t is str:
            if len(v) > _LONG_TEXT:
                return False
            continue
        if t is int or v is None:
            continue
        if t is float:
            if not (v == 0.0 or _SMALLEST_SAME_FLOAT <= abs(v) < math.inf):
                return False
        elif t is dict:
            if not _orjson_suits(v.values()):
                return False
        elif (t is list or t is tuple) and not _orjson_suits(v):
            return False
    return True


def canonical_json(value: Any) -> str:
    """Deterministic JSON (sorted keys, no spaces) used for digests and storage.

    Written by orjson (about 2.5x faster on an event) wherever it gives the very same
    text as the json encoder above, which tests/test_canonical_json.py checks over any
    JSON value: otherwise (small or non-finite floats; text over 64 KiB; what orjson
    refuses: integers beyond 64 bits, keys that are not strings, lone surrogates,
    subclasses) by json.
    """
    kind = type(value)
    if (kind is dict and _orjson_suits(value.values())) or (
        (kind is list or kind is tuple) and _orjson_suits(value)
    ):
        try:
            return orjson.dumps(value, option=_ORJSON).decode("utf-8")
        except TypeError:  # orjson.JSONEncodeError is a TypeError
            pass
    return _CANONICAL.encode(value)
