"""``GET /healthz`` past ``[server] max_connections``, a few at a time.

uvicorn answers any request read while the cap is reached with a plain 503; a
connection with no request in progress gives its place up first
(:mod:`effectguard.ingress.roomcap`), so this is a cap full of requests under way. The
health probe asks about the ledger, not about load: a full cap (then of silent
connections too) failed it on a proxy that was otherwise well, so a liveness probe
restarted it and a readiness probe took every replica out of rotation. A probe read at
the cap is let through instead, with at most :data:`SPARE` of them in flight past it at
once, so a flood of probes is itself bounded; beyond that it gets the same 503.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from uvicorn.protocols.http.flow_control import service_unavailable

if TYPE_CHECKING:
    from uvicorn._types import ASGI3Application, ASGIReceiveCallable, ASGISendCallable, Scope

#: Probes in flight past the cap at once, per process.
SPARE = 8

_log = logging.getLogger("uvicorn.error")


def is_probe(method: bytes, target: bytes) -> bool:
    """Whether a request line's method and target are ``GET /healthz`` (a query aside).

    Exact bytes: the cap is checked before anything else parses the target, and a probe
    is sent plainly (an encoded or absolute-form ``/healthz`` waits its turn as any).
    """
    return method == b"GET" and (target == b"/healthz" or target.startswith(b"/healthz?"))


@dataclass
class ProbePass:
    """The probes past the cap in flight now, at most :data:`SPARE` (one event loop)."""

    passing: int = 0

    def through(self, app: ASGI3Application) -> ASGI3Application:
        """``app`` for one probe read at the cap: served while a spare place is free,
        else the cap's plain 503. Counted only while it runs: a probe that never starts
        (the server stopping) holds no place."""

        async def probe(scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
            if self.passing >= SPARE:
                _log.warning("Exceeded concurrency limit.")  # what uvicorn logs for the rest
                await service_unavailable(scope, receive, send)
                return
            self.passing += 1  # checked and taken with no await between: one loop, no race
            try:
                await app(scope, receive, send)
            finally:
                self.passing -= 1

        return probe
