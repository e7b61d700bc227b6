"""One request to the operator page and the ways to answer it (plain ASGI).

:class:`Exchange` reads what the page needs from a request (method, headers, the
session cookie, a small urlencoded form) and sends HTML pages, redirects and
cookies, always with the page's security headers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qs

from effectguard.ingress.admin.markup import PREFIX, SECURITY_HEADERS

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

COOKIE = "effectguard_admin"
#: The largest form the page accepts (a note, a cost, a key, the CSRF token).
MAX_FORM_BYTES = 64 * 1024


class FormTooLarge(Exception):
    """The form body is over :data:`MAX_FORM_BYTES`."""


class FormNotUtf8(Exception):
    """The form's bytes, raw or %-escaped, are no UTF-8 (a browser always sends UTF-8)."""


class Exchange:
    """A request to the page and its response."""

    def __init__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.scope = scope
        self._receive = receive
        self._send = send
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.headers: dict[str, str] = {}
        for raw_name, raw_value in scope["headers"]:
            name = raw_name.decode("latin-1").lower()
            if name not in self.headers:  # the first wins; a repeated Host is not a second say
                self.headers[name] = raw_value.decode("latin-1")
        self.query = parse_qs(scope.get("query_string", b"").decode("latin-1"))

    def header(self, name: str) -> str | None:
        """A request header (first occurrence), by lower-case name."""
        return self.headers.get(name)

    def cookie(self, name: str = COOKIE) -> str | None:
        """A cookie's value from the ``Cookie`` header."""
        for part in (self.header("cookie") or "").split(";"):
            key, eq, value = part.strip().partition("=")
            if eq and key == name:
                return value
        return None

    def param(self, name: str) -> str | None:
        """A query-string parameter (the first)."""
        values = self.query.get(name)
        return values[0] if values else None

    async def form(self) -> dict[str, str]:
        """The urlencoded body's fields (the first value of each)."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                return {}
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > MAX_FORM_BYTES:
                raise FormTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        # Strict, raw and %-escaped alike: a note would otherwise be recorded holding
        # replacement characters, where `reconcile --note` refuses such bytes.
        try:
            text = b"".join(chunks).decode("utf-8")
            fields = parse_qs(text, keep_blank_values=True, errors="strict")
        except UnicodeDecodeError:
            raise FormNotUtf8 from None
        return {k: v[0] for k, v in fields.items()}

    async def html(
        self, status: int, body: str, extra: tuple[tuple[bytes, bytes], ...] = ()
    ) -> None:
        """Send a page."""
        data = body.encode()
        headers = [
            (b"content-type", b"text/html; charset=utf-8"),
            (b"content-length", str(len(data)).encode()),
            *SECURITY_HEADERS,
            *extra,
        ]
        await self._send({"type": "http.response.start", "status": status, "headers": headers})
        await self._send({"type": "http.response.body", "body": data, "more_body": False})

    async def redirect(self, location: str, extra: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        """303 See Other to a path of the page (after a POST, so a reload does not repeat it)."""
        headers = ((b"location", location.encode()), *extra)
        await self.html(303, "", headers)

    def set_cookie(self, value: str, max_age: int) -> tuple[bytes, bytes]:
        """The header that stores the session token (``max_age`` 0 deletes it)."""
        secure = "; Secure" if self.scope.get("scheme") == "https" else ""
        cookie = (
            f"{COOKIE}={value}; Path={PREFIX}; Max-Age={max_age}; HttpOnly; SameSite=Strict{secure}"
        )
        return (b"set-cookie", cookie.encode())
