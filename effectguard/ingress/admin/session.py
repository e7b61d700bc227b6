"""Login sessions and CSRF tokens for the operator page: signed tokens, and a logout list.

A session is a signed token (``payload.signature``) naming the admin key's name and
an expiry; the browser holds it in an HttpOnly, SameSite=Strict cookie. A token whose
expiry lies further ahead than a login made now would last is refused: lowering
``session_hours`` shortens the logins already made. The signing
secret is derived from the configured admin keys (their names and digests) and the
optional ``EFFECTGUARD_ADMIN_SECRET``, so every replica with the same configuration
accepts the same cookie and no replica keeps a session of its own. Changing the admin
keys or the secret changes the signing secret, which ends every session at once.

Logging out ends one session everywhere: the page records the token's SHA-256
(:func:`token_sha256`; never the token) as ended in the ledger every replica shares
(``effectguard.ledger.endedsessions``), and refuses a token so recorded after its
signature checks, so a copy of the cookie taken before the logout no longer logs in.
This module only signs and checks; the page (``routes``) does the ledger's part.

The CSRF token of a session is a second HMAC over the session token: a form carries
it in a hidden field, and only a page rendered for that session can know it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from effectguard.config.settings import AdminKey, AdminSettings

_VERSION = b"effectguard-admin-session-v1"
#: How far apart the clocks of two replicas may be for a session one made to pass the other.
CLOCK_SLACK_S = 60.0


@dataclass(frozen=True, slots=True)
class Session:
    """A logged-in operator: the admin key's name and the token that proves it."""

    name: str
    token: str = field(repr=False)  # a bearer secret: never in a repr
    expires: float


def signing_secret(admin: AdminSettings) -> bytes:
    """The secret that signs sessions: the same wherever the configuration is the same."""
    material = [_VERSION, admin.secret.encode()]
    material += sorted(f"{k.name}\0{k.sha256}".encode() for k in admin.keys)
    return hashlib.sha256(b"\0\0".join(material)).digest()


class Sessions:
    """Issue and check session tokens and their CSRF tokens."""

    def __init__(self, admin: AdminSettings) -> None:
        self._secret = signing_secret(admin)
        self._names = {k.name for k in admin.keys}
        self.lifetime_s = admin.session_s

    def issue(self, key: AdminKey, now: float) -> Session:
        """A new session for ``key``, valid for the configured lifetime from ``now``."""
        expires = int(now + self.lifetime_s)
        # The nonce makes two logins in one second two different sessions.
        payload = f"{key.name}\n{expires}\n{secrets.token_hex(8)}".encode()
        body = base64.urlsafe_b64encode(payload).decode().rstrip("=")
        return Session(key.name, f"{body}.{self._sign(b'session', body)}", float(expires))

    def check(self, token: str, now: float) -> Session | None:
        """The session ``token`` proves, or None (forged, expired, or its key is gone)."""
        body, dot, signature = token.partition(".")
        if not dot or not _same(signature, self._sign(b"session", body)):
            return None
        try:
            payload = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)).decode()
            name, expires_text, _nonce = payload.split("\n")
            expires = float(int(expires_text))
        except (ValueError, UnicodeDecodeError):
            return None
        # A token that outlives a login made now was made under a longer session_hours:
        # the setting is how long a login lasts, so lowering it shortens those too (the
        # slack is for replicas' clocks, a token being checked by one it was not made by).
        outlives = expires > now + self.lifetime_s + CLOCK_SLACK_S
        if expires <= now or outlives or name not in self._names:
            return None
        return Session(name, token, expires)

    def csrf_token(self, session: Session) -> str:
        """The token a form of ``session`` must carry for a POST to be accepted."""
        return self._sign(b"csrf", session.token)

    def csrf_ok(self, session: Session, presented: str) -> bool:
        """Whether ``presented`` is ``session``'s CSRF token (compared in constant time)."""
        return _same(presented, self.csrf_token(session))

    def _sign(self, purpose: bytes, text: str) -> str:
        return hmac.new(self._secret, purpose + b"\0" + text.encode(), hashlib.sha256).hexdigest()


def same_origin(origin: str | None, referer: str | None, host: str | None) -> bool:
    """Whether a state-changing request comes from a page of this server.

    The browser's ``Origin`` (else ``Referer``) must name the host the request was sent
    to (the ``Host`` header, which a foreign page cannot set). A request carrying
    neither is refused: every browser this page supports sends ``Origin`` on a POST.
    The scheme is not compared, so a TLS-terminating reverse proxy that keeps the
    ``Host`` header works; the CSRF token is the check that does not depend on it.
    """
    source = origin if origin and origin != "null" else referer
    if not source or not host:
        return False
    try:
        netloc = urlsplit(source).netloc
    except ValueError:
        return False
    return bool(netloc) and _same(netloc.lower(), host.lower())


def token_sha256(token: str) -> str:
    """The SHA-256 of a session token (hex): how the ledger names an ended session, so
    reading the ledger gives no login."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def _same(presented: str, expected: str) -> bool:
    """A constant-time comparison of text a client sent: compare_digest refuses str with
    non-ASCII characters (TypeError, a 500), so both are compared as UTF-8 bytes."""
    return hmac.compare_digest(
        presented.encode("utf-8", "surrogatepass"), expected.encode("utf-8", "surrogatepass")
    )
