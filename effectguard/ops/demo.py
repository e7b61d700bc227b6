"""``effectguard serve --demo``: an offline upstream inside the proxy's own process.

The fake provider (:mod:`effectguard.testing.fakeprovider`) is served from the
proxy's event loop on a loopback port bound up front, and the ``openai`` and
``anthropic`` providers point at it. One process, one event loop: Ctrl-C stops
both, and nothing can be left behind. The fake provider's receipt log (one line
per request that reached it) is written beside a SQLite ledger, or in the
working directory for a PostgreSQL ledger.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator, Collection
from pathlib import Path

from effectguard.ingress.listeners import listen_socket
from effectguard.ledger.sqlite import sqlite_path

#: The providers the demo answers for.
PROVIDERS = ("openai", "anthropic")
RECEIPTS = "effectguard-demo-receipts.jsonl"


def receipts_path(ledger: str) -> Path:
    """Where the demo's receipt log goes: beside a SQLite ledger, else in the working directory."""
    if ledger.startswith(("postgresql://", "postgres://")):
        return Path.cwd() / RECEIPTS
    return Path(sqlite_path(ledger)).resolve().parent / RECEIPTS


class DemoUpstream:
    """The fake provider on a free loopback port, to be run in the proxy's event loop."""

    def __init__(self, sock: socket.socket | None = None) -> None:
        # Bound now, so the URL is known before the proxy's settings are built.
        self._sock = sock or listen_socket("127.0.0.1", 0)
        self.port: int = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.answers_for: tuple[str, ...] = PROVIDERS

    def elsewhere(self, avoid: Collection[int]) -> DemoUpstream:
        """A new demo upstream on a port not in ``avoid``; this one's socket is closed.

        Every port tried stays bound until one fits, so the kernel cannot hand the same
        one back.
        """
        tried = [self._sock]
        try:
            while (sock := listen_socket("127.0.0.1", 0)).getsockname()[1] in avoid:
                tried.append(sock)
        finally:
            for held in tried:
                held.close()
        return DemoUpstream(sock)

    def upstreams(self, explicit: dict[str, str]) -> dict[str, str]:
        """The ``--upstream`` overrides with the demo providers pointed here, except those
        ``explicit`` (the operator's own ``--upstream``) sends elsewhere: theirs wins, and
        the start line names only the providers the demo really answers for."""
        self.answers_for = tuple(name for name in PROVIDERS if name not in explicit)
        return {name: self.url for name in self.answers_for} | explicit

    @contextlib.asynccontextmanager
    async def running(self, receipts: Path) -> AsyncIterator[None]:
        """Serve, logging receipts to ``receipts``, until the block ends (the proxy stopped)."""
        from aiohttp import web

        from effectguard.testing.fakeprovider import FakeSettings, create_app

        app = create_app(FakeSettings(receipts=receipts))
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await runner.setup()
        try:
            await web.SockSite(runner, self._sock).start()
            served = ", ".join(self.answers_for) or "no provider (each --upstream sends elsewhere)"
            print(
                f"effectguard demo: the fake provider answers for {served} at "
                f"{self.url} (offline; receipts in {receipts})",
                flush=True,
            )
            yield
        finally:
            await runner.cleanup()
            self._sock.close()
