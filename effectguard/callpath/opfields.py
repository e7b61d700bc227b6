"""Writing effectguard's own fields (an idempotency key, an operation id) into a body.

A JSON field is a dotted path (``metadata.effectguard_op``); a form field is a name as the
form spells it (``metadata[effectguard_op]``). The client's request is hashed before these
are written, so the hash is over the request as the client sent it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote, urlencode

FORM = "application/x-www-form-urlencoded"


class Unwritable(ValueError):
    """The body has no place for the field (a path goes through a non-object)."""


def writable(parsed: dict[str, Any], path: str) -> bool:
    """Whether a JSON object has room for ``path`` (every step above it is an object,
    absent, or ``null``: JSON's "no value", which SDKs send for an unset field)."""
    node: Any = parsed
    for step in path.split(".")[:-1]:
        node = _child(node, step) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            return False
    return True


def _child(node: dict[str, Any], step: str) -> Any:
    """``node[step]``, or a new empty object where it is absent or ``null``."""
    child = node.get(step)
    return {} if child is None else child


def supplied(parsed: dict[str, Any], name: str, where: str) -> bool:
    """Whether the client's own body already names field ``name``, as some reader of it
    would take it, so that the provider could read the client's value for effectguard's.

    A form field the client sent and the one effectguard appends would both reach the
    provider, which keeps the first or the last as its parser likes: any field that names
    the same one, percent-encoded once more, in another case, with white space, dotted
    (``metadata.effectguard_op``) or nested under it (``metadata[effectguard_op][]``),
    counts. A JSON body is rewritten whole, so a key at the exact path is simply replaced;
    only another spelling of it (``metadata`` for ``Metadata``) would reach the provider
    beside effectguard's, and a reader that ignores case may take either.
    """
    if where == "form":
        wanted = _form_key(name)
        # Encoded three times over, a character takes at most 7 characters: a key's head
        # of that length (and some white space) is all that can spell the field or the
        # start of one nested under it, and decoding a whole long key costs time.
        head = 8 * len(name) + 64
        keys = (_form_key(k[:head]) for k in parsed)
        return any(key == wanted or key.startswith(wanted + ".") for key in keys)
    steps = name.split(".")
    return _json_spelled(parsed, steps, exact=True)


def _form_key(key: str) -> str:
    """A form key as a lenient reader might take it: decoded until it stops changing,
    white space and controls dropped, case folded, ``a[b][c]`` spelled ``a.b.c``."""
    for _ in range(3):
        decoded = unquote(key)
        if decoded == key:
            break
        key = decoded
    kept = "".join(ch for ch in key if ch.isprintable() and not ch.isspace()).casefold()
    return kept.replace("][", ".").replace("[", ".").replace("]", "")


def _json_spelled(node: Any, steps: list[str], exact: bool) -> bool:
    """Whether ``node`` has ``steps`` spelled other than exactly (keys compared without
    case); ``exact``: the steps so far were spelled exactly."""
    if not steps:
        return not exact
    if not isinstance(node, dict):
        return False
    want = steps[0].casefold()
    return any(
        _json_spelled(child, steps[1:], exact and key == steps[0])
        for key, child in node.items()
        if isinstance(key, str) and key.casefold() == want
    )


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
            # postmarker sends "Metadata": null for an email without metadata: a null
            # parent has no value to keep, so it becomes the object the field goes in.
            node[step] = node = _child(node, step)
            if not isinstance(node, dict):
                raise Unwritable(f"{path}: {step} is not an object")
        node[last] = value
    return json.dumps(parsed, separators=(",", ":"), ensure_ascii=False).encode()
