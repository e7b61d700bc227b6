"""Running the proxy app under uvicorn: the listening socket, the start line, signals.

:func:`serve` binds the listening socket itself, and listens, before anything else
happens, so a port that is taken is reported plainly (a :class:`ConfigError`, the CLI's
usage/configuration exit code) before the ledger is opened and before anything
claims to be listening. It owns SIGINT, SIGTERM and SIGHUP: each one drains in-flight
calls, stops whatever runs ``alongside`` the proxy in the same event loop (the
demo upstream of ``serve --demo``), and returns normally.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.util
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager
from typing import Any

import uvicorn

from effectguard.config.settings import ServeSettings
from effectguard.errors import LedgerUnavailable
from effectguard.ingress.fdlimit import raise_open_files, watch_open_files
from effectguard.ingress.frontdoor import uvicorn_options
from effectguard.ingress.listeners import check_apart, listen_socket, start_listening
from effectguard.ingress.roomcap import IdleConnections
from effectguard.ingress.server import ProxyApp, create_app
from effectguard.ledger import shown_ledger
from effectguard.telemetry.logs import configure_logging

Alongside = Callable[[], AbstractAsyncContextManager[object]]
#: Exit status of a proxy whose startup failed (uvicorn's own).
STARTUP_FAILED = 3
#: ... because the ledger could not be reached: "the ledger is unavailable", as for every
#: command (an orchestrator can tell a database to wait for from a start to fix).
STARTUP_LEDGER_UNAVAILABLE = 4
#: The collector's youngest-generation threshold in a serving proxy (Python's: 700).
GC_YOUNG_THRESHOLD = 10_000
#: Each one drains and stops; any second one during the drain stops at once.
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

log = logging.getLogger(__name__)


def settle_gc() -> None:
    """Set the garbage collector up for serving, once the proxy has started.

    A request allocates hundreds of short-lived containers, nearly all freed by
    reference counting; with 32 requests in flight, Python's default threshold ran a
    young collection every few requests, which promoted in-flight objects and led to
    full collections over the ~50,000 objects of the loaded modules and the app. In
    process at 32 clients that was 23 us of CPU per request (11.7 us with the startup
    objects frozen, 0 with both changes: at 10,000 no collection ran in 3,000
    requests). Collecting first keeps startup's garbage out of the frozen set; cyclic
    garbage is still collected, after 10,000 net allocations.
    """
    gc.collect()
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, oldest)


def serve(
    settings: ServeSettings, metrics: Any = None, *, alongside: Alongside | None = None
) -> None:
    """Run the proxy until SIGINT, SIGTERM or SIGHUP (graceful: in-flight calls drain).

    ``alongside`` is entered in the proxy's event loop before it starts and left
    after it stops. Raises :class:`ConfigError` if the port (or ``metrics_port``) cannot
    be bound, or ``metrics_port`` is the proxy's own.
    """
    configure_logging(settings.log_format, settings.log_level)
    raise_open_files(settings.front_door.max_connections)
    sockets, sock, routed, metrics_sock = _listeners(settings, metrics is not None)
    routes = {s.getsockname()[1]: name for name, s in routed.items()}
    app = create_app(settings, metrics=metrics, metrics_socket=metrics_sock, routes=routes)
    start_line = _start_line(settings, sock, routed, metrics_sock)
    room = IdleConnections(None if metrics is None else metrics.closed_for_room)
    server = _Server(_config(settings, app, frozenset(routes), room), start_line)

    def connections() -> tuple[int, int]:
        return len(server.server_state.connections), len(room)

    def on_signal(sig: signal.Signals) -> None:
        if sig == signal.SIGHUP and not server.should_exit:
            # A hangup, a logrotate postrotate or a process manager's reload: serve has
            # nothing to reload or reopen, and ending at once would leave every call in
            # flight effect_unknown. So it drains as on SIGTERM, and says so.
            log.warning("SIGHUP: draining and stopping, as on SIGTERM (serve reloads nothing)")
        server.stop()
        if server.force_exit:
            app.stopping_at_once()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in _STOP_SIGNALS:
            loop.add_signal_handler(sig, on_signal, sig)
        watch = loop.create_task(watch_open_files(connections, room.close_idlest))
        try:
            async with alongside() if alongside is not None else contextlib.nullcontext():
                await server.serve(sockets=[sock, *routed.values()])
        finally:
            watch.cancel()
            for sig in _STOP_SIGNALS:
                loop.remove_signal_handler(sig)

    loop_factory = None
    if _has("uvloop"):
        import uvloop

        loop_factory = uvloop.new_event_loop
    try:
        with sockets, asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(main())
    finally:
        if not server.started:
            unavailable = isinstance(app.startup_error, LedgerUnavailable)
            _exit_startup_failed(STARTUP_LEDGER_UNAVAILABLE if unavailable else STARTUP_FAILED)


def _listeners(
    settings: ServeSettings, with_metrics: bool
) -> tuple[contextlib.ExitStack, socket.socket, dict[str, socket.socket], socket.socket | None]:
    """The proxy's socket, each provider port's and the ``metrics_port`` one, bound and
    listening before the ledger is opened (see ``start_listening``); the stack closes all
    but the metrics one, which the app's metrics listener owns."""
    sockets = contextlib.ExitStack()
    metrics_sock = None
    try:
        sock = sockets.enter_context(listen_socket(settings.host, settings.port))
        routed = {
            name: sockets.enter_context(listen_socket(settings.host, port))
            for name, port in settings.provider_ports.items()
        }
        metrics_sock = _metrics_socket(settings, sock) if with_metrics else None
        # Listened on once all are bound: check_apart compares them before any listens.
        start_listening([sock, *routed.values(), *([metrics_sock] if metrics_sock else [])])
    except BaseException:
        sockets.close()
        if metrics_sock is not None:
            metrics_sock.close()
        raise
    return sockets, sock, routed, metrics_sock


