"""The PostgreSQL driver, psycopg: an optional dependency (the ``postgres`` extra).

Every module that talks to PostgreSQL imports it from here, so a ledger URL naming
PostgreSQL on an install without it is refused with what to install (``ConfigError``:
exit 2 from a command, a failed start from ``serve``), never a traceback.
"""

from __future__ import annotations

from effectguard.errors import ConfigError

try:
    import psycopg
    from psycopg import sql
    from psycopg.pq import TransactionStatus
except ModuleNotFoundError as exc:  # only psycopg's own absence: not a fault inside it
    if exc.name is None or not exc.name.startswith("psycopg"):
        raise
    raise ConfigError(
        "a PostgreSQL ledger needs the psycopg driver, which this install lacks: install "
        "effectguard's postgres extra (pip install 'effectguard[postgres]', or "
        "'.[postgres]' in a checkout)"
    ) from None

__all__ = ["TransactionStatus", "psycopg", "sql"]
