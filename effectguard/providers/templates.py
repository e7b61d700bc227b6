"""The text templates of a declaration (``key_format``, a lookup's ``url``, ``query`` and
``form``), checked as templates: which ``{fields}`` they really use, and where a lookup URL
may point.

Checked by parsing the template, never by looking for the text ``{op}`` in it: ``{{op}}``
contains that text and is the literal ``{op}`` once formatted, so a lookup declared so
asked the provider about the same string for every call, found nothing, and "not found"
decided every unknown call "not applied" (and had it sent again). Pure; no I/O.
"""

from __future__ import annotations

from string import Formatter
from urllib.parse import quote, unquote, urlsplit

__all__ = [
    "MAX_LOOKUP_TIMEOUT_S",
    "MAX_WINDOW_S",
    "fields_error",
    "lookup_url_error",
    "url_segment",
    "uses_field",
]

#: The longest idempotency window a declaration may claim: a year and a day. No provider
#: we know of documents a longer one (Stripe v1: 24 h; its API v2: 30 days), and 24 h
#: written in milliseconds (86,400,000) is 1000 days: past the provider's real window it
#: has forgotten the key, and effectguard's resend under it would be a second effect.
MAX_WINDOW_S = 366 * 86400
#: The longest a lookup may take: it is asked inside a client's keyed resend, and by the
#: sweeper one call at a time, so a lookup that never times out holds both for ever.
MAX_LOOKUP_TIMEOUT_S = 600.0


def fields_error(text: str, allowed: tuple[str, ...], required: str | None) -> str | None:
    """Why ``text`` is not a template using only ``allowed`` fields (and ``required`` at
    least once), each plain (``{op}``: no ``!r``, no ``:>40``); None if it is."""
    try:
        parsed = list(Formatter().parse(text))
    except ValueError as exc:  # a lone "{" or "}"
        return f"not a template ({exc}); write a literal brace as {{{{ or }}}}"
    names = ", ".join("{" + name + "}" for name in allowed)
    used: set[str] = set()
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if name not in allowed or spec or conversion:
            shown = "{" + name + ("!" + conversion if conversion else "")
            shown += (":" + spec if spec else "") + "}"
            return f"only {names} may be used, each as written here (not {shown})"
        used.add(name)
    if required is not None and required not in used:
        return f"must contain {{{required}}} (a doubled brace, {{{{{required}}}}}, is literal text)"
    return None


def uses_field(text: str, name: str) -> bool:
    """Whether the template ``text`` (checked by :func:`fields_error`) uses ``{name}``."""
    return any(field == name for _, field, _, _ in Formatter().parse(text))


def lookup_url_error(url: str, op_field: str) -> str | None:
    """Why a lookup ``url`` template may not be asked; None if it may.

    It starts with ``{base_url}`` (then ``/``, ``?`` or nothing), or is an absolute
    http(s) URL of its own; it uses only ``{base_url}`` and ``{op_field}``; and its path
    has no dot segment (``..``, ``%2e%2e``). A lookup carries the provider's credential:
    ``{base_url}.evil.example``, ``{base_url}@host`` or ``{base_url}:8443`` would send it
    to another host, and ``{base_url}/../x`` outside the base path (``--upstream`` may
    point a provider at ``http://host/tenant1``; contract §12)."""
    why = fields_error(url, ("base_url", op_field), None)
    if why is not None:
        return why
    if url.startswith("{base_url}"):
        rest = url.removeprefix("{base_url}")
        if rest[:1] not in ("", "/", "?"):
            return "{base_url} must be followed by '/', '?' or nothing: it is the whole origin"
        if "{base_url}" in rest:
            return "{base_url} may only begin the URL"
    elif not url.startswith(("http://", "https://")) or "{base_url}" in url:
        return "must be a URL template starting with {base_url} or http(s)"
    # The path as it would be sent, with placeholders standing in for the values.
    sent = url.replace("{base_url}", "http://base").replace("{" + op_field + "}", "op")
    path = urlsplit(sent.replace("{{", "{").replace("}}", "}")).path
    if any(unquote(unquote(s)) in (".", "..") for s in path.split("/")):
        return "its path may have no '.' or '..' segment: it must stay under the base URL"
    return None


def url_segment(value: str) -> str:
    """``value`` percent-encoded to stay one segment where a lookup URL places it.

    Every character but the unreserved ones is encoded ('/', '?', '#', '&', '%' too): a
    call an older release sent under the client's own key is looked up by that key, and
    ``../x`` or ``a/b?c`` placed raw left the base path or added a query. A value of dots
    alone is a dot segment even so: its dots are encoded too, so no client resolves it.
    """
    if value.strip(".") == "":
        return "%2E" * len(value)
    return quote(value, safe="")
