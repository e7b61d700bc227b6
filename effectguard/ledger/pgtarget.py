"""Where a PostgreSQL ledger lives, and a connection to it with the ledger's settings.

``Target`` parses the DSN (our own ``?schema=NAME`` parameter included) and opens
connections that declare the writer format, the ledger's schema as ``search_path`` and
the timeouts (``statement_timeout`` off, whatever the role's or database's default); a
server that cannot be reached, or that closes the connection while it is being set up,
is :class:`~effectguard.errors.LedgerUnavailable`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from effectguard.errors import ConfigError, LedgerUnavailable
from effectguard.ledger import writerformat
from effectguard.ledger.pgdriver import psycopg, sql
from effectguard.rules.urltext import SECRET_PARAMS, redacted

__all__ = ["CONNECT_TIMEOUT_S", "IDLE_IN_TRANSACTION_MS", "LOCK_TIMEOUT_MS", "Target"]

#: A writer connection idle inside a transaction this long is ended by the server, so
#: a stopped (SIGSTOP) or wedged replica holds the batch lock (and stalls every other
#: replica's writes, heartbeats included) for at most this long. Keep leases well above it.
IDLE_IN_TRANSACTION_MS = 5000
#: How long a statement waits for a lock (the batch lock, or a table another session
#: locked) before it fails: as long as SQLite waits for its write lock. Without it, one
#: forgotten ``LOCK TABLE`` or ``VACUUM FULL`` stalls every replica with no answer.
LOCK_TIMEOUT_MS = 5000
CONNECT_TIMEOUT_S = 10

_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")


@dataclass(frozen=True, slots=True)
class Target:
    """Where a PostgreSQL ledger lives: a libpq connection string and a schema."""

    conninfo: str
    schema: str | None

    @classmethod
    def parse(cls, url: str) -> Target:
        """Split ``?schema=NAME`` (ours) from the libpq URL."""
        if not url.startswith(("postgresql://", "postgres://")):
            raise ConfigError(f"not a PostgreSQL ledger: {redacted(url)!r}")
        try:
            parts = urlsplit(url)
        except ValueError as exc:  # an unclosed IPv6 bracket; the URL may hold a password
            raise ConfigError(f"the PostgreSQL ledger URL is not a URL: {exc}") from exc
        query = parse_qsl(parts.query, keep_blank_values=True)
        schemas = [v for k, v in query if k == "schema"]
        rest = [(k, v) for k, v in query if k != "schema"]
        schema = schemas[-1] if schemas else None
        if schema is not None and not _SCHEMA_NAME.fullmatch(schema):
            raise ConfigError(f"ledger schema {schema!r}: use lowercase letters, digits and _")
        return cls(urlunsplit(parts._replace(query=urlencode(rest))), schema)

    def connect(
        self, opened: Callable[[psycopg.Connection[Any]], None] | None = None, **settings: str
    ) -> psycopg.Connection[Any]:
        """A synchronous autocommit connection with our search_path and ``settings``;
        ``opened`` is handed it before its first statement (the writer's deadline)."""
        try:
            conn = psycopg.connect(
                self.conninfo, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S
            )
        except psycopg.Error as exc:
            raise _unreachable(exc, self.conninfo) from exc
        try:
            if opened is not None:
                opened(conn)
            for name, value in self._settings(settings):
                conn.execute(sql.SQL("SELECT set_config({}, {}, false)").format(name, value))
        except psycopg.Error as exc:
            # A server stopping or restarting accepts the connection and then closes it
            # under its first statement: as unreachable as a refused connection.
            conn.close()
            raise _unreachable(exc, self.conninfo) from exc
        except BaseException:
            conn.close()
            raise
        return conn

    async def aconnect(self) -> psycopg.AsyncConnection[Any]:
        """An async autocommit connection with our search_path."""
        try:
            conn = await psycopg.AsyncConnection.connect(
                self.conninfo, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S
            )
        except psycopg.Error as exc:
            raise _unreachable(exc, self.conninfo) from exc
        try:
            for name, value in self._settings({"lock_timeout": str(LOCK_TIMEOUT_MS)}):
                await conn.execute(sql.SQL("SELECT set_config({}, {}, false)").format(name, value))
        except psycopg.Error as exc:  # closed under its first statement, as connect()'s
            await conn.close()
            raise _unreachable(exc, self.conninfo) from exc
        except BaseException:
            await conn.close()
            raise
        return conn

    def _settings(self, extra: dict[str, str]) -> Iterable[tuple[sql.Literal, sql.Literal]]:
        # Declared on every connection: the ledger refuses writes from older releases.
        # statement_timeout off: a role's or database's default (common on managed
        # servers) would cut short the waits we bound ourselves (lock_timeout, the
        # reader's and writer's deadlines, migrations that may take minutes).
        pairs = {
            writerformat.SETTING: str(writerformat.WRITER_FORMAT),
            "statement_timeout": "0",
            **extra,
        }
        if self.schema is not None:
            pairs["search_path"] = self.schema
        return [(sql.Literal(k), sql.Literal(v)) for k, v in pairs.items()]


def _unreachable(exc: psycopg.Error, conninfo: str) -> LedgerUnavailable:
    """The error of a failed connection, without the password: libpq quotes the piece of
    a connection string it cannot read (``unexpected spaces found in "..."``), and that
    piece may be the password. The message goes to stderr and to serve's log."""
    message = str(exc)
    parts = urlsplit(conninfo)
    hidden = [v for k, v in parse_qsl(parts.query) if k in SECRET_PARAMS]
    if parts.password:
        hidden += [parts.password, unquote(parts.password)]
    for secret in sorted(filter(None, hidden), key=len, reverse=True):
        message = message.replace(secret, "***")
    return LedgerUnavailable(f"cannot connect to the ledger database: {message}")
