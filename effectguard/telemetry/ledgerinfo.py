"""``effectguard_ledger_info``: which ledger a replica serves, for a Prometheus that scrapes
several (docs/metrics.md, "One scrape job per deployment").

The ledger gauges of two ledgers scraped under one job are merged by the dashboard's
``max by (job)``; this series lets a query find such a job. It names the ledger by its
store and a hash of where it is (a SQLite file's absolute path; a PostgreSQL ledger's
host, port, database and schema), never by its URL: a DSN may hold a password, and
users and passwords are left out so replicas that log in differently still agree. Pure.
"""

from __future__ import annotations

import hashlib
import os
from urllib.parse import parse_qsl, urlsplit

from prometheus_client.core import InfoMetricFamily

#: Hex digits of the hash shown: enough that two ledgers of one Prometheus never share it.
SHOWN = 12


def identity(url: str) -> tuple[str, str]:
    """``(store, ledger)`` for the ledger at ``url``: ``sqlite``, ``postgresql`` or
    ``memory``, and a short hash of where it lives."""
    if url.startswith(("postgresql://", "postgres://")):
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
        try:
            port = str(parts.port or query.get("port", 5432))
        except ValueError:  # not a number: the ledger could not have opened
            port = ""
        place = [
            (parts.hostname or query.get("host", "")).lower(),
            port,
            parts.path.lstrip("/") or query.get("dbname", ""),
            query.get("schema", "public"),
        ]
        store = "postgresql"
    elif url.startswith("memory://"):
        store, place = "memory", [url, str(os.getpid())]  # one process's own
    else:
        path = url.removeprefix("sqlite:///") if url.startswith("sqlite:///") else url
        store, place = "sqlite", [os.path.realpath(path)]
    digest = hashlib.sha256("\0".join([store, *place]).encode()).hexdigest()
    return store, digest[:SHOWN]


def ledger_info(url: str) -> InfoMetricFamily:
    """The ``effectguard_ledger_info`` series of the ledger at ``url`` (value 1)."""
    store, ledger = identity(url)
    info = InfoMetricFamily(
        "effectguard_ledger",
        "The ledger this process serves: its store and a hash of where it is (1).",
    )
    info.add_metric([], {"store": store, "ledger": ledger})
    return info
