"""What the fake tools share: the receipt log, the lagging search index, the delay knob."""

from __future__ import annotations

import asyncio
import hashlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from effectguard.testing.fakeprovider import ReceiptLog


@dataclass
class Index:
    """Objects by the operation id they carry, searchable only ``lag_s`` after creation:
    a search index that lags, as the vendors document theirs do."""

    lag_s: float
    rows: list[tuple[float, str, dict[str, Any]]] = field(default_factory=list)

    def add(self, op: str | None, obj: dict[str, Any], at: float) -> None:
        """Index ``obj`` as made at ``at``: its receipt's ``ts``, so a test that waits
        ``lag_s`` past the receipt finds it (the fsync in between can take a while)."""
        if op is not None:
            self.rows.append((at, op, obj))

    def find(self, op: str) -> list[dict[str, Any]]:
        now = time.time()
        return [obj for at, key, obj in self.rows if key == op and at + self.lag_s <= now]


class Tool:
    """The receipt log and index of one fake tool process."""

    def __init__(self, receipts: Path, lag_s: float) -> None:
        self.log = ReceiptLog(receipts)
        self.index = Index(lag_s)

    async def effect(self, path: str, op: str | None, body: bytes, obj_id: str) -> float:
        """Record one effect; returns, once its receipt is on disk, the receipt's ``ts``."""
        seq = self.log.next_seq()
        record = {
            "seq": seq,
            "ts": time.time(),
            "path": path,
            "op": op,
            "body_sha256": hashlib.sha256(body).hexdigest(),
            "id": obj_id,
        }
        await self.log.append(seq, record)
        return float(record["ts"])


async def delay(request: web.Request) -> None:
    """Honour ``x-fake-delay: SECONDS`` (a slow provider), before any work."""
    seconds = float(request.headers.get("x-fake-delay", "0") or 0)
    if seconds:
        await asyncio.sleep(seconds)


async def healthz(_: web.Request) -> web.Response:
    return web.json_response({"ok": True})


def serve(app: web.Application) -> None:
    """Run ``app`` on the port given as the second argument."""
    app.router.add_get("/healthz", healthz)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[2]), print=None)


def tool_from_argv() -> Tool:
    """``RECEIPTS PORT LAG_S`` from the command line."""
    return Tool(Path(sys.argv[1]), float(sys.argv[3]))
