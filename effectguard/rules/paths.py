"""Request paths under a provider's base path (docs/contract.md §12, Paths), pure.

A proxy route ``/{provider}/{rest}`` and a transport URL both name a path *below*
a provider's declared base URL. ``rest`` goes upstream appended to that base, so
anything that could make the upstream resolve it elsewhere is refused here,
before routing, hashing or recording:

* dot segments (``.``, ``..``), also percent-encoded (``%2e%2e``) or with path
  parameters (``..;x``);
* encoded separators (``%2f``, ``%5c``) and backslashes, which some servers
  decode or treat as ``/`` after we have checked the segments;
* control characters, raw or encoded (``%09``, ``%00``), and anything that is
  not printable ASCII on the wire;
* malformed percent escapes.

What passes is returned unchanged (still percent-encoded), so the provider sees
exactly the bytes the client sent.
"""

from __future__ import annotations

import functools
import re
from typing import Final

_ESCAPE: Final = re.compile(r"%([0-9A-Fa-f]{2})")
_BAD_ESCAPE: Final = re.compile(r"%(?![0-9A-Fa-f]{2})")
#: Escapes that decode to a separator: ``/`` and ``\``.
_SEPARATORS: Final = frozenset({0x2F, 0x5C})
#: Anything but printable ASCII (space included).
_UNPRINTABLE: Final = re.compile(r"[^\x21-\x7e]")


class PathRefused(ValueError):
    """The path would leave the provider's base path or is not a clean path."""


@functools.lru_cache(maxsize=4096)
def check_path(raw: str) -> str:
    """Return ``raw`` (a percent-encoded path starting with ``/``) if it stays below its base.

    Raises :class:`PathRefused` naming the problem otherwise. Every request is checked
    twice (its route, then its URL below the base), and clients use few distinct paths:
    a path that passed is remembered (a refused one is not, so it raises every time).
    """
    if "\\" in raw:
        raise PathRefused("the path contains a backslash")
    if not raw.startswith("/"):
        raise PathRefused("the path must start with '/'")
    unprintable = _UNPRINTABLE.search(raw)
    if unprintable is not None:
        raise PathRefused(f"the path contains the character {unprintable.group()!r}")
    if _BAD_ESCAPE.search(raw):
        raise PathRefused("the path contains a malformed percent escape")
    for segment in raw[1:].split("/"):
        _check_segment(segment)
    return raw


def _check_segment(segment: str) -> None:
    for match in _ESCAPE.finditer(segment):
        byte = int(match.group(1), 16)
        if byte in _SEPARATORS:
            raise PathRefused("the path contains an encoded slash or backslash")
        if byte < 0x20 or byte == 0x7F:
            raise PathRefused(f"the path contains an encoded control character (%{byte:02X})")
    # A dot segment with parameters (``..;x``, ``..%3b``) is one too: servers that
    # strip path parameters (Tomcat, Jetty, Spring) resolve it as ``..``.
    decoded = _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), segment)
    if decoded.split(";", 1)[0] in (".", ".."):
        raise PathRefused(f"the path contains a dot segment ({segment!r})")
