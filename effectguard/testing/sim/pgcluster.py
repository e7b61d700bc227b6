"""A PostgreSQL cluster the simulator owns, so that it may stop it: a ledger outage.

Debian's ``pg_createcluster`` makes a throwaway cluster on a free port with trust
authentication; ``pg_ctlcluster`` stops it (``fast``: sessions ended cleanly;
``immediate``: like a crash) and starts it again; ``pg_dropcluster --stop``
removes it at the end. Needs root and the ``postgresql-common`` tools; the
shared server at ``$EFFECTGUARD_TEST_PG_DSN`` is never stopped.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from effectguard.testing import free_port

__all__ = ["OwnedPostgres", "owned_postgres", "unavailable_reason"]

_TOOLS = ("pg_createcluster", "pg_ctlcluster", "pg_dropcluster")


def unavailable_reason() -> str | None:
    """Why this machine cannot give the simulator a cluster of its own (None: it can)."""
    if os.geteuid() != 0:
        return "an owned PostgreSQL cluster needs root (pg_createcluster)"
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        return f"an owned PostgreSQL cluster needs {', '.join(missing)} (postgresql-common)"
    if _version() is None:
        return "no PostgreSQL server under /usr/lib/postgresql"
    return None


def _version() -> str | None:
    """The newest installed server version (the directory name under /usr/lib/postgresql)."""
    root = Path("/usr/lib/postgresql")
    versions = [p.name for p in root.glob("*") if (p / "bin" / "postgres").exists()]
    return max(versions, key=lambda v: [int(x) for x in v.split(".") if x.isdigit()], default=None)


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr[-500:]}")


@dataclass(frozen=True, slots=True)
class OwnedPostgres:
    """One throwaway cluster: ``version``/``name`` for the Debian tools, and its port."""

    version: str
    name: str
    port: int

    @property
    def dsn(self) -> str:
        """The DSN of its ``postgres`` database (trust authentication, loopback)."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def stop(self, mode: str) -> None:
        """Stop the server (``fast`` or ``immediate``); every session ends."""
        _run("pg_ctlcluster", self.version, self.name, "stop", "-m", mode)

    def start(self) -> None:
        """Start the server again (returns once it accepts connections)."""
        _run("pg_ctlcluster", self.version, self.name, "start")


@contextlib.contextmanager
def owned_postgres(seed: int) -> Iterator[OwnedPostgres]:
    """Create and start cluster ``sim<seed>_<pid>`` on a free port; drop it on the way out."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    version = _version()
    assert version is not None  # unavailable_reason checked it
    owned = OwnedPostgres(version, f"sim{seed}_{os.getpid()}", free_port())
    _run("pg_createcluster", version, owned.name, "-p", str(owned.port), "--", "--auth=trust")
    try:
        owned.start()
        yield owned
    finally:
        subprocess.run(
            ["pg_dropcluster", "--stop", version, owned.name], capture_output=True, check=False
        )
