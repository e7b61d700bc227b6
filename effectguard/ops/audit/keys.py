"""Proxy keys, re-derived by the verifier's own fold of ``key.created`` / ``key.revoked``.

Rules: a key is created with a name, a lowercase hex SHA-256 and a budget root; a name
is created again only once its earlier key is revoked or expired; only a live key is
revoked. The stored row of each name must equal this fold: the creating event's fields,
its time as ``created_at``, the revoking event's time as ``revoked_at``.
"""

from __future__ import annotations

import re
from typing import Any, Final, NamedTuple

KINDS: Final = frozenset({"key.created", "key.revoked"})
_DIGEST: Final = re.compile(r"[0-9a-f]{64}")


class KeyRow(NamedTuple):
    """A stored proxy key row (lists as tuples; None: unrestricted / never)."""

    name: str
    sha256: str
    budget_root: str
    created_at: float
    expires_at: float | None
    models: tuple[str, ...] | None
    providers: tuple[str, ...] | None
    revoked_at: float | None


def _names(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"not a list of names: {value!r}")
    return tuple(value)


class Keys:
    """Every proxy key, folded from the events."""

    def __init__(self) -> None:
        self.rows: dict[str, KeyRow] = {}

    def feed(self, seq: int, kind: str, data: dict[str, Any], at: float) -> list[str]:
        """Apply one key event; returns what is wrong with it."""
        name = str(data["name"])
        row = self.rows.get(name)
        if kind == "key.revoked":
            if row is None or row.revoked_at is not None:
                return [f"event {seq}: revokes key {name!r}, which is not live"]
            self.rows[name] = row._replace(revoked_at=at)
            return []
        problems = []
        if (
            row is not None
            and row.revoked_at is None
            and (row.expires_at is None or row.expires_at > at)
        ):
            problems.append(f"event {seq}: creates key {name!r} while its earlier key is live")
        digest = str(data["sha256"])
        if not _DIGEST.fullmatch(digest):
            problems.append(f"event {seq}: key {name!r} is not stored as a SHA-256 digest")
        expires = data.get("expires_at")
        self.rows[name] = KeyRow(
            name,
            digest,
            str(data["budget_root"]),
            at,
            None if expires is None else float(expires),
            _names(data.get("models")),
            _names(data.get("providers")),
            None,
        )
        return problems
