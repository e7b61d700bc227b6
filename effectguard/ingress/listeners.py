"""The sockets ``serve`` listens on, bound and listening before anything else happens.

A port that is taken, or a host that names no address, is a :class:`ConfigError`
(exit 2, one line) while nothing has been opened or written yet: binding in the
app's lifespan would come after the ledger was created, and fail with a traceback.
The ``/metrics`` listener (``metrics_port``) is bound here too, and served from a
thread once the app has started.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import threading
from collections.abc import Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler

from effectguard.errors import ConfigError


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port``; a taken port is a :class:`ConfigError`."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise ConfigError(f"cannot listen on {host}: {exc.strerror}") from exc
    sock = socket.socket(family, kind, proto)
    # As uvicorn does: a restart may bind while the last run's connections sit in
    # TIME_WAIT; a port another process listens on is still refused.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"port {port} on {host} is already in use") from exc
        raise ConfigError(f"cannot listen on {host} port {port}: {exc.strerror}") from exc
    return sock


def start_listening(socks: Iterable[socket.socket]) -> None:
    """Listen on every socket :func:`listen_socket` bound, before the ledger is opened;
    a port another server took meanwhile is a :class:`ConfigError`.

    Bound is not yet held: every server binds with ``SO_REUSEADDR``, and the kernel lets a
    second one bind the same port until one of them listens. Listening only once the
    startup was done left the port to any server that started meanwhile (it took the port,
    clients talked to it, and this one wrote its ledger, then failed at ``listen``: under
    uvloop silently, so it printed its start line and ran on, registered and serving nothing).
    Connections that arrive while the startup runs wait in the kernel's queue, and are
    answered once it is done.
    """
    for sock in socks:
        host, port = sock.getsockname()[:2]
        try:
            sock.listen()  # uvicorn listens again, with its own backlog: that only resizes
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(f"port {port} on {host} is already in use") from exc
            raise ConfigError(f"cannot listen on {host} port {port}: {exc.strerror}") from exc


def check_apart(proxy: socket.socket, metrics: socket.socket) -> None:
    """Refuse a metrics socket on the proxy's own address (:class:`ConfigError`).

    Both are bound with ``SO_REUSEADDR`` and neither listens yet, so the kernel lets
    them share a port; whichever then listens would take the other's connections (the
    metrics server answered /healthz, and the proxy never saw a request). Compared as
    bound, so ``localhost`` and ``127.0.0.1`` are one host, and a wildcard address
    overlaps every other.
    """
    (host, port), (metrics_host, metrics_port) = proxy.getsockname()[:2], metrics.getsockname()[:2]
    if port != metrics_port:
        return
    wildcard = any(ipaddress.ip_address(h).is_unspecified for h in (host, metrics_host))
    if host == metrics_host or wildcard:
        raise ConfigError(
            f"metrics_port {port} is the proxy's own port on {host}: give /metrics a port "
            "of its own (or leave metrics_port unset to serve it on the proxy's port)"
        )


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """A scrape is not worth a log line."""


class MetricsListener:
    """``/metrics`` (prometheus' WSGI app) on a socket :func:`listen_socket` bound."""

    def __init__(self, sock: socket.socket, registry: Any) -> None:
        from prometheus_client import make_wsgi_app
        from prometheus_client.exposition import ThreadingWSGIServer

        # Built unbound, then given our socket: the server must not bind a second one.
        server = ThreadingWSGIServer(sock.getsockname()[:2], _Quiet, bind_and_activate=False)
        server.socket.close()
        server.socket = sock
        server.server_address = sock.getsockname()
        server.server_name, server.server_port = str(sock.getsockname()[0]), sock.getsockname()[1]
        server.setup_environ()
        server.set_app(make_wsgi_app(registry))
        self._server = server
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Listen and serve, in a daemon thread (as ``prometheus_client`` does)."""
        self._server.server_activate()
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="effectguard-metrics", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and close the socket."""
        if self._thread is not None:
            self._server.shutdown()
        self._server.server_close()
