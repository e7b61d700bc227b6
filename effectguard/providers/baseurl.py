"""What a provider's base URL may be: the declaration's ``base_url`` and every
``--upstream NAME=URL`` (or ``upstreams=``) override pass through :func:`checked_base_url`.

A URL holding a user name or password is refused, and the refusal never quotes it: the
ledger records the base URL an attempt went to (``attempt.started``'s ``sent_to``, shown
by ``effectguard show``), and aiohttp sends a URL's credential as Basic auth, which it
refuses beside a provider key's ``Authorization`` (every call an internal error, held as
unknown). A credential goes in the provider key (``api_key_env``, ``key_header``,
``key_format``).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from effectguard.errors import ConfigError


def checked_base_url(url: object, where: str) -> str:
    """``url`` without its trailing ``/``, or a :class:`ConfigError` naming ``where``."""
    if not isinstance(url, str):
        raise ConfigError(f"{where}: must be a string")
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # e.g. an unclosed IPv6 bracket; the URL may hold a password
        raise ConfigError(f"{where}: must be an http(s) URL ({exc})") from None
    if "@" in parts.netloc:
        raise ConfigError(
            f"{where}: must not hold a user name or password (a credential goes in the "
            "provider's key: api_key_env, key_header, key_format)"
        )
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"{where}: must be an http(s) URL, got {url!r}")
    if parts.query or parts.fragment:
        raise ConfigError(f"{where}: must not have a query or fragment")
    return url.rstrip("/")
