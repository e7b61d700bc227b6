"""HTTP hygiene at the proxy's socket: deadlines and a size cap uvicorn does not have.

uvicorn bounds idle kept-alive connections (``timeout_keep_alive``) and the number
of connections (``limit_concurrency``), which :func:`uvicorn_options` sets. It has
no deadline for a request's headers or body and, with httptools, no cap on header
size: a client trickling one header byte a second (slowloris) holds a connection
forever, and a 30 MB header is buffered whole. :func:`protocol_for` builds
uvicorn's httptools protocol with three more limits:

* the request line and headers must arrive within ``header_timeout_s`` of the
  connection opening (or of the next request starting on a kept-alive one),
  else ``408`` and the connection closes;
* the body must arrive within ``body_timeout_s`` after the headers, else the
  connection closes (the app sees a disconnect; nothing was admitted), after any
  earlier answer on it is sent whole;
* request line plus headers larger than ``max_header_bytes`` get ``431``;
* a client that stops reading its answer (the socket's buffers full, writing paused)
  for ``send_timeout_s`` is cut off: to the app it has gone, and a stream it was sent
  is read to its end and settled without it, rather than held in flight for as long
  as the client holds the connection open;
* a client that closes its sending side once its request is whole (a half-close) is
  answered, then the connection closes (uvicorn closed it at once: the answer was lost).

And two changes to uvicorn's connection cap: a request read while it is reached takes
the place of the connection idle longest (:mod:`effectguard.ingress.roomcap`), and when
every connection has a request, ``GET /healthz`` is served past it, a few at a time
(:mod:`effectguard.ingress.probepass`).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from effectguard.config.settings import FrontDoor
from effectguard.ingress.probepass import ProbePass, is_probe
from effectguard.ingress.roomcap import IdleConnections

_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}
#: The scope extension, a callable, that tells the app whether its client has gone:
#: its connection was lost before the answer could be sent (callpath/orphans).
CLIENT_GONE = "effectguard.client_gone"


#: The scope extension, a callable, that cuts the client's connection off (a response
#: under way that cannot be finished), so the server does not take it for an app's fault.
CUT_OFF = "effectguard.cut_off"
#: The scope extension, a callable, that sets what to call once the client's connection
#: is lost (at once if it is lost already; None: nothing). A key-less call's client that
#: timed out must be known as gone before its retry comes, not when its answer is written.
#: It is called with True when the connection is lost, and with False when the client
#: closed its sending side after its whole request: a half-close, which the wire cannot
#: tell from a close (a timed-out SDK's); its answer is still written.
ON_CLIENT_LOST = "effectguard.on_client_lost"


def client_gone(scope: Any) -> bool:
    """Whether the client of ``scope``'s request has gone (False if the server cannot tell)."""
    gone = scope.get("extensions", {}).get(CLIENT_GONE)
    return bool(gone is not None and gone())


def cut_off(scope: Any) -> bool:
    """Cut the connection of ``scope``'s request off; False if the server cannot."""
    cut = scope.get("extensions", {}).get(CUT_OFF)
    if cut is None:
        return False
    cut()
    return True


def on_client_lost(scope: Any) -> Callable[[Callable[[bool], None] | None], None]:
    """How to be told that the client of ``scope``'s request has gone (a no-op setter
    under a server that cannot tell)."""
    watch = scope.get("extensions", {}).get(ON_CLIENT_LOST)
    return _never if watch is None else watch


def _never(callback: Callable[[bool], None] | None) -> None:
    """Under a server that cannot tell: the answer's write finds out instead."""


def uvicorn_options(
    door: FrontDoor,
    provider_ports: frozenset[int] = frozenset(),
    room: IdleConnections | None = None,
) -> dict[str, Any]:
    """The ``uvicorn.Config`` options for the limits uvicorn enforces itself.
    ``provider_ports``: the local ports where ``/healthz`` is a provider's path; ``room``:
    where the server's idle connections are kept (a new registry if None)."""
    return {
        "http": protocol_for(door, provider_ports, room),
        "limit_concurrency": door.max_connections or None,
        "timeout_keep_alive": door.keep_alive_timeout_s,
        # No WebSockets: with a WebSocket library importable (wsproto comes with some
        # test tools) uvicorn handed an upgrade request to its WebSocket protocol, past
        # this module's limits, and the app, which serves none, left it a 500 and an
        # ERROR line. Without, the request is plain HTTP and its Upgrade goes unheeded.
        "ws": "none",
    }