def _exit_startup_failed(code: int) -> None:
    """Exit non-zero now: a failed startup must never leave the process waiting.

    uvicorn reports the failure and raises ``SystemExit``, but the interpreter then waits
    for every non-daemon thread, and one left by the failed startup (a store's thread,
    an executor) would keep the process alive forever, not listening.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _metrics_socket(settings: ServeSettings, proxy: socket.socket) -> socket.socket | None:
    """The ``metrics_port`` listener's socket, bound now: before the ledger is opened."""
    if settings.metrics_port is None:
        return None
    sock = listen_socket(settings.metrics_host, settings.metrics_port)
    try:
        check_apart(proxy, sock)
    except BaseException:
        sock.close()
        raise
    return sock


def _config(
    settings: ServeSettings,
    app: ProxyApp,
    provider_ports: frozenset[int],
    room: IdleConnections | None = None,
) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        lifespan="on",
        log_level="warning",
        # Our handler (configure_logging) formats uvicorn's records too: no config of its own.
        log_config=None,
        access_log=False,
        server_header=False,
        date_header=False,
        # When it ends, requests still running are cancelled and each answers 504
        # effect_unknown for its call (ProxyApp._cut_off).
        timeout_graceful_shutdown=settings.drain_timeout_s,  # type: ignore[arg-type]
        **uvicorn_options(settings.front_door, provider_ports, room),
    )


def _start_line(
    settings: ServeSettings,
    sock: socket.socket,
    routed: dict[str, socket.socket],
    metrics: socket.socket | None = None,
) -> str:
    line = f"effectguard listening on {_url(sock)} (ledger {shown_ledger(settings.ledger)})"
    # After the ledger: tools read the proxy's URL as the first URL of this line. Each
    # other listener by its bound address, so a port 0 is found out from here.
    line += "".join(f"; {name} at {_url(s)}" for name, s in routed.items())
    return line + (f"; metrics at {_url(metrics)}/metrics" if metrics is not None else "")


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


class _Server(uvicorn.Server):
    """uvicorn's server, minus its own signal handling (:func:`serve` owns the signals)."""

    def __init__(self, config: uvicorn.Config, start_line: str) -> None:
        super().__init__(config)
        self._start_line = start_line

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn would re-raise a handled signal after its shutdown, ending the process
        # before whatever runs alongside the proxy has stopped.
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:  # the ledger is open and the socket accepts: say so now
            settle_gc()
            print(self._start_line, flush=True)

    def stop(self) -> None:
        """A first signal drains and stops; a second one stops without draining."""
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True
