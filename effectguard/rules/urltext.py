"""A ledger URL as effectguard prints it: without its secrets.

Every message, start line and printed command that names a ledger by URL (whatever its
scheme: a PostgreSQL DSN, or one effectguard refuses, such as SQLAlchemy's
``postgresql+psycopg://`` or another database's) goes through :func:`redacted`. No
driver is imported here: a SQLite-only machine refuses a foreign URL with it too.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

#: The query parameters of a ledger URL that libpq reads as secrets: the password, and
#: the passphrase of the client's TLS key.
SECRET_PARAMS = frozenset({"password", "sslpassword"})


def redacted(url: str) -> str:
    """``url`` with its password (in the user part, or a :data:`SECRET_PARAMS` in the
    query) as ``***``; a URL that cannot be split is shown by its scheme alone."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # an unclosed IPv6 bracket, a port that is no number
        return url.partition("://")[0] + "://***"
    query = [(k, "***" if k in SECRET_PARAMS else v) for k, v in parse_qsl(parts.query)]
    netloc = parts.netloc
    if password is not None:
        netloc = netloc.replace(f":{password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc, query=urlencode(query, safe="*")))
