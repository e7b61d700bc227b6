"""HTML for the operator page: one layout, inline CSS, and escaping in one place.

Everything that comes from the ledger or a request passes through :func:`esc` (or
:func:`attr`) before it reaches a page; the templates are ``string.Template`` with
``$``-placeholders whose values are already markup. No script, no font and no image
is loaded from anywhere: the pages work offline and under a strict CSP.
"""

from __future__ import annotations

import datetime as dt
import html
from collections.abc import Iterable, Sequence
from string import Template

from effectguard.config import defaults
from effectguard.rules import notes
from effectguard.rules.money import nanos_to_usd

PREFIX = defaults.ADMIN_PREFIX

#: Sent with every page: nothing may be loaded from elsewhere, and no other site may
#: frame the page (clickjacking a reconcile button).
SECURITY_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (
        b"content-security-policy",
        b"default-src 'none'; style-src 'unsafe-inline'; img-src data:; "
        b"form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    ),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
    (b"cache-control", b"no-store"),
)

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#1d2330;
background:#f6f7f9}
header{background:#1d2330;color:#fff;padding:10px 24px;display:flex;gap:24px;align-items:center}
header b{font-size:16px;margin-right:12px}
header a{color:#cfd8ea;text-decoration:none}header a:hover{color:#fff}
header form{margin-left:auto}header button{background:none;border:1px solid #56607a;color:#cfd8ea}
main{padding:18px 24px;max-width:1200px}
h1{font-size:20px;margin:4px 0 14px}h2{font-size:16px;margin:22px 0 8px}
table{border-collapse:collapse;background:#fff;width:100%;margin-bottom:8px}
th,td{text-align:left;padding:6px 10px;border-bottom:1px solid #e3e6ec;vertical-align:top}
th{background:#eef0f4;font-weight:600;font-size:12px;text-transform:uppercase;color:#4a5368}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums}
code,pre{font:12px/1.4 ui-monospace,Menlo,Consolas,monospace}
pre{background:#fff;border:1px solid #e3e6ec;padding:10px;overflow:auto;max-height:420px}
.stage{padding:1px 7px;border-radius:9px;font-size:12px;background:#e3e6ec}
.stage.effect_unknown{background:#ffe1b3}.stage.completed{background:#d4f1dc}
.stage.reconciled_applied,.stage.reconciled_not_applied{background:#d9e6ff}
.stage.failed,.stage.refused{background:#f8d4d4}
.flash{padding:10px 14px;border-radius:4px;margin:0 0 14px}
.flash.ok{background:#d4f1dc}.flash.error{background:#f8d4d4}
.muted{color:#6b7385}.empty{padding:18px;background:#fff;border:1px dashed #c9ced8}
.bar{background:#e3e6ec;width:160px;height:10px;display:inline-block;border-radius:5px}
.bar i{display:block;height:10px;border-radius:5px;background:#3a6fd8}
.bar i.over{background:#d8453a}
form.decide{background:#fff;border:1px solid #e3e6ec;padding:12px 14px;margin:10px 0;
max-width:640px}
form.decide label{display:block;margin:6px 0}
textarea,input[type=text],input[type=password]{width:100%;box-sizing:border-box;padding:6px;
font:inherit}
button{font:inherit;padding:5px 14px;cursor:pointer;border-radius:4px;border:1px solid #8a93a6;
background:#fff}
button.primary{background:#1d2330;color:#fff;border-color:#1d2330}
.login{max-width:380px;margin:80px auto;background:#fff;padding:22px;border:1px solid #e3e6ec}
svg text{font:11px system-ui,sans-serif;fill:#4a5368}
"""

_PAGE = Template(
    """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>$title · effectguard</title><style>$css</style></head>
<body>$header<main>$flash$body</main></body></html>
"""
)

_HEADER = Template(
    """<header><b>effectguard</b>
<a href="${prefix}">Unknown calls</a><a href="${prefix}budgets">Budgets</a>
<a href="${prefix}spend">Spend</a>
<form method="post" action="${prefix}logout">$csrf
<span class="muted">$who</span> <button type="submit">Log out</button></form></header>
"""
)


def esc(value: object) -> str:
    """Text for an element's content or a quoted attribute (``None`` shows as ``-``).

    A direction override or isolate, a control character (line breaks and tabs kept) or a
    line separator is shown as its escape (``\\u202e``), as ``effectguard show`` prints it:
    clients and upstreams choose much of what the page shows, and an override would make
    the evidence an operator decides on read other than it is."""
    if value is None:
        return "-"
    return html.escape(notes.terminal_safe(str(value)), quote=True)


def attr(value: object) -> str:
    """A value for a double-quoted attribute."""
    return html.escape(str(value), quote=True)


def usd(nanos: int | None) -> str:
    """Money as USD for a page, exact but without trailing zeros: ``$1.50``, ``$0.000123``."""
    if nanos is None:
        return "-"
    whole, _, fraction = nanos_to_usd(nanos).partition(".")
    fraction = fraction.rstrip("0").ljust(2, "0")
    return f"${whole}.{fraction}"


def when(at: float) -> str:
    """A ledger time as ISO 8601 UTC to the second."""
    moment = dt.datetime.fromtimestamp(at, dt.UTC).replace(microsecond=0)
    return moment.isoformat().replace("+00:00", "Z")


def age(seconds: float) -> str:
    """A duration the way a person says it: ``42 s``, ``7 min``, ``3 h 5 min``, ``2 d 4 h``;
    a negative one (a time ahead of this host's clock: written by a replica whose clock
    is ahead, or before this one's was stepped back) as ``2 min ahead``, not ``0 s``."""
    if int(seconds) < 0:
        return f"{_span(-int(seconds))} ahead"
    return _span(int(seconds))


def ago(seconds: float) -> str:
    """How long ago something was, ``seconds`` before now: ``7 min ago``, or ``2 min
    ahead of this host's clock``."""
    if int(seconds) < 0:
        return f"{_span(-int(seconds))} ahead of this host's clock"
    return f"{_span(int(seconds))} ago"


def _span(s: int) -> str:
    """A non-negative number of seconds as :func:`age` says it."""
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min"
    if s < 86400:
        return f"{s // 3600} h {s % 3600 // 60} min"
    return f"{s // 86400} d {s % 86400 // 3600} h"


def csrf_field(token: str) -> str:
    """The hidden field every form of a session carries."""
    return f'<input type="hidden" name="csrf" value="{attr(token)}">'


def table(
    headings: Sequence[str], rows: Iterable[Sequence[str]], numeric: Sequence[int] = ()
) -> str:
    """A table from already-escaped cells; columns in ``numeric`` align right."""

    def cls(i: int) -> str:
        return ' class="num"' if i in numeric else ""

    head = "".join(f"<th{cls(i)}>{esc(h)}</th>" for i, h in enumerate(headings))
    body = "".join(
        "<tr>" + "".join(f"<td{cls(i)}>{c}</td>" for i, c in enumerate(row)) + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def flash(message: str | None, kind: str = "ok") -> str:
    """A notice at the top of a page (``kind``: ``ok`` or ``error``)."""
    return f'<div class="flash {kind}" role="status">{esc(message)}</div>' if message else ""


def page(title: str, body: str, *, who: str | None, csrf: str = "", notice: str = "") -> str:
    """A whole page; ``who`` (the admin key's name) is None on the login page."""
    header = ""
    if who is not None:
        header = _HEADER.substitute(prefix=PREFIX, csrf=csrf_field(csrf), who=esc(who))
    return _PAGE.substitute(title=esc(title), css=_CSS, header=header, flash=notice, body=body)


def login_page(message: str | None, next_path: str) -> str:
    """The login form: the admin key, POSTed (never in a URL)."""
    body = f"""<div class="login"><h1>Operator login</h1>
{flash(message, "error")}
<form method="post" action="{PREFIX}login">
<input type="hidden" name="next" value="{attr(next_path)}">
<label>Admin key <input type="password" name="key" id="key" autocomplete="off" autofocus>
</label><p><button class="primary" type="submit" id="login">Log in</button></p></form>
<p class="muted">The operator page needs an admin key from the <code>[admin]</code>
section of the proxy's configuration.</p></div>"""
    return page("Log in", body, who=None)
