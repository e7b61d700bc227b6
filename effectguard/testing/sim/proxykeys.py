"""The proxy keys the simulated clients hold (``--operator``): one per budget root.

A client sends the key its root's clients were last given, whatever has happened to
it since: a revoked key goes on being sent (and must be refused) until the operator
makes a new one, which the clients take up at once (so some of their first requests
may meet a replica that has not read it yet, within the documented delay).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from effectguard.testing.sim.schedule import key_root

__all__ = ["ClientKeys"]


@dataclass
class ClientKeys:
    """Each budget root's current key: its name and its secret (shared by client tasks
    and the operator's thread, hence the lock)."""

    current: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: Keys the operator has tried to revoke (whether or not the command succeeded).
    revoking: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def give(self, name: str, secret: str) -> None:
        """The operator made key ``name`` (``ROOT.N``): its root's clients use it now."""
        with self._lock:
            self.current[key_root(name)] = (name, secret)

    def to_revoke(self, root: str) -> str | None:
        """The key ``root``'s clients send, to revoke now; None when the operator already
        tried (a ``key new`` that failed, on a ledger that was down, left it in use: a
        second revocation that the first committed unseen would exit 3)."""
        with self._lock:
            name = self.current.get(root, ("", ""))[0]
            if not name or name in self.revoking:
                return None
            self.revoking.add(name)
            return name

    def of(self, budget: str) -> tuple[str, str] | None:
        """The key a client spending from ``budget`` sends: its root's (None: no keys)."""
        with self._lock:
            return self.current.get(budget.split("/")[0])
