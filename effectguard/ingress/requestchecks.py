"""Checks of a request's line and headers at the proxy, before it reaches the guard:
the route below a provider's base path, header bytes the upstream leg could not forward
as sent, and framing that could smuggle a second request."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from effectguard.errors import Refusal
from effectguard.rules import paths

Scope = MutableMapping[str, Any]


def check_utf8(headers: list[tuple[bytes, bytes]]) -> None:
    """Refuse (400) a header value that is not UTF-8: aiohttp writes header text as
    UTF-8, so such a value could only reach the provider altered (contract §12)."""
    for name, value in headers:
        if value.isascii():
            continue
        try:
            value.decode("utf-8")
        except UnicodeDecodeError:
            raise Refusal(
                400,
                "invalid_request",
                f"header {name.decode('latin-1')!r} is not UTF-8; effectguard forwards "
                "header values byte for byte and cannot forward this one",
            ) from None


def route_of(scope: Scope, fixed: str | None = None) -> tuple[str, str]:
    """``/{provider}/{rest}`` as the provider name and the path below its base (contract.md §12);
    on a provider's own listener (``fixed``), that provider and the whole path.

    The still-encoded path is checked, so ``%2e%2e`` or ``%2f`` cannot hide a way out
    of the base path behind the decoding the server already did.
    """
    raw: bytes = scope.get("raw_path") or scope["path"].encode()
    text = raw.decode("latin-1")
    _, _, rest = text.partition("/")
    if fixed is not None:
        name, below = fixed, rest
    else:
        name, _, below = rest.partition("/")
    try:
        return name, paths.check_path("/" + below)
    except paths.PathRefused as exc:
        raise Refusal(400, "invalid_request", f"refused path: {exc}") from exc


def ambiguous_framing(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a request carries both Transfer-Encoding and Content-Length (smuggling)."""
    names = {k.lower() for k, _ in headers}
    return b"transfer-encoding" in names and b"content-length" in names
