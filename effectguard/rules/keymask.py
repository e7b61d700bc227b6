"""The provider key masked out of an upstream's error answer. Pure.

Some providers quote the key a request carried in their refusal of it ("Incorrect API
key provided: sk-..."). Where effectguard holds the key for its tenants, such an answer
would hand it to the tenant, and the ledger, ``show`` and the logs would keep it. So an
answer that is not a success has each whole occurrence of the key replaced by
:data:`MASK` before anything stores, logs or forwards it (docs/contract.md, "Secrets").

Only whole occurrences: a provider's partial echo (OpenAI's ``sk-abc***...wxyz``, a few
characters at each end) is left as the provider wrote it, since matching fragments of a
key would rewrite ordinary text. A 2xx answer is never searched: no provider echoes a key
it accepted, and a success's body is the hot path's and can be large.
"""

from __future__ import annotations

import json
import re

__all__ = ["MASK", "key_forms", "key_of", "mask_forms", "mask_key"]

#: What stands in an answer where the provider key was.
MASK = b"[provider key masked]"

#: A shorter "key" is no secret worth the risk of rewriting ordinary words of the answer.
MIN_KEY_LENGTH = 8


def key_of(credential: str | None, key_format: str) -> str | None:
    """The key inside the ``credential`` header value a request carried (``Bearer sk-..``
    for a ``key_format`` of ``Bearer {key}``); the whole value if it does not have the
    declared form (a client's own credential, written its own way)."""
    if credential is None:
        return None
    around = key_format.format(key="\x00").split("\x00")
    if len(around) == 2:
        before, after = around
        end = len(credential) - len(after)
        if credential.startswith(before) and credential.endswith(after) and end > len(before):
            return credential[len(before) : end]
    return credential


def key_forms(key: str | None) -> tuple[bytes, ...]:
    """The byte strings ``key`` may be written as in an answer: as it is, and as a JSON
    string writes it (``\\u00e9`` escapes in small letters or, as Jackson writes them, in
    capitals), each also with ``/`` written ``\\/`` (PHP's ``json_encode`` escapes ``"``
    and ``/`` together); none for a key too short to mask.

    A key holding non-ASCII characters is sent as UTF-8 bytes, and a provider that reads
    header bytes as Latin-1 (HTTP's old charset: Node, Python's ``http.server``) quotes
    that reading (``sk-tÃ©st`` for ``sk-tést``), from which anyone gets the key back: it
    is searched for in the same forms."""
    if key is None or len(key) < MIN_KEY_LENGTH:
        return ()
    readings = {key, key.encode().decode("latin-1")}
    written = {form for text in readings for form in _json_forms(text)}
    forms = {form.encode() for text in written for form in (text, text.replace("/", "\\/"))}
    # Longest first: a shorter form inside a longer one must not break the longer's match.
    return tuple(sorted(forms, key=len, reverse=True))


def _json_forms(text: str) -> tuple[str, ...]:
    """``text`` as it is, and as a JSON string's inside, its escapes in either case."""
    escaped = json.dumps(text)[1:-1]
    return text, escaped, _ESCAPE.sub(lambda m: "\\u" + m.group(1).upper(), escaped)


#: A JSON ``\\uXXXX`` escape as Python's ``json`` writes it (small letters).
_ESCAPE = re.compile(r"\\u([0-9a-f]{4})")


def mask_key(body: bytes, key: str | None) -> bytes:
    """``body`` with every whole occurrence of ``key`` (:func:`key_forms`) replaced by
    :data:`MASK`."""
    return mask_forms(body, key_forms(key))


def mask_forms(body: bytes, forms: tuple[bytes, ...]) -> bytes:
    """``body`` with every occurrence of each of ``forms`` replaced by :data:`MASK`."""
    for form in forms:
        if form in body:
            body = body.replace(form, MASK)
    return body
