"""How a body's bytes are stored as text in an event: UTF-8 as it is, or base64. Pure.

A request or response body goes into the ledger inside its event's JSON, which holds
text: bytes that are valid UTF-8 are kept as that text (readable in ``show``, and
smallest), any others as base64, with the encoding named beside them.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable


def encode_body(raw: bytes) -> tuple[str, str]:
    """Encode bytes for storage: ``(text, "utf8")`` or ``(base64, "base64")``."""
    try:
        return raw.decode("utf-8"), "utf8"
    except UnicodeDecodeError:
        return base64.b64encode(raw).decode("ascii"), "base64"


def decode_body(text: str, encoding: str) -> bytes:
    """Invert :func:`encode_body`."""
    if encoding == "base64":
        return base64.b64decode(text)
    return text.encode("utf-8")


#: A body at least this long (characters of its stored text) makes writing its event
#: bulk work: its JSON, its digest and its row take milliseconds per MiB. Below it (every
#: usual answer) the write stays where it is cheapest, inline. 256 KiB: about 1 ms.
BULK_TEXT = 256 * 1024


def carries_bulk(events: Iterable[object]) -> bool:
    """Whether any of ``events`` stores a body of at least :data:`BULK_TEXT` characters."""
    return any(len(getattr(e, "body", None) or "") >= BULK_TEXT for e in events)