def protocol_for(
    door: FrontDoor,
    provider_ports: frozenset[int] = frozenset(),
    room: IdleConnections | None = None,
) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol, with ``door``'s deadlines and header cap."""
    own = {
        "door": door,
        "probes": ProbePass(),
        "room": IdleConnections() if room is None else room,
        "provider_ports": provider_ports,
    }
    return type("FrontDoorProtocol", (_FrontDoorProtocol,), own)


class _FrontDoorProtocol(HttpToolsProtocol):
    door: FrontDoor
    #: The health probes let past the connection cap: one for the server's connections.
    probes: ProbePass
    #: The server's connections with no request in progress: closed for room at the cap.
    room: IdleConnections
    #: Local ports (provider_ports) where /healthz is the provider's: no probe passes there.
    provider_ports: frozenset[int]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._in_headers = False
        self._header_bytes = 0
        self._refused = False
        self._lost = False
        #: The client closed its sending side after its whole request (see eof_received).
        self._ended = False
        #: A pipelined request was refused: close once the answer before it is sent.
        self._close_when_answered = False
        #: Set while writing is paused: when the client is cut off for not reading.
        self._stalled: asyncio.TimerHandle | None = None
        #: Each request's scope extensions (one dict for the connection: they describe it).
        self._extensions: dict[str, Any] = {
            CLIENT_GONE: self._client_gone,
            CUT_OFF: self._cut_off,
            ON_CLIENT_LOST: self._on_lost,
        }
        #: What to call when the connection is lost (its current request's watcher).
        self._lost_callback: Callable[[bool], None] | None = None
        #: The request whose app is running: with requests pipelined behind it, uvicorn's
        #: ``self.cycle`` is the last one read, still queued (see _mark_gone).
        self._running: Any = None

    # -- phases ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.room.idle(self)
        self._start_headers()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = self._extensions
        self._start_headers()

    def on_headers_complete(self) -> None:
        self._in_headers = False
        # Headers that came in one read end here, before data_received can count them
        # (and on a kept-alive connection it counts only from the message's start): what
        # the parser saw is measured, and the app never sees a request over the cap.
        if self._parsed() > self.door.max_header_bytes:
            self._refuse(431, f"headers are limited to {self.door.max_header_bytes} bytes")
            return
        self._arm(self.door.body_timeout_s, self._body_too_slow)
        self._headers_read()
        if not self.pipeline or self.pipeline[0][0] is not self.cycle:  # started at once
            self._running = self.cycle

    def _headers_read(self) -> None:
        """uvicorn's start of the request; at the cap, room made or a health probe let
        past it."""
        self.room.busy(self)
        limit = self.limit_concurrency
        # Below the cap (every request but a flood's), one comparison more than uvicorn's.
        if limit is None or max(len(self.connections), len(self.tasks)) < limit:
            super().on_headers_complete()
            return
        places = self.room.open_places(len(self.connections))
        if len(self.tasks) < limit and self.room.make_room(places - limit + 1):
            # The closed ones are still in uvicorn's count until their close is seen.
            self._past_the_cap(self.app)
        elif (
            is_probe(self.parser.get_method(), self.url)
            and (self.server[1] if self.server else None) not in self.provider_ports
        ):
            self._past_the_cap(self.probes.through(self.app))
        else:
            super().on_headers_complete()

    def _past_the_cap(self, app: Any) -> None:
        # uvicorn picks the app it runs (or its own plain 503) from these two, here only.
        limit, own = self.limit_concurrency, self.app
        self.limit_concurrency, self.app = None, app
        try:
            super().on_headers_complete()
        finally:
            self.limit_concurrency, self.app = limit, own

    def close_for_room(self) -> None:
        """Close this connection, which has no request in progress, to make room."""
        if not self.transport.is_closing():
            self.transport.close()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        self._disarm()
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self.room.gone(self)
        self._mark_gone()
        callback, self._lost_callback = self._lost_callback, None
        if callback is not None:
            callback(True)
        self._disarm()
        self._reading_again()
        super().connection_lost(exc)

    def eof_received(self) -> bool | None:  # type: ignore[override]  # asyncio allows it
        """The client closed its sending side. With a whole request still to be answered
        it may be waiting for the answer (HTTP allows a half-close): the connection stays
        open to write it, then closes. Else nothing can come of it: closed at once."""
        running = self._running if self.pipeline else self.cycle
        if running is None or running.response_complete or running.more_body:
            return None  # idle, or a request cut short: asyncio closes the transport
        # Requests queued behind it were sent by a client that may have left: never
        # served, as when its connection is lost. A next one begun has no end to wait for.
        self.pipeline.clear()
        self._in_headers = False
        self._disarm()
        running.keep_alive = False  # answered with "connection: close", then closed
        self._ended = True
        if self._lost_callback is not None:
            self._lost_callback(False)  # kept: a loss after this is told too
        return True

    # -- a client that stops reading ---------------------------------------------------
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stalled is None:
            self._stalled = self.loop.call_later(self.door.send_timeout_s, self._not_reading)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._reading_again()

    def _reading_again(self) -> None:
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None

    def _not_reading(self) -> None:
        self._stalled = None
        # Unsent bytes would never drain to a client that does not read: drop them.
        self._mark_gone()
        self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_headers:
            self._header_bytes += len(data)
        super().data_received(data)
        # Checked after parsing, so a body that arrives with the headers never counts.
        if self._in_headers and self._header_bytes > self.door.max_header_bytes:
            self._refuse(431, f"headers are limited to {self.door.max_header_bytes} bytes")

    def _parsed(self) -> int:
        """The request line and headers as parsed, in bytes (": ", CRLFs and the method
        and version counted at their usual size). Summed in C: it runs for every request."""
        names_and_values = sum(map(len, itertools.chain.from_iterable(self.headers)))
        return len(self.url) + 16 + 4 * len(self.headers) + names_and_values

    def _client_gone(self) -> bool:
        return self._lost

    def _on_lost(self, callback: Callable[[bool], None] | None) -> None:
        if callback is not None and self._lost:
            callback(True)
            return
        self._lost_callback = callback
        if callback is not None and self._ended:
            callback(False)

    def _cut_off(self) -> None:
        # Marked disconnected now (abort's connection_lost comes a loop turn later): then
        # uvicorn logs no "returned without completing response" error for an answer
        # cut off on purpose.
        self._mark_gone()
        self.transport.abort()

    def _mark_gone(self) -> None:
        """Mark the running request's answer, and the last one read, as going nowhere.

        uvicorn marks only the last request read (``self.cycle``). With requests
        pipelined behind the running one, that is a queued one: the running app's next
        write, woken as the lost connection resumed writing, went to the closed socket,
        which uvloop refuses with a RuntimeError: a 500 for a gone client and two ERROR
        lines with tracebacks, from any client that pipelines two requests and leaves.
        """
        for cycle in (self._running, self.cycle):
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True

    # -- deadlines ----------------------------------------------------------------------
    def _start_headers(self) -> None:
        if not self._in_headers:
            self._in_headers = True
            self._header_bytes = 0
            self._arm(self.door.header_timeout_s, self._headers_too_slow)

    def _arm(self, seconds: float, callback: Any) -> None:
        self._disarm()
        if seconds > 0:
            self._deadline = self.loop.call_later(seconds, callback)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _headers_too_slow(self) -> None:
        self._deadline = None
        if self._in_headers and not self.transport.is_closing():
            self._refuse(408, f"headers must arrive within {self.door.header_timeout_s:g} s")

    def _body_too_slow(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self.pipeline:
            # This request waits behind an earlier answer still to come: that one is sent
            # whole (RFC 9112 §9.3.2), then the connection closes, this one never served.
            self.pipeline.clear()
            self._refused = True
            self._close_when_answered = True
            return
        # The app owns the response now; closing shows it a disconnect (nothing admitted).
        self.transport.close()

    def on_response_complete(self) -> None:
        if self._close_when_answered:
            self.transport.close()
            return
        queued = self.pipeline[-1][0] if self.pipeline else None
        super().on_response_complete()
        if queued is not None and not (self.pipeline and self.pipeline[-1][0] is queued):
            self._running = queued  # uvicorn started the next pipelined request
        elif self.cycle.response_complete and not self.transport.is_closing():
            self.room.idle(self)  # kept alive, no request read yet

    def _refuse(self, status: int, message: str) -> None:
        self._disarm()
        self._in_headers = False
        self._refused = True  # nothing more this connection sends is read (a body, say)
        if self.transport.is_closing():  # the parser refused it already (400)
            return
        earlier = self.cycle
        if earlier is not None and not earlier.response_complete:
            # A pipelined request's refusal while an earlier answer is still to come: answers
            # go in request order (RFC 9112 §9.3.2), so that one is sent whole and the
            # connection then closed, with no answer to this one (and nothing more read).
            earlier.keep_alive = False
            return
        body = message.encode()
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s"
            % (status, _REASONS[status], len(body), body)
        )
        self.transport.close()
