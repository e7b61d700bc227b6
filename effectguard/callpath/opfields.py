"""Writing effectguard's own fields (an idempotency key, an operation id) into a body.

A JSON field is a dotted path (``metadata.effectguard_op``); a form field is a name as the
form spells it (``metadata[effectguard_op]``). The client's request is hashed before these
are written, so the hash is over the request as the client sent it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlencode

FORM = "application/x-www-form-urlencoded"


class Unwritable(ValueError):
    """The body has no place for the field (a path goes through a non-object)."""


def writable(parsed: dict[str, Any], path: str) -> bool:
    """Whether a JSON object has room for ``path`` (every step above it is an object)."""
    node: Any = parsed
    for step in path.split(".")[:-1]:
        node = node.get(step, {}) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            return False
    return True


def write(body: bytes, content_type: str, fields: Sequence[tuple[str, str]]) -> bytes:
    """``body`` with ``fields`` set: appended to a form body, else set in a JSON object."""
    if content_type.split(";")[0].strip().lower() == FORM:
        extra = urlencode(list(fields))
        return body + b"&" + extra.encode() if body else extra.encode()
    parsed = json.loads(body) if body else {}
    if not isinstance(parsed, dict):
        raise Unwritable("the body is not a JSON object")
    for path, value in fields:
        *parents, last = path.split(".")
        node = parsed
        for step in parents:
            node = node.setdefault(step, {})
            if not isinstance(node, dict):
                raise Unwritable(f"{path}: {step} is not an object")
        node[last] = value
    return json.dumps(parsed, separators=(",", ":"), ensure_ascii=False).encode()
